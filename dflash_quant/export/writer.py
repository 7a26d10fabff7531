"""Write a quantized drafter in GPTQ v1 layout: tensors, configs, provenance and the per-layer report."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_quant import __version__
from dflash_quant.artifact.files import write_json_atomic
from dflash_quant.artifact.reports import Provenance, QuantReport
from dflash_quant.export.gptq_v1 import gptq_quantization_config, pack_gptq_v1
from dflash_quant.loading import LoadedDrafter
from dflash_quant.quantize.drafter import QuantOutcome, QuantSettings


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


def quantization_config(settings: QuantSettings, kept: list[str], n_layers: int) -> dict[str, Any]:
    """GPTQ v1 config; Linears kept in bf16 are listed as negative `dynamic` rules (vLLM/GPTQModel skip them)."""
    extra: dict[str, Any] = {"quantizer": [f"dflash-quant:{__version__}"], "dflash_quant": {"method": settings.method, "profile": settings.profile}}
    if kept:
        extra["dynamic"] = _skip_rules(kept, n_layers)
    return gptq_quantization_config(
        settings.bits, settings.group_size, settings.sym, settings.desc_act, settings.static_groups, settings.damp,
        true_sequential=settings.sequential, extra=extra,
    )


def _packed_bytes(path: Path, names) -> int:
    """Bytes the quantized Linears take in the written file (qweight + qzeros + scales + g_idx)."""
    from dflash_quant.memory.weights import read_header

    header = read_header(path)
    parts = ("qweight", "qzeros", "scales", "g_idx")
    return sum(header[f"{n}.{p}"]["data_offsets"][1] - header[f"{n}.{p}"]["data_offsets"][0] for n in names for p in parts)


def export_gptq(
    out: Path, source: LoadedDrafter, outcome: QuantOutcome, settings: QuantSettings,
    provenance: Provenance, quant_report: QuantReport,
) -> dict[str, Any]:
    """Fill `out` (an empty temp dir); returns the quantization_config written."""
    out = Path(out)
    state = {k: v.detach().cpu() for k, v in source.model.state_dict().items() if not k.startswith("rotary_emb.")}
    tensors: dict[str, torch.Tensor] = {}
    for name, qw in outcome.weights.items():
        state.pop(f"{name}.weight")
        for part, t in pack_gptq_v1(qw).items():
            tensors[f"{name}.{part}"] = t.contiguous()
    for key, t in state.items():
        tensors[key] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "quantized_by": f"dflash-quant {__version__}"})
    # bf16 Linears outside the backbone (DFlash2 conv/selector) must be skipped by GPTQ loaders too
    kept = outcome.kept + source.model.other_linear_names()
    qcfg = quantization_config(settings, kept, source.config.num_hidden_layers)
    config = dict(source.raw_config)
    config["quantization_config"] = qcfg
    config["torch_dtype"] = "bfloat16"
    write_json_atomic(out / "config.json", config)
    write_json_atomic(out / "quantize_config.json", qcfg)
    provenance.write(out)
    quant_report.quantized_bytes = _packed_bytes(out / "model.safetensors", outcome.weights)
    quant_report.write(out)
    return qcfg
