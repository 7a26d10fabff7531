"""Round-to-nearest baseline: every weight to its nearest grid point, no error feedback."""

from __future__ import annotations

import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.quantize.grid import QuantizedWeight, group_params, quantize_codes
from dflash_quant.quantize.spec import QuantSpec


def rtn_quantize(
    weight: torch.Tensor, spec: QuantSpec, *, name: str = "", fallback: str | None = None
) -> QuantizedWeight:
    """Quantize `weight` [out, in] group by group with min/max scales (GPTQ v1 grid)."""
    if weight.dim() != 2:
        raise DFlashQuantError(f"layer {name!r}: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    w = weight.float()
    if not torch.isfinite(w).all():
        raise DFlashQuantError(f"layer {name!r}: weight has NaN/inf values; fix the checkpoint before quantizing")
    out_features, in_features = w.shape
    width = spec.group_width(in_features, name)
    scales, zeros = group_params(w, spec, name)
    g_idx = torch.arange(in_features, device=w.device, dtype=torch.int32) // width
    g = g_idx.long()
    codes = quantize_codes(w, scales[g].T, zeros[g].T, spec.maxq)
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros.to(torch.int32),
        g_idx=g_idx,
        spec=spec,
        fallback=fallback,
        name=name,
    )
