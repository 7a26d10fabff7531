"""Write a quantized drafter in GPTQ v1 layout: tensors, configs, provenance and the per-layer report."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from dflash_quant import __version__
from dflash_quant.artifact.reports import Provenance, QuantReport
from dflash_quant.export.gptq_dynamic import dynamic_overrides
from dflash_quant.export.gptq_v1 import gptq_quantization_config, pack_gptq_v1
from dflash_quant.io.atomic import write_json_atomic
from dflash_quant.io.weights import read_header, save_safetensors
from dflash_quant.memory.weights import bytes_by_part
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.quantize.drafter import QuantOutcome
from dflash_quant.quantize.mixed import Candidate
from dflash_quant.quantize.settings import QuantSettings


def _skip_rules(kept: list[str], n_layers: int) -> dict[str, dict]:
    """Negative `dynamic` rules for Linears kept in bf16.

    Engines rename draft layers (vLLM offsets them by the target's layer count and fuses q/k/v into
    qkv_proj), so a Linear kept in every layer is matched by its suffix; one kept in some layers only
    is matched by its full name, which engines that renumber layers will not see.
    """
    by_suffix: dict[str, set[str]] = {}
    for name in kept:
        suffix = name if name == "fc" else ".".join(name.split(".")[-2:])
        by_suffix.setdefault(suffix, set()).add(name)
    rules: dict[str, dict] = {}
    for suffix, names in sorted(by_suffix.items()):
        if suffix == "fc" or len(names) == n_layers:
            rules["-:(^|.*\\.)" + re.escape(suffix) + "$"] = {}
        else:
            for name in sorted(names):
                rules["-:(^|.*\\.)" + re.escape(name) + "$"] = {}
    qkv = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    if qkv <= {s for s, names in by_suffix.items() if len(names) == n_layers}:
        rules["-:(^|.*\\.)self_attn\\.qkv_proj$"] = {}
    return rules


def quantization_config(
    settings: QuantSettings, kept: list[str], n_layers: int, picks: dict[str, tuple[int, int]] | None = None
) -> dict[str, Any]:
    """GPTQ v1 config; Linears kept in bf16 are listed as negative `dynamic` rules (vLLM/GPTQModel skip them),
    and a mixed-precision pick that differs from the base bits/group_size as an anchored positive rule."""
    ours: dict[str, Any] = {"method": settings.method, "profile": settings.profile}
    if settings.quantize_conv or settings.quantize_selector:
        ours.update(quantize_conv=settings.quantize_conv, quantize_selector=settings.quantize_selector)
    extra: dict[str, Any] = {"quantizer": [f"dflash-quant:{__version__}"], "dflash_quant": ours}
    dynamic: dict[str, dict] = _skip_rules(kept, n_layers) if kept else {}
    if picks:
        base = Candidate(settings.bits, settings.group_size)
        dynamic.update(dynamic_overrides({n: Candidate(b, g) for n, (b, g) in picks.items()}, base))
        ours["mixed"] = True
    if dynamic:
        extra["dynamic"] = dynamic
    return gptq_quantization_config(
        settings.bits,
        settings.group_size,
        settings.sym,
        settings.desc_act,
        settings.static_groups,
        settings.damp,
        true_sequential=settings.sequential,
        extra=extra,
    )


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in the written file, from its header."""

    return {
        name: int(info["data_offsets"][1]) - int(info["data_offsets"][0]) for name, info in read_header(path).items()
    }


def whole_drafter_bytes(state: dict[str, torch.Tensor], written: dict[str, int]) -> dict[str, Any]:
    """Every tensor of the source at bf16 vs every tensor of the written file, in total and by drafter part
    (backbone Linears, fc, norms, conv, selector codebooks, selector projection)."""

    bf16 = {name: t.numel() * 2 for name, t in state.items()}
    return {
        "drafter_bytes_bf16": sum(bf16.values()),
        "drafter_bytes_quantized": sum(written.values()),
        "by_part": {"bf16": bytes_by_part(bf16), "quantized": bytes_by_part(written)},
    }


def export_gptq(
    out: Path,
    model: DFlashDrafter,
    raw_config: dict[str, Any],
    outcome: QuantOutcome,
    settings: QuantSettings,
    provenance: Provenance,
    quant_report: QuantReport,
    picks: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Fill `out` (an empty temp dir); returns the quantization_config written."""
    out = Path(out)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    source_state = dict(state)
    tensors: dict[str, torch.Tensor] = {}
    for name, qw in outcome.weights.items():
        state.pop(f"{name}.weight")
        for part, t in pack_gptq_v1(qw).items():
            tensors[f"{name}.{part}"] = t.contiguous()
    for key, t in state.items():
        tensors[key] = t.to(torch.bfloat16).contiguous()
    save_safetensors(
        tensors,
        out / "model.safetensors",
        metadata={"format": "pt", "quantized_by": f"dflash-quant {__version__}"},
    )
    # bf16 Linears outside the backbone (DFlash2 conv/selector, unless quantized on request) must be skipped by
    # GPTQ loaders too; base_kernel and the codebooks are not Linears, so no loader expects qweight for them
    kept = outcome.kept + [n for n in model.other_linear_names() if n not in outcome.weights]
    qcfg = quantization_config(settings, kept, model.config.num_hidden_layers, picks)
    config = dict(raw_config)
    config["quantization_config"] = qcfg
    config["torch_dtype"] = "bfloat16"
    write_json_atomic(out / "config.json", config)
    write_json_atomic(out / "quantize_config.json", qcfg)
    provenance.write(out)
    written = _tensor_bytes(out / "model.safetensors")
    parts = ("qweight", "qzeros", "scales", "g_idx")
    quant_report.quantized_bytes = sum(written[f"{n}.{p}"] for n in outcome.weights for p in parts)
    for key, value in whole_drafter_bytes(source_state, written).items():
        setattr(quant_report, key, value)
    quant_report.write(out)
    return qcfg
