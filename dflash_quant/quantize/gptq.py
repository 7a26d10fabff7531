"""Textbook GPTQ (Frantar et al., 2022) in fp32: Hessian statistics and the column-by-column solver.

For one Linear y = x W^T, GPTQ minimises ||X W^T - X Q^T||^2 using H = 2 X^T X / n: it quantizes one input
column at a time and spreads that column's rounding error over the columns not yet quantized, weighted by
the Cholesky factor of H^-1. Updates are applied lazily in blocks of `block_size` columns.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.quantize.grid import QuantizedWeight, dequantize_codes, find_params, group_params, quantize_codes
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec

log = logging.getLogger(__name__)

DAMP_STEP = 10.0  # each retry multiplies damp by this
DAMP_TRIES = 4  # 0.01 -> 0.1 -> 1 -> 10 (x mean diagonal) before giving up


class GPTQFallbackWarning(UserWarning):
    """A layer was quantized with round-to-nearest because its Hessian could not be factorized."""


def damped_inverse_factor(H: torch.Tensor, damp_percent: float, tries: int) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor of (H + damp*mean(diag H)*I)^-1, raising damp x10 on failure; (None, last damp) if hopeless."""
    mean = H.diagonal().mean()
    damp = damp_percent
    if not torch.isfinite(mean) or mean <= 0:
        return None, damp
    for attempt in range(tries):
        if attempt:
            damp *= DAMP_STEP
        Hd = H.clone()
        Hd.diagonal().add_(damp * mean)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) != 0:
            continue
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        if int(info) == 0 and torch.isfinite(U).all():
            return U, damp
    return None, damp


def checked_inputs(
    weight: torch.Tensor, hessian: torch.Tensor | HessianAccumulator, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of a weight [out, in] and its Hessian [in, in], checked, with dead inputs handled.

    Inputs that were always zero carry no signal: their Hessian diagonal is pinned to 1 and their weight column
    zeroed."""
    if weight.dim() != 2:
        raise DFlashQuantError(f"layer {name!r}: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if isinstance(hessian, HessianAccumulator):
        hessian = hessian.hessian()
    in_features = weight.shape[1]
    if tuple(hessian.shape) != (in_features, in_features):
        raise DFlashQuantError(
            f"layer {name!r}: Hessian shape {tuple(hessian.shape)} does not match the weight's input width {in_features}"
        )
    W = weight.detach().float().clone()
    if not torch.isfinite(W).all():
        raise DFlashQuantError(f"layer {name!r}: weight has NaN/inf values; fix the checkpoint before quantizing")
    H = hessian.detach().to(device=W.device, dtype=torch.float32).clone()
    if not torch.isfinite(H).all():
        raise DFlashQuantError(f"layer {name!r}: Hessian has NaN/inf values; recollect calibration statistics")
    dead = H.diagonal() == 0
    H.diagonal().masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(0), 0.0)
    return W, H


@dataclass
class Setup:
    """The textbook's set-up of one matrix, before its column loop."""

    W: torch.Tensor  # fp32 [out, in], dead columns zeroed, permuted by `order`
    Hinv: torch.Tensor  # upper Cholesky factor of the damped inverse, permuted
    order: torch.Tensor
    col_group: torch.Tensor  # group of the column processed at step j
    scales: torch.Tensor | None  # [n_groups, out] when fixed up front (group -1 or static groups)
    zeros: torch.Tensor | None
    damp_used: float


def set_up(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    desc_act: bool,
    static_groups: bool,
    damp_percent: float,
    damp_tries: int,
    name: str,
    clip: bool,
    stacklevel: int,
) -> Setup | QuantizedWeight:
    """Checked inputs, group parameters fixed up front where they are, act-order permutation and the damped
    inverse factor; the RTN fallback (a QuantizedWeight) when no damping factorizes the Hessian.
    static_groups must already include clip (the clip search fixes every group's parameters up front)."""
    W, H = checked_inputs(weight, hessian, name)
    in_features = W.shape[1]
    width = spec.group_width(in_features, name)
    grouped = spec.group_size != -1
    scales = zeros = None
    if not grouped or static_groups:  # parameters come from the unpermuted weight
        scales, zeros = group_params(W, spec, name, H.diagonal() if clip else None)
    order = torch.arange(in_features, device=W.device)
    if desc_act:
        order = torch.argsort(H.diagonal(), descending=True, stable=True)
        W = W[:, order]
        H = H[order][:, order]
    # Group of the column processed at step j: static groups follow the original column index.
    col_group = (order if (static_groups or not grouped) else torch.arange(in_features, device=W.device)) // width
    Hinv, damp_used = damped_inverse_factor(H, damp_percent, damp_tries)
    del H
    if Hinv is None:
        return rtn_fallback(weight, spec, name, damp_used, stacklevel=stacklevel + 1)
    if damp_used != damp_percent:
        log.info("layer %r: damp raised from %g to %g to factorize its Hessian", name, damp_percent, damp_used)
    return Setup(W, Hinv, order, col_group, scales, zeros, damp_used)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    *,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
    block_size: int = 128,
    name: str = "",
    damp_tries: int = DAMP_TRIES,
    clip: bool = False,
) -> QuantizedWeight:
    """GPTQ-quantize `weight` [out, in] against `hessian` [in, in]; runs on the weight's device in fp32.

    clip: each group's scale/zero is chosen up front (static groups) with its range shrunk by the factor that
    minimises the Hessian-diagonal-weighted rounding error (`grid.clip_params`); plain GPTQ v1 parameters."""
    if not damp_percent > 0:
        raise UsageError(
            f"damp_percent must be > 0 (a fraction of the mean Hessian diagonal, e.g. 0.01), got {damp_percent}"
        )
    if block_size <= 0:
        raise UsageError(f"block_size must be positive, got {block_size}")
    static_groups = static_groups or clip  # the clip search fixes every group's parameters up front
    setup = set_up(weight, hessian, spec, desc_act, static_groups, damp_percent, damp_tries, name, clip, stacklevel=2)
    if isinstance(setup, QuantizedWeight):
        return setup
    W, Hinv, order, col_group, damp_used = setup.W, setup.Hinv, setup.order, setup.col_group, setup.damp_used
    in_features = W.shape[1]
    width = spec.group_width(in_features, name)
    n_groups = in_features // width
    precomputed = setup.scales is not None
    scales: list[torch.Tensor | None] = list(setup.scales) if setup.scales is not None else [None] * n_groups
    zeros: list[torch.Tensor | None] = list(setup.zeros) if setup.zeros is not None else [None] * n_groups
    col_group_list = col_group.tolist()

    maxq = spec.maxq
    Q = torch.empty_like(W)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = col_group_list[j]
            if not precomputed and j % width == 0:
                # Group starts here: take min/max over its columns as they are *now* (errors so far applied).
                end = j + width
                cols = W1[:, i : min(end, i2) - i1]
                if end > i2:
                    pending = W[:, i2:end] - Err1[:, :i] @ Hinv[i1:j, i2:end]
                    cols = torch.cat([cols, pending], dim=1)
                scales[g], zeros[g] = find_params(cols, spec)
            s, z = scales[g], zeros[g]
            w = W1[:, i]
            q = quantize_codes(w, s, z, maxq)
            Q[:, j] = q
            err = (w - dequantize_codes(q, s, z)) / Hinv1[i, i]
            W1[:, i:].sub_(err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        W[:, i2:].sub_(Err1 @ Hinv[i1:i2, i2:])

    g_idx = torch.empty(in_features, dtype=torch.int32, device=W.device)
    g_idx[order] = col_group.to(torch.int32)
    codes = torch.empty_like(Q)
    codes[:, order] = Q
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scales=torch.stack(cast(list[torch.Tensor], scales)),  # every group has its parameters by now
        zeros=torch.stack(cast(list[torch.Tensor], zeros)).to(torch.int32),
        g_idx=g_idx,
        spec=spec,
        desc_act=desc_act,
        static_groups=static_groups,
        damp_used=damp_used,
        fallback=None,
        name=name,
    )


