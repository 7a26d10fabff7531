"""Mixed precision: per-Linear candidate costs and the search that picks one candidate per Linear.

Each Linear has candidates (bits, group size); each candidate has a size in bytes (as GPTQ v1 packs it) and
a loss (an additive estimate of what it costs in acceptance, e.g. the GPTQ output error trace((W-Q) H (W-Q)^T)
scaled by a measured tau change). The search is a multiple-choice knapsack solved exactly by dynamic
programming over a byte grid: one pass gives the least total loss for every byte budget, which answers both
"least loss under a byte budget" and "fewest bytes under a loss budget".
Cost: O(n_linears * n_candidates * budget / resolution) time, O(n_linears * budget / resolution) memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_quant.errors import UsageError
from dflash_quant.quantize.gptq import gptq_quantize
from dflash_quant.quantize.spec import QuantSpec


@dataclass(frozen=True)
class Candidate:
    """One setting of one Linear: the stored grid (bits, group size) and how GPTQ solves for it.

    act: act-order with static groups (columns solved by descending Hessian diagonal; every group's scale/zero
    fixed up front on the unpermuted weight), so g_idx stays group-contiguous and the stored layout is a plain
    GPTQ v1 one. clip: each group's range shrunk by the weighted-error-optimal factor (`grid.clip_params`).
    Neither changes the bytes; both only change which codes/scales are written."""

    bits: int
    group_size: int
    act: bool = False
    clip: bool = False

    def spec(self, sym: bool = True) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, sym=sym)

    @property
    def grid(self) -> Candidate:
        """The stored setting alone (what the export and the engines see)."""
        return Candidate(self.bits, self.group_size)


def packed_bytes(out_features: int, in_features: int, cand: Candidate) -> int:
    """Bytes of one GPTQ v1 Linear: int32-packed qweight and qzeros, fp16 scales, int32 g_idx."""
    if cand.bits == 16:
        return out_features * in_features * 2
    groups = 1 if cand.group_size == -1 else math.ceil(in_features / cand.group_size)
    qweight = math.ceil(in_features * cand.bits / 32) * out_features * 4
    qzeros = groups * math.ceil(out_features * cand.bits / 32) * 4
    scales = groups * out_features * 2
    g_idx = in_features * 4
    return qweight + qzeros + scales + g_idx


def bits_per_weight_bytes(shapes: Sequence[tuple[int, int]], bits_per_weight: float) -> int:
    """The GPTQ v1 bytes Linears of these (out, in) shapes may take at `bits_per_weight` for codes, scales and zeros.
    g_idx (one int32 per input column, the same at every setting) is added on top: it is column // group, which
    engines can rebuild, and at drafter sizes it would count as ~0.1 bit per weight."""
    weights = sum(o * i for o, i in shapes)
    return math.floor(bits_per_weight * weights / 8) + sum(i * 4 for _, i in shapes)


def coded_bits_per_weight(shapes: Sequence[tuple[int, int]], total_bytes: int) -> float:
    """bits per weight of codes, scales and zeros for Linears of these shapes taking total_bytes (bits_per_weight_bytes'
    inverse)."""
    weights = sum(o * i for o, i in shapes)
    return (total_bytes - sum(i * 4 for _, i in shapes)) * 8 / weights


def output_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """trace((W - Q) H (W - Q)^T) in fp32: the GPTQ objective, summed over output rows."""
    E = weight.float() - dequantized.float()
    return float(((E @ hessian.float()) * E).sum())


def candidate_errors(
    weight: torch.Tensor, hessian: torch.Tensor, candidates: Sequence[Candidate], *, sym: bool = True
) -> dict[Candidate, float]:
    """GPTQ-quantize one Linear at each candidate and return its output error against the same Hessian."""
    return {
        c: output_error(
            weight,
            gptq_quantize(weight, hessian, c.spec(sym), desc_act=c.act, static_groups=c.act, clip=c.clip).dequantize(),
            hessian,
        )
        for c in candidates
    }


@dataclass(frozen=True)
class Choice:
    """What the search picked: one candidate per Linear, with the totals it predicts."""

    picks: dict[str, Candidate]
    total_bytes: int
    total_loss: float


def _check(options: Mapping[str, Mapping[Candidate, tuple[int, float]]]) -> None:
    if not options:
        raise UsageError("mixed-precision search needs at least one Linear; the drafter has none to quantize")
    for name, cands in options.items():
        if not cands:
            raise UsageError(f"Linear {name!r} has no candidate settings; give at least one bits/group pair")
        for c, (b, loss) in cands.items():
            if b <= 0 or not math.isfinite(loss) or loss < 0:
                raise UsageError(
                    f"Linear {name!r} candidate {c}: bytes must be > 0 and loss finite and >= 0, got {b}, {loss}"
                )


def _frontier(
    options: Mapping[str, Mapping[Candidate, tuple[int, float]]], max_units: int, unit: int
) -> tuple[np.ndarray, list[np.ndarray], list[list[Candidate]]]:
    """best[u] = least total loss using at most u units; argument tables to trace the picks back."""
    inf = np.inf
    best = np.zeros(max_units + 1)
    back: list[np.ndarray] = []
    cand_lists: list[list[Candidate]] = []
    for cands in options.values():
        clist = list(cands)
        new = np.full(max_units + 1, inf)
        arg = np.full(max_units + 1, -1, dtype=np.int32)
        for k, c in enumerate(clist):
            b, loss = cands[c]
            w = math.ceil(b / unit)  # rounding up: a pick that fits on the grid fits in bytes
            if w > max_units:
                continue
            trial = np.full(max_units + 1, inf)
            trial[w:] = best[: max_units + 1 - w] + loss
            better = trial < new
            new[better] = trial[better]
            arg[better] = k
        best = new
        back.append(arg)
        cand_lists.append(clist)
    return best, back, cand_lists


def _trace(
    options: Mapping[str, Mapping[Candidate, tuple[int, float]]],
    back: list[np.ndarray],
    cand_lists: list[list[Candidate]],
    u: int,
    unit: int,
) -> Choice:
    names = list(options)
    picks: dict[str, Candidate] = {}
    for i in range(len(names) - 1, -1, -1):
        c = cand_lists[i][int(back[i][u])]
        picks[names[i]] = c
        u -= math.ceil(options[names[i]][c][0] / unit)
    ordered = {n: picks[n] for n in names}
    return Choice(
        picks=ordered,
        total_bytes=sum(options[n][c][0] for n, c in ordered.items()),
        total_loss=float(sum(options[n][c][1] for n, c in ordered.items())),
    )


def _unit(options: Mapping[str, Mapping[Candidate, tuple[int, float]]], resolution: int | None) -> int:
    if resolution is not None:
        if resolution <= 0:
            raise UsageError(f"search resolution must be a positive number of bytes, got {resolution}")
        return resolution
    # about 2^16 grid steps over the largest possible total keeps the DP under a second for ~100 Linears
    top = sum(max(b for b, _ in c.values()) for c in options.values())
    return max(1, top >> 16)


def max_quality(
    options: Mapping[str, Mapping[Candidate, tuple[int, float]]], max_bytes: int, *, resolution: int | None = None
) -> Choice:
    """Least total loss with total bytes <= max_bytes."""
    _check(options)
    unit = _unit(options, resolution)
    least = sum(min(b for b, _ in c.values()) for c in options.values())
    max_units = max_bytes // unit
    if max_bytes < least:
        raise UsageError(
            f"--max-bytes {max_bytes} is below the smallest possible drafter ({least} bytes, every Linear at its "
            "smallest setting); raise the budget or add lower-bit candidates"
        )
    best, back, cand_lists = _frontier(options, max_units, unit)
    if not np.isfinite(best[max_units]):
        raise UsageError(
            f"--max-bytes {max_bytes} fits no mix on a {unit}-byte search grid; raise the budget slightly "
            "or pass a finer resolution"
        )
    return _trace(options, back, cand_lists, max_units, unit)


def min_bytes(
    options: Mapping[str, Mapping[Candidate, tuple[int, float]]], max_loss: float, *, resolution: int | None = None
) -> Choice:
    """Fewest bytes with total loss <= max_loss."""
    _check(options)
    if not (math.isfinite(max_loss) and max_loss >= 0):
        raise UsageError(f"the loss budget must be a finite number >= 0, got {max_loss}")
    unit = _unit(options, resolution)
    top = sum(math.ceil(max(b for b, _ in c.values()) / unit) for c in options.values())
    best, back, cand_lists = _frontier(options, top, unit)
    ok = np.nonzero(best <= max_loss + 1e-12)[0]
    if ok.size == 0:
        least = float(best[top])
        raise UsageError(
            f"no mix keeps the predicted loss under {max_loss}: the best possible is {least:.4g}; "
            "loosen --max-tau-loss or add higher-bit candidates"
        )
    return _trace(options, back, cand_lists, int(ok[0]), unit)
