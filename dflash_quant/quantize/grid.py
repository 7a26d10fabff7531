"""The integer grid of GPTQ v1 (AutoGPTQ / GPTQModel convention) and the quantized-weight container.

A weight w in group g of output row o is stored as an integer code q in [0, maxq] with
    w ~= scale[g, o] * (q - zero[g, o]),  maxq = 2**bits - 1.
Symmetric: zero = (maxq + 1) / 2 and scale = 2 * max|w| / maxq.
Asymmetric: scale = (max(w, 0) - min(w, 0)) / maxq and zero = round(-min / scale) clamped to the grid.

Two deliberate details, both so that what we report is exactly what a packed checkpoint decodes to:
- scales are rounded to fp16 *before* codes are chosen (checkpoints store fp16 scales; GPTQModel instead
  picks codes with the fp32 scale and rounds afterwards, which makes its own error estimates slightly off);
- asymmetric zero points are kept >= 1 by default (`v1_zeros=True`): GPTQ v1 stores zero-1 in `bits` bits,
  so a zero of 0 would be read back by vLLM's gptq kernel as 2**bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.quantize.spec import QuantSpec

FP16_TINY = torch.finfo(torch.float16).tiny  # smallest normal fp16: keeps scales full precision
FP16_MAX = torch.finfo(torch.float16).max


def find_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) for the columns of `w` [rows, k]; scale fp32 holding fp16 values, zero fp32 integers."""
    w = w.float()
    zero_col = torch.zeros(w.shape[0], device=w.device)
    xmin = torch.minimum(w.amin(dim=1), zero_col)
    xmax = torch.maximum(w.amax(dim=1), zero_col)
    maxq = spec.maxq
    if spec.sym:
        amax = torch.maximum(xmax, -xmin)
        amax = torch.where(amax == 0, torch.ones_like(amax), amax)  # all-zero row: any grid works
        scale = _fp16_scale(2 * amax / maxq)
        zero = torch.full_like(scale, (maxq + 1) // 2)
        return scale, zero
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / maxq
    if spec.v1_zeros:
        # A group that would get zero 0 is (almost) all >= 0: give it zero 1 and stretch the scale so
        # max still fits in the remaining maxq-1 steps.
        low = torch.round(-xmin / scale) < 1
        scale = torch.where(low, xmax / (maxq - 1), scale)
    scale = _fp16_scale(scale)
    zero = torch.round(-xmin / scale).clamp(1 if spec.v1_zeros else 0, maxq)
    return scale, zero


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    if torch.any(scale > FP16_MAX):
        raise DFlashQuantError(
            f"a quantization scale of {scale.max().item():.3g} overflows fp16 (weights above ~{FP16_MAX:.0f}); "
            "check the weights for corruption or keep that layer unquantized"
        )
    # Round *up* to the next fp16 value: a smaller scale would clip the group's extremes (at 8 bits the
    # nearest-fp16 error, up to 2**-11 relative, times 255 steps is a visible fraction of a step).
    s16 = scale.clamp(min=FP16_TINY).half()
    up = torch.nextafter(s16, torch.full_like(s16, float("inf")))
    return torch.where(s16.float() < scale, up, s16).float()


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (fp32 holding integers) for `w`, with scale/zero broadcastable to it."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale * (q - zero)


def group_params(
    weight: torch.Tensor, spec: QuantSpec, name: str = "", col_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros), each [n_groups, out], for contiguous input groups of `weight` [out, in].

    col_weight [in] (e.g. the Hessian diagonal): each group's range is shrunk by the factor in CLIP_SHRINKS
    that minimises sum_j col_weight[j] * (w_j - q(w_j))^2 for that row (`clip_params`)."""
    out_features, in_features = weight.shape
    width = spec.group_width(in_features, name)
    n = in_features // width
    groups = weight.float().reshape(out_features, n, width).transpose(0, 1).reshape(-1, width)
    if col_weight is None:
        scale, zero = find_params(groups, spec)
    else:
        cw = col_weight.float().to(weight.device).reshape(n, 1, width).expand(n, out_features, width)
        scale, zero = clip_params(groups, spec, cw.reshape(-1, width))
    return scale.reshape(n, out_features), zero.reshape(n, out_features)


# Range shrink factors tried per row and group: 1 (no clipping) down to 0.4 in steps of 0.03.
CLIP_SHRINKS = tuple(round(1.0 - 0.03 * k, 2) for k in range(21))


def clip_params(w: torch.Tensor, spec: QuantSpec, col_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """find_params with each row's range shrunk by the factor of CLIP_SHRINKS that minimises the weighted
    rounding error sum_j col_weight[j] * (w_j - q(w_j))^2 (col_weight broadcastable to w [rows, k]).

    Clipping the few largest weights of a group buys a finer step for all the others; at 2-3 bits that is
    usually worth it. Factor 1 is among those tried, so the weighted error is never above find_params'."""
    w = w.float()
    best_s, best_z = find_params(w, spec)
    best_e = _weighted_rounding_error(w, best_s, best_z, spec.maxq, col_weight)
    for f in CLIP_SHRINKS[1:]:
        s, z = find_params(w * f, spec)
        e = _weighted_rounding_error(w, s, z, spec.maxq, col_weight)
        better = e < best_e
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
        best_e = torch.where(better, e, best_e)
    return best_s, best_z


def _weighted_rounding_error(w, scale, zero, maxq, col_weight) -> torch.Tensor:
    s, z = scale.unsqueeze(1), zero.unsqueeze(1)
    d = w - dequantize_codes(quantize_codes(w, s, z, maxq), s, z)
    return (col_weight * d * d).sum(dim=1)


@dataclass
class QuantizedWeight:
    """One quantized Linear: codes [out, in], per-group scales/zeros [n_groups, out], g_idx [in] (input col -> group)."""

    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # fp32 [n_groups, out], values exactly representable in fp16
    zeros: torch.Tensor  # int32 [n_groups, out], in [0, maxq]
    g_idx: torch.Tensor  # int32 [in]
    spec: QuantSpec
    desc_act: bool = False
    static_groups: bool = False
    damp_used: float | None = None
    fallback: str | None = None
    name: str = ""

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[0]

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: exactly what the packed GPTQ v1 tensors decode to."""
        g = self.g_idx.long()
        scale = self.scales[g].T
        zero = self.zeros[g].T.float()
        return dequantize_codes(self.codes.float(), scale, zero)


def columns_in_order(qw: QuantizedWeight) -> bool:
    """True when every input column's group is column // group width (no act-order permutation)."""
    width = qw.in_features // qw.n_groups
    return bool(torch.equal(qw.g_idx.long(), torch.arange(qw.in_features, device=qw.g_idx.device) // width))