def relative_output_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X (W - Wq)^T||^2 / ||X W^T||^2 computed through H (proportional to X^T X), in fp32."""
    W = weight.float()
    E = W - dequantized.to(W.device, torch.float32)
    H = hessian.to(W.device, torch.float32)
    num = ((E @ H) * E).sum()
    den = ((W @ H) * W).sum()
    return float(num / den) if den > 0 else float("nan")


def gptq_quantize_shared(
    weights: list[torch.Tensor],
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    *,
    names: list[str],
    **kwargs,
) -> list[QuantizedWeight]:
    """GPTQ of several Linears that read the same input (q/k/v, gate/up) in one pass.

    GPTQ treats output rows independently given H, and the column order, damping and Cholesky factor
    depend on H alone, so stacking the weights along the output dim gives exactly the per-matrix result
    with one column loop instead of several.
    """
    if len(weights) == 1:
        return [gptq_quantize(weights[0], hessian, spec, name=names[0], **kwargs)]
    stacked = gptq_quantize(
        torch.cat([w.detach().float() for w in weights]), hessian, spec, name="+".join(names), **kwargs
    )
    return split_rows(stacked, weights, names)


def rtn_fallback(
    weight: torch.Tensor, spec: QuantSpec, name: str, damp_used: float, stacklevel: int
) -> QuantizedWeight:
    """Round-to-nearest for a layer whose Hessian stays singular at every damp tried, said loudly (warning + log)."""
    why = f"rtn: Hessian not positive definite even at damp {damp_used:g} x mean diagonal"
    msg = f"GPTQ fell back to round-to-nearest for layer {name!r} ({why})"
    warnings.warn(msg, GPTQFallbackWarning, stacklevel=stacklevel + 1)
    log.warning(msg)
    qw = rtn_quantize(weight, spec, name=name, fallback=why)
    qw.damp_used = damp_used
    return qw


def split_rows(
    stacked: QuantizedWeight, weights: Sequence[torch.Tensor], names: Sequence[str]
) -> list[QuantizedWeight]:
    """One QuantizedWeight per matrix of a row-stacked solve (q/k/v or gate/up sharing one Hessian)."""
    out, row = [], 0
    for w, name in zip(weights, names, strict=True):
        rows = slice(row, row + w.shape[0])
        # Own copies: views of one stacked tensor would be shared storage in the exported file.
        out.append(
            replace(
                stacked,
                codes=stacked.codes[rows].clone(),
                scales=stacked.scales[:, rows].clone(),
                zeros=stacked.zeros[:, rows].clone(),
                g_idx=stacked.g_idx.clone(),
                name=name,
            )
        )
        row += w.shape[0]
    return out
