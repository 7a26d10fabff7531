"""Round-to-nearest (RTN) fake quantization of a drafter's Linear weights: the sensitivity probe.

The reference pair must show quantization damage as lost acceptance; 2-bit RTN of every drafter Linear is
the probe (it must lose at least 20 % of tau). The same helper is the baseline the GPTQ code is compared to.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def rtn_fake_quantize(weight: torch.Tensor, bits: int, group_size: int = 128, sym: bool = False) -> torch.Tensor:
    """Quantize-dequantize ``weight`` [out, in] per group of ``group_size`` input columns (min-max RTN).

    Asymmetric: scale = (max - min) / (2^bits - 1), integer zero point; symmetric: scale = absmax /
    (2^(bits-1) - 1) ... 2^(bits-1) levels around zero, as GPTQ's symmetric grid. group_size -1 = per row.
    """
    w = weight.detach().float()
    out_f, in_f = w.shape
    g = in_f if group_size in (-1, 0, None) or group_size >= in_f else group_size
    if in_f % g:
        raise ValueError(f"input width {in_f} is not a multiple of group size {g}")
    wg = w.reshape(out_f, in_f // g, g)
    maxq = 2**bits - 1
    if sym:
        absmax = wg.abs().amax(-1, keepdim=True).clamp_min(1e-8)
        scale = 2 * absmax / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        lo = wg.amin(-1, keepdim=True).clamp_max(0)
        hi = wg.amax(-1, keepdim=True).clamp_min(0)
        scale = ((hi - lo) / maxq).clamp_min(1e-8)
        zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(wg / scale) + zero, 0, maxq)
    return ((q - zero) * scale).reshape(out_f, in_f).to(weight.dtype)


def _quantizer(bits: int, group_size: int, sym: bool):
    """The project's RTN (dflash_quant.quantize.rtn) when present, else the local min-max RTN."""
    try:
        from dflash_quant.quantize.rtn import rtn_quantize
        from dflash_quant.quantize.spec import QuantSpec
    except ImportError:
        return lambda w: rtn_fake_quantize(w, bits, group_size if w.shape[1] % group_size == 0 else -1, sym)

    def fn(w: torch.Tensor) -> torch.Tensor:
        g = group_size if group_size > 0 and w.shape[1] % group_size == 0 else -1
        qw = rtn_quantize(w, QuantSpec(bits=bits, group_size=g, sym=sym))
        out = qw.dequantize() if hasattr(qw, "dequantize") else qw
        if not isinstance(out, torch.Tensor) or out.shape != w.shape:
            return rtn_fake_quantize(w, bits, g, sym)
        return out.to(device=w.device, dtype=w.dtype)

    return fn


@torch.no_grad()
def rtn_quantize_drafter(
    drafter: nn.Module, bits: int = 2, group_size: int = 128, sym: bool = False, names: list[str] | None = None
) -> nn.Module:
    """A copy of ``drafter`` whose every nn.Linear weight (or only those named, e.g. the backbone's
    ``linear_names()`` of a DFlash2 drafter, whose conv and selector stay bf16) is RTN quantize-dequantized."""
    q = copy.deepcopy(drafter)
    fn = _quantizer(bits, group_size, sym)
    for name, module in q.named_modules():
        if isinstance(module, nn.Linear) and (names is None or name in names):
            module.weight.copy_(fn(module.weight))
    return q
