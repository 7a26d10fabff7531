"""Load a drafter, bf16 or one of our quantized artifacts in any format (dequantized through that format's codec),
from a local dir, a shipped pair or a Hub repo id. Safetensors or GGUF only, no remote code; the config is
checked against the weights' headers before any model is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.export.gptq_dynamic import layer_setting
from dflash_quant.io.compressed_tensors import read_compressed_tensors
from dflash_quant.io.gguf import read_gguf
from dflash_quant.io.gptq_v1 import unpack_gptq_v1
from dflash_quant.io.mlx import read_mlx
from dflash_quant.io.source import Source, resolve
from dflash_quant.io.weights import (
    DENSE,
    GGUF,
    GPTQ,
    config_format,
    confined,
    mlx_packing_problem,
    read_safetensors,
    tensor_entries,
)
from dflash_quant.models.checks import check_draft_weights
from dflash_quant.models.config import DFlashDraftConfig, parse_draft_config, read_config_json
from dflash_quant.models.config_check import draft_fields
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.models.model2 import build_drafter


@dataclass
class LoadedDrafter:
    model: DFlashDrafter
    config: DFlashDraftConfig
    source: Source
    quantization: dict[str, Any] | None = None  # the artifact's quantization_config, if any
    raw_config: dict[str, Any] = field(default_factory=dict)


def read_draft_config(source: Source) -> tuple[dict[str, Any], DFlashDraftConfig]:
    """(raw config.json, parsed config) of a drafter dir, checked against its weights' headers first, so a
    config claiming 10^9 layers is refused in milliseconds instead of being built."""
    file = confined(source.path, "config.json")
    raw = read_config_json(file)
    fields = draft_fields(raw, str(file))
    entries = tensor_entries(source.path, required=False)
    if problem := mlx_packing_problem(source.path, entries):
        raise DFlashQuantError(problem)
    # MLX / compressed-tensors pack their weights under other shapes: only the layer count is compared for them
    # (GGUF entries carry the logical shape, GPTQ's qweight its output width)
    fmt = config_format(raw)
    check_draft_weights(fields, entries, str(file), shapes=fmt in (DENSE, GPTQ, GGUF))
    return raw, parse_draft_config(raw, source=str(file))


def _dequantize_gptq(
    tensors: dict[str, torch.Tensor], qcfg: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Dense weights of GPTQ v1 tensors, each Linear decoded exactly in fp32 and cast to `dtype` at once, and its
    packed tensors dropped: a 27B-class drafter held whole in fp32 took ~18 GB of host memory to load."""

    out: dict[str, torch.Tensor] = {}
    bases = {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    for key, value in tensors.items():
        base = key.rsplit(".", 1)[0]
        if base in bases:
            continue
        out[key] = value
    for base in sorted(bases):
        parts = {
            s: tensors[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if f"{base}.{s}" in tensors
        }
        if len(parts) < 4:
            raise DFlashQuantError(
                f"quantized layer {base} lacks {sorted({'qweight', 'qzeros', 'scales', 'g_idx'} - set(parts))}; re-export"
            )
        bits, group = layer_setting(qcfg, base)
        out[f"{base}.weight"] = unpack_gptq_v1(parts, bits=bits, group_size=group).to(dtype)
        for name in parts:
            del tensors[f"{base}.{name}"]
        if f"{base}.bias" in tensors:
            out[f"{base}.bias"] = tensors[f"{base}.bias"]
    return out


def _read_weights(source: Source, raw: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense weights of a drafter dir, each quantized format dequantized through its own reader (GPTQ straight
    to `dtype`; the caller casts the rest)."""
    qcfg = raw.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if method == GGUF:
        return read_gguf(source.path)
    tensors = read_safetensors(source.path)
    if method == "gptq":
        return _dequantize_gptq(tensors, qcfg, dtype)
    if method == "compressed-tensors":
        return read_compressed_tensors(tensors, qcfg)
    if method is not None:
        raise DFlashQuantError(
            f"{source.id} uses quant_method={method!r}; dflash-quant loads gptq, compressed-tensors, gguf and mlx artifacts"
        )
    if isinstance(raw.get("quantization"), dict):  # MLX affine (mlx-lm's config key)
        return read_mlx(tensors, raw["quantization"])
    return tensors


def load_drafter(
    src: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, revision: str | None = None
) -> LoadedDrafter:
    """Build a DFlashDrafter from a bf16 drafter dir / Hub id, or from a quantized artifact (dequantized)."""
    source = resolve(src, revision)
    raw, config = read_draft_config(source)
    qcfg = raw.get("quantization_config") or raw.get("quantization")
    tensors = _read_weights(source, raw, dtype)
    tensors = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in tensors.items()}
    for key, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise DFlashQuantError(f"{source.id}: tensor {key} contains NaN or inf; the checkpoint is damaged")
        tensors[key] = value.to(dtype)  # one tensor at a time (a no-op where it already is), not a second dict

    with torch.device("meta"):
        model = build_drafter(config)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        raise DFlashQuantError(f"{source.id}: weights do not match the DFlash layout ({'; '.join(parts)})")
    try:  # the read tensors become the parameters (assign): no second copy of the drafter on the host
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise DFlashQuantError(
            f"{source.id}: weight shapes do not match config.json ({first}); fix the config or weights"
        ) from exc
    with torch.device(device):  # meta init left inv_freq empty
        model.rotary_emb = type(model.rotary_emb)(config)
    model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers wraps .to() with @wraps(nn.Module.to): mypy sees it unbound
    return LoadedDrafter(model=model, config=config, source=source, quantization=qcfg, raw_config=raw)


def measure_resident(artifact: Path, device: str) -> dict[str, Any]:
    """Load the drafter with the project's loader and measure what it holds.

    CUDA: the allocator peak during loading (torch.cuda.max_memory_allocated minus what was allocated before)
    and what stays allocated. CPU: bytes of the loaded parameters and buffers. The loader dequantizes GPTQ
    tensors to bf16, so for a quantized artifact this is the bf16 form; `packed_bytes` is what an int4 kernel
    would keep resident instead (the packed tensors, from the safetensors headers).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DFlashQuantError("--device cuda was asked for but CUDA is not available; use --device cpu")
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        loaded = load_drafter(str(artifact), device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        held = torch.cuda.memory_allocated(dev) - before
        out = {"device": "cuda", "bytes": int(peak), "held_bytes": int(held), "method": "allocator peak"}
    elif dev.type == "cpu":
        loaded = load_drafter(str(artifact), device="cpu", dtype=torch.bfloat16)
        tensors = list(loaded.model.parameters()) + list(loaded.model.buffers())
        held = sum(t.numel() * t.element_size() for t in tensors)
        out = {"device": "cpu", "bytes": int(held), "held_bytes": int(held), "method": "tensor bytes"}
    else:
        raise DFlashQuantError(f"unsupported device {device!r}; use cpu or cuda")
    out["form"] = "dequantized bf16" if loaded.quantization else "bf16"
    del loaded
    return out
