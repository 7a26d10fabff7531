"""MLX affine-quantized safetensors (what `mx.quantize` produces and mlx-lm / dflash-mlx load), from GPTQ codes.

MLX stores per quantized Linear `weight` (uint32 [out, in*bits/32], codes packed along the input dim, lowest
bits first, a continuous bit stream for 3-bit), `scales` and `biases` ([out, in/group]), and
`"quantization": {"group_size", "bits"}` in config.json; a weight is scales * q + biases.
GPTQ's scale * (q - zero) is the same code with biases = -scale * zero: symmetric grids (zero 2**(bits-1))
give an exact fp16 bias, asymmetric ones round the bias to fp16 once. Group sizes 32/64/128 only, no act-order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.export.gptq_v1 import _pack_dim0, _unpack_dim0

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 8)


def grid_problem(bits: int, group_size: int, desc_act: bool) -> str | None:
    why = []
    if group_size not in GROUP_SIZES:
        why.append(f"group size {group_size} (MLX: {', '.join(map(str, GROUP_SIZES))})")
    if bits not in BITS:
        why.append(f"{bits}-bit")
    if desc_act:
        why.append("act-order without static groups (MLX has no column permutation)")
    if why:
        return f"GPTQ with {', '.join(why)} cannot be written as MLX affine; quantize with `gptq --group-size 64 --no-desc-act` (or group 32/128, or --desc-act --static-groups)"
    return None


def pack_weight(qw) -> dict[str, torch.Tensor]:
    from dflash_quant.export.convert import columns_in_order

    if not columns_in_order(qw):
        raise UsageError(f"{qw.name}: act-order GPTQ cannot be written as MLX affine; quantize with --no-desc-act")
    packed = _pack_dim0(qw.codes.T.contiguous(), qw.spec.bits).T.contiguous()  # int32 [out, in*bits/32]
    scales = qw.scales.T.contiguous()  # [out, groups], fp16 values
    biases = -(scales * qw.zeros.T.float())  # exact in fp32, one fp16 rounding below
    return {
        "weight": packed.view(torch.uint32) if hasattr(torch, "uint32") else packed,
        "scales": scales.to(torch.float16),
        "biases": biases.to(torch.float16),
    }


def write_mlx(dst: Path, art) -> dict[str, Any]:
    problem = grid_problem(
        art.bits, art.group_size, bool(art.qcfg.get("desc_act")) and not art.qcfg.get("static_groups")
    )
    if problem:
        raise UsageError(problem)
    qbytes = art.save_packed(dst, pack_weight, "mlx")
    config = dict(art.config)
    config.pop("quantization_config", None)
    config["quantization"] = {"group_size": art.group_size, "bits": art.bits, "mode": "affine"}
    config["dflash_quant"] = {
        "from": "gptq",
        "sym": art.sym,
        "profile": (art.qcfg.get("dflash_quant") or {}).get("profile"),
    }
    if "rope_theta" not in config:  # dflash-mlx builds the drafter from a top-level rope_theta
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    exact = "bit-identical codes and fp16 scales; " + (
        "biases -scale*zero exact in fp16" if art.sym else "biases -scale*zero rounded to fp16"
    )
    return {"format": "mlx", "files": ["model.safetensors", "config.json"], "quantized_bytes": qbytes, "exact": exact}


def dequantize_affine(
    weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """fp32 [out, in] = scales * q + biases from MLX's stored tensors (products exact in fp32)."""
    out = weight.shape[0]
    words = weight.view(torch.int32) if weight.dtype != torch.int32 else weight
    codes = _unpack_dim0(words.T.contiguous(), bits).T  # [out, in]
    in_features = codes.shape[1]
    if scales.shape != (out, in_features // group_size):
        raise DFlashQuantError(
            f"MLX scales {tuple(scales.shape)} do not fit weight [{out}, {in_features}] at group {group_size}"
        )
    s = scales.float().repeat_interleave(group_size, dim=1)
    b = biases.float().repeat_interleave(group_size, dim=1)
    return s * codes.float() + b


def read_mlx(tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> dict[str, torch.Tensor]:
    bits, group = int(quant["bits"]), int(quant["group_size"])
    bases = {
        k[: -len(".scales")] for k in tensors if k.endswith(".scales") and f"{k[: -len('.scales')]}.biases" in tensors
    }
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        base, _, part = key.rpartition(".")
        if base in bases and part in ("weight", "scales", "biases"):
            continue
        out[key] = value
    for base in sorted(bases):
        layer_q = q if isinstance(q := quant.get(base), dict) else {}
        out[f"{base}.weight"] = dequantize_affine(
            tensors[f"{base}.weight"],
            tensors[f"{base}.scales"],
            tensors[f"{base}.biases"],
            int(layer_q.get("bits", bits)),
            int(layer_q.get("group_size", group)),
        )
    return out
