"""The MLX affine codec (what `mx.quantize` produces and mlx-lm / dflash-mlx load).

Per quantized Linear: `weight` uint32 [out, in*bits/32] (codes packed along the input dim, lowest bits first, a
continuous bit stream for 3-bit), `scales` and `biases` [out, in/group]; a weight is scales * q + biases.
config.json says `"quantization": {"group_size", "bits"}` (per-Linear entries override them).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.gptq_v1 import pack_dim0, unpack_dim0


def pack_affine(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """MLX's tensors of one Linear from GPTQ's codes [out, in], scales and zeros [G, out]: scale * (q - zero) is
    the same code with biases = -scale * zero (exact in fp32, rounded once to fp16)."""
    packed = pack_dim0(codes.T.contiguous(), bits).T.contiguous()  # int32 [out, in*bits/32]
    scales = scales.T.contiguous()  # [out, groups], fp16 values
    biases = -(scales * zeros.T.float())  # exact in fp32, one fp16 rounding below
    return {
        "weight": packed.view(torch.uint32) if hasattr(torch, "uint32") else packed,
        "scales": scales.to(torch.float16),
        "biases": biases.to(torch.float16),
    }


def dequantize_affine(
    weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """fp32 [out, in] = scales * q + biases from MLX's stored tensors (products exact in fp32)."""
    out = weight.shape[0]
    words = weight.view(torch.int32) if weight.dtype != torch.int32 else weight
    codes = unpack_dim0(words.T.contiguous(), bits).T  # [out, in]
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
