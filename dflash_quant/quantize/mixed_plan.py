"""Mixed precision chosen from measurement: the goal flags, the loss -> tau map (`--fit`'s budget and serving
settings: memory/fit.py).

The search (mixed.py) minimises the summed relative output error of the Linears. That sum is tied to
acceptance by measuring tau on development prompts (the first calibration prompts, never the held-out ones)
for each uniform setting: the points (summed loss, 1 - tau_q / tau_bf16) are fitted by a line through the
origin (tau loss ~= a * loss). `--max-bytes` / `--fit` need only the ordering of the losses, and the map
reports the tau ratio it predicts for the pick.
`--max-tau-loss x` plans against a conservative map, not the point estimate: the loss budget comes from the
slope's upper bound (paired bootstrap over the dev prompts; a few dozen prompts move tau by +-1 %), and no
Linear goes below the smallest uniform bit width not shown to miss the goal (its tau loss at the slope's lower
bound keeps x): the additive loss was validated on uniform drafters, and a mix reaching below that width
(2/3-bit Linears in a 4-bit drafter) measured under its prediction on held-out prompts.
Each solver kind gets its own slope there (`kind_slope_bounds`): act-order / clip-search drafters lose more tau
per unit of loss than plain ones (the map's uniform points on both shipped pairs: 0.241 vs 0.184 and 0.173 vs
0.133), since their loss is measured on the calibration rows the clip search fitted; one shared slope made
their mixes look better than they measured on held-out prompts.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dflash_quant.errors import UsageError
from dflash_quant.memory.fit import ServingKnobs
from dflash_quant.quantize.drafter import quantize_drafter
from dflash_quant.quantize.mixed import Candidate, Choice, min_bytes
from dflash_quant.speculative.verify import spec_runs

BITS = (2, 3, 4, 8)
# vLLM's Marlin kernels take groups 32/64/128 and per channel (-1); per channel drops the groups' scales and
# zeros (~0.14 bit/weight at 4-bit g128), the cheap size a sensitive Linear's smaller group is paid with
GROUPS = (32, 64, 128, -1)
TAU_GROUP = 128  # the uniform settings of the tau map: the default group, as users' uniform drafters are made
BOOT_DRAWS = 1000
BOOT_LEVEL = 0.95  # one-sided: the slope's upper bound


# How GPTQ may solve each grid (act-order with static groups, clip search): both write plain GPTQ v1 tensors
# (group-contiguous g_idx, fp16 scales, int zeros), so every engine that loads the grid loads them
SOLVERS = ((False, False), (True, False), (False, True), (True, True))


def candidates_for(shapes: Sequence[tuple[int, int]]) -> list[Candidate]:
    """bits 2/3/4/8 x groups 32/64/128/per channel, keeping the groups every Linear's input width splits into
    (GPTQ v1 packs whole int32 words: widths of drafters are multiples of 32), each solved four ways (SOLVERS)."""
    groups = [g for g in GROUPS if g == -1 or all(i % g == 0 for _, i in shapes)]
    bits = [b for b in BITS if all((o * b) % 32 == 0 and (i * b) % 32 == 0 for o, i in shapes)]
    return [Candidate(b, g, act, clip) for b in bits for g in groups for act, clip in SOLVERS]


def tau_points(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The uniform settings measured for the tau map: each bit width at group 128 (else at the largest group
    the widths allow, the nearest to the default, else per channel), solved plainly, and below 8 bits also with
    act-order + clip search when those are candidates: the map's line is then fitted across the solvers the
    search mixes, not only the plain one."""
    groups = {c.group_size for c in candidates}
    group = TAU_GROUP if TAU_GROUP in groups else max(groups)
    plain = [c for c in candidates if c.group_size == group and not c.act and not c.clip]
    tuned = [c for c in candidates if c.group_size == group and c.act and c.clip and c.bits < 8]
    return plain + tuned


@dataclass
class MixedGoal:
    max_tau_loss: float | None = None
    max_bytes: int | None = None
    max_bits_per_weight: float | None = None  # codes, scales and zeros of the quantized Linears (not g_idx)
    fit_gpu: str | None = None
    context: int | None = None
    target_weights: str | None = None
    dev_prompts: int = 32  # first N calibration prompts measured for the tau map
    dev_max_new_tokens: int = 64
    serving: ServingKnobs = field(default_factory=ServingKnobs)  # --fit: the serving settings given

    @property
    def kind(self) -> str:
        if self.max_tau_loss is not None:
            return "max_tau_loss"
        if self.max_bits_per_weight is not None:
            return "max_bits_per_weight"
        return "max_bytes" if self.max_bytes is not None else "fit"

    @property
    def value(self) -> str:
        if self.kind == "max_tau_loss":
            return str(self.max_tau_loss)
        if self.kind == "max_bytes":
            return str(self.max_bytes)
        if self.kind == "max_bits_per_weight":
            return str(self.max_bits_per_weight)
        given = "".join(f" {k} {v}" for k, v in self.serving.given().items())
        return f"{self.fit_gpu} context {self.context} target weights {self.target_weights or 'from files'}{given}"

    def check(self) -> None:
        given = [
            f
            for f, v in (
                ("--max-tau-loss", self.max_tau_loss), ("--max-bytes", self.max_bytes),
                ("--max-bits-per-weight", self.max_bits_per_weight), ("--fit", self.fit_gpu),
            )
            if v is not None
        ]  # fmt: skip
        if self.fit_gpu is None and (self.context is not None or self.target_weights is not None):
            raise UsageError("--context and --target-weights only apply with --fit GPU; add --fit or drop them")
        if self.fit_gpu is None and self.serving.given():
            flags = ", ".join("--" + k.replace("_", "-") for k in self.serving.given())
            raise UsageError(f"{flags} only apply with --fit GPU (the serving settings of the budget); add --fit")
        self.serving.check()
        if len(given) > 1:
            raise UsageError(f"{' and '.join(given)} are exclusive; pick one goal for the mixed-precision search")
        if not given:
            raise UsageError("give a mixed-precision goal: --max-tau-loss, --max-bytes, --max-bits-per-weight or --fit")
        if self.max_tau_loss is not None and not (0 < self.max_tau_loss < 1):
            raise UsageError(f"--max-tau-loss must be in (0, 1) (0.01 keeps 99 % of bf16 tau), got {self.max_tau_loss}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise UsageError(f"--max-bytes must be a positive size like 900KB or 1.2GB, got {self.max_bytes}")
        if self.max_bits_per_weight is not None and not (1 < self.max_bits_per_weight <= 16):
            raise UsageError(
                f"--max-bits-per-weight must be in (1, 16] (3.25: 3-bit g128 with room for a few 4-bit Linears), "
                f"got {self.max_bits_per_weight}"
            )
        if self.fit_gpu is not None and self.context is None:
            raise UsageError("--fit needs --context N (the context length to serve next to the target)")
        if self.context is not None and self.context < 1:
            raise UsageError(f"--context must be a positive number of tokens, got {self.context}")
        if self.dev_prompts < 1 or self.dev_max_new_tokens < 1:
            raise UsageError("--mix-dev-prompts and --mix-dev-new-tokens must be >= 1")


# ---------------------------------------------------------------------------------------------- tau map


def slope(points: Sequence[Mapping[str, Any]]) -> float:
    """Least-squares a in tau_loss ~= a * loss, through the origin. Points far from zero loss (2-3 bits) set
    it; the 4/8-bit points, whose tau loss on a few dozen prompts is mostly noise of +-1 %, weigh by loss^2."""
    sxx = sum(float(p["loss"]) ** 2 for p in points)
    sxy = sum(float(p["loss"]) * float(p["tau_loss"]) for p in points)
    return sxy / sxx if sxx > 0 else 0.0


def predict_tau_loss(points: Sequence[Mapping[str, Any]], loss: float, a: float | None = None) -> float:
    """Tau loss the map (slope `a`, default the fitted one) predicts for a summed loss."""
    return max(0.0, slope(points) if a is None else a) * loss


def loss_budget(points: Sequence[Mapping[str, Any]], max_tau_loss: float, a: float | None = None) -> float:
    """The largest summed loss whose predicted tau loss (slope `a`, default the fitted one) is <= max_tau_loss
    (every measured loss if the measurements show no tau loss at all)."""
    a = slope(points) if a is None else a
    if a <= 0:
        return max(float(p["loss"]) for p in points)
    return max_tau_loss / a


def _tau(tokens: Sequence[int], steps: Sequence[int], idx: Sequence[int]) -> float:
    return sum(tokens[i] for i in idx) / max(1, sum(steps[i] for i in idx))


def _resampled(
    curve: Mapping[str, Any], points: Sequence[Mapping[str, Any]], draws: int, seed: int
) -> list[dict[str, float]] | None:
    """Each point's tau loss on each of `draws` paired resamples of the dev prompts (every draw recomputes bf16
    and each point's tau on the same prompts), keyed by setting. None without per-prompt data."""
    base = curve.get("per_prompt")
    if not base or any("per_prompt" not in p for p in points):
        return None
    n = len(base["tokens"])
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        idx = gen.integers(0, n, n).tolist()
        t0 = _tau(base["tokens"], base["steps"], idx)
        out.append(
            {str(p["setting"]): 1 - _tau(p["per_prompt"]["tokens"], p["per_prompt"]["steps"], idx) / t0 for p in points}
        )
    return out


def _boot_slopes(
    curve: Mapping[str, Any], groups: Mapping[str, Sequence[Mapping[str, Any]]], draws: int, seed: int
) -> dict[str, list[float]] | None:
    """Per group of map points, the slope refitted on each of `draws` paired resamples of the dev prompts. None
    without per-prompt data."""
    draws_ = _resampled(curve, curve["points"], draws, seed)
    if draws_ is None:
        return None
    return {
        k: [slope([{"loss": p["loss"], "tau_loss": d[str(p["setting"])]} for p in ps]) for d in draws_]
        for k, ps in groups.items()
    }


def slope_bounds(
    curve: Mapping[str, Any], level: float = BOOT_LEVEL, draws: int = BOOT_DRAWS, seed: int = 0
) -> tuple[float, float] | None:
    """One-sided `level` bounds (lower, upper) of the map's slope: a paired bootstrap over the dev prompts (each
    draw resamples prompts, recomputes bf16 and every uniform setting's tau on them, and refits). None without
    per-prompt data."""
    slopes = _boot_slopes(curve, {"all": curve["points"]}, draws, seed)
    if slopes is None:
        return None
    return float(np.quantile(slopes["all"], 1 - level)), float(np.quantile(slopes["all"], level))


def kind(c: Candidate | str) -> str:
    """`plain` (GPTQ as is), `tuned` (act-order and/or clip search) or, for a map point only, `kl` (a uniform
    drafter tuned end to end after GPTQ, `+kl`): the map fits a slope per kind."""
    if isinstance(c, str):
        return "kl" if c.endswith("+kl") else "tuned" if "+" in c else "plain"
    return "tuned" if c.act or c.clip else "plain"


def kind_slope_bounds(
    curve: Mapping[str, Any], level: float = BOOT_LEVEL, draws: int = BOOT_DRAWS, seed: int = 0
) -> dict[str, tuple[float, float, float]] | None:
    """Per solver kind measured in the map: (lower bound, fitted slope, upper bound), the bounds one-sided at
    `level` from one paired bootstrap over the dev prompts (as slope_bounds). None without per-prompt data."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for p in curve["points"]:
        groups.setdefault(kind(str(p["setting"])), []).append(p)
    slopes = _boot_slopes(curve, groups, draws, seed)
    if slopes is None:
        return None
    return {
        k: (float(np.quantile(v, 1 - level)), slope(groups[k]), float(np.quantile(v, level))) for k, v in slopes.items()
    }


def point_bounds(
    curve: Mapping[str, Any],
    points: Sequence[Mapping[str, Any]],
    level: float = BOOT_LEVEL,
    draws: int = BOOT_DRAWS,
    seed: int = 0,
) -> dict[str, tuple[float, float]] | None:
    """Per map point, one-sided `level` (lower, upper) bounds of its own tau loss: the paired bootstrap of
    slope_bounds, without a line. None without per-prompt data."""
    draws_ = _resampled(curve, points, draws, seed)
    if draws_ is None:
        return None
    return {
        k: (float(np.quantile(v, 1 - level)), float(np.quantile(v, level)))
        for k in draws_[0]
        for v in [[d[k] for d in draws_]]
    }


def bits_of(setting: str) -> int:
    return int(str(setting).split("/")[0])


@dataclass
class KlLine:
    """The line a gptq-kl `--max-tau-loss` mix plans on (kl_line)."""

    floor: int  # no Linear below this width
    points: list[Mapping[str, Any]]  # the tuned points fitted: those at or above the floor
    slopes: tuple[float, float, float]  # lower bound, fitted, upper bound
    point_bounds: dict[str, tuple[float, float]]  # each tuned point's own tau-loss bounds
    dev_prompts: int

    def resolution_note(self, max_tau_loss: float) -> str | None:
        """A caveat when the dev prompts measure tau more coarsely than the goal asks: half the width of the
        two-sided 90 % interval of the widest fitted point (its smallest loss). The plan then stays conservative,
        and more dev prompts let it go smaller."""
        p = min(self.points, key=lambda q: float(q["loss"]))
        lo, hi = self.point_bounds[str(p["setting"])]
        if (hi - lo) / 2 <= max_tau_loss:
            return None
        return (
            f"the {self.dev_prompts} dev prompts measure tau to +-{(hi - lo) / 2:.3f} (uniform {p['setting']}), "
            f"coarser than --max-tau-loss {max_tau_loss}, so the plan stays conservative; --mix-dev-prompts 128 "
            "--mix-dev-new-tokens 128 (with ~256+ calibration prompts) let it go smaller"
        )


def kl_line(
    curve: Mapping[str, Any],
    kl_points: Sequence[Mapping[str, Any]],
    max_tau_loss: float,
    level: float = BOOT_LEVEL,
    draws: int = BOOT_DRAWS,
    seed: int = 0,
) -> KlLine | None:
    """The floor is the smallest width whose tuned uniform drafter is not shown to miss the goal (the lower bound
    of its own measured tau loss keeps it); the slope is fitted on the tuned points at or above the floor only.
    Tuning recovers nearly all of a small GPTQ loss but only part of a large one, so a line through the 2-bit
    point overstates a 3/4-bit mix's tau loss (reference pair, 128 dev prompts x 128 tokens: slope 0.153 through
    all three tuned points, 0.058 through the 3- and 4-bit ones). None without per-prompt data."""
    own = point_bounds(curve, kl_points, level, draws, seed)
    if own is None:
        return None
    keeps = [bits_of(p["setting"]) for p in kl_points if own[str(p["setting"])][0] <= max_tau_loss]
    floor = min(keeps) if keeps else max(bits_of(p["setting"]) for p in kl_points)
    used = [p for p in kl_points if bits_of(p["setting"]) >= floor]
    v = (_boot_slopes(curve, {"kl": used}, draws, seed) or {"kl": [slope(used)]})["kl"]
    bounds = (float(np.quantile(v, 1 - level)), slope(used), float(np.quantile(v, level)))
    return KlLine(floor, used, bounds, own, len(curve["per_prompt"]["tokens"]))


def mix_tau_loss(
    table: Mapping[str, Mapping[Candidate, tuple[int, float]]],
    picks: Mapping[str, Candidate],
    slopes: Mapping[str, float],
    default: float,
) -> float:
    """Predicted tau loss of a mix: each Linear's loss times its solver kind's slope (`default` for a kind the
    map did not measure)."""
    return sum(max(0.0, slopes.get(kind(c), default)) * table[n][c][1] for n, c in picks.items())


def bits_floor(points: Sequence[Mapping[str, Any]], max_tau_loss: float, a_low: float) -> int:
    """The smallest measured uniform bit width not shown to miss max_tau_loss: its predicted tau loss at the
    slope's lower bound keeps the goal (the widest measured one when none does). Lower widths are outside the
    region where the summed loss was validated against acceptance."""
    ok = [bits_of(p["setting"]) for p in points if max(0.0, a_low) * float(p["loss"]) <= max_tau_loss]
    return min(ok) if ok else max(bits_of(p["setting"]) for p in points)


def plan_tau_loss(
    table: Mapping[str, Mapping[Candidate, tuple[int, float]]],
    points: Sequence[Mapping[str, Any]],
    bounds: tuple[float, float] | None,
    max_tau_loss: float,
    kinds: Mapping[str, tuple[float, float, float]] | None = None,
    floor: int | None = None,
) -> tuple[Choice, float, int]:
    """`--max-tau-loss`: the fewest bytes whose loss keeps the goal at the slope's upper bound, searched over
    the candidates at or above the bit floor. With `kinds` (kind_slope_bounds) each Linear's loss counts at its
    solver kind's upper slope, relative to the plain one's. `floor` replaces the floor read from the line
    (kl_line's, from the measured points). Returns the choice (its total_loss the plain sum of
    the picks' losses), the loss budget (in plain-loss units) and the floor."""
    a_low, a_high = bounds or (slope(points), slope(points))
    floor = bits_floor(points, max_tau_loss, a_low) if floor is None else floor
    allowed = {n: {c: v for c, v in cs.items() if c.bits >= floor} for n, cs in table.items()}
    if not kinds:
        budget = loss_budget(points, max_tau_loss, a_high)
        return min_bytes(allowed, budget), budget, floor
    ref = kinds.get("plain", (a_low, a_high, a_high))[2]
    if ref <= 0:  # the plain points show no tau loss at all: the shared slope decides, as without kinds
        budget = loss_budget(points, max_tau_loss, a_high)
        return min_bytes(allowed, budget), budget, floor
    weight = {k: max(0.0, b[2]) / ref for k, b in kinds.items()}
    scaled = {
        n: {c: (b, e * weight.get(kind(c), a_high / ref)) for c, (b, e) in cs.items()} for n, cs in allowed.items()
    }
    budget = max_tau_loss / ref
    pick = min_bytes(scaled, budget)
    raw = sum(table[n][c][1] for n, c in pick.picks.items())
    return replace(pick, total_loss=raw), budget, floor


def uniform_loss(table: Mapping[str, Mapping[Candidate, tuple[int, float]]], c: Candidate) -> tuple[int, float]:
    return sum(t[c][0] for t in table.values()), float(sum(t[c][1] for t in table.values()))


def measure_points(
    model,
    target_model,
    stats,
    quant,
    dev_ids: list[list[int]],
    check,
    table: Mapping[str, Mapping[Candidate, tuple[int, float]]],
    progress: Callable[[str, int | None], Callable[[], None]],
    lengths_out: list[int] | None = None,
    tune: Callable[[Any, Mapping[str, Any]], None] | None = None,
) -> tuple[float, dict[str, list[int]], list[dict[str, Any]]]:
    """bf16 tau and its tokens/steps per prompt, and per uniform setting (summed loss, tau, tau ratio, tau
    loss, tokens/steps per prompt) on the dev prompts; `lengths_out` receives the bf16 drafter's acceptance
    lengths (for tau at fewer tokens, `--fit`). With `tune(model, weights)` (gptq-kl), each act-order + clip
    setting below 8 bits is also measured after that tuning (`+kl` points, at the loss of the grid it started
    from): a gptq-kl mix is tuned after the pick, so its tau follows those drafters' line."""

    def tau(m, label: str) -> tuple[float, dict[str, list[int]]]:
        runs = spec_runs(m, target_model, dev_ids, check, progress(f"mix: tau map, {label}", len(dev_ids)))
        if label == "bf16" and lengths_out is not None:
            lengths_out.extend(a for r in runs for a in r.acceptance_lengths)
        # tokens and steps per prompt: the bootstrap of the map resamples prompts
        per = {"tokens": [sum(r.acceptance_lengths) for r in runs], "steps": [len(r.acceptance_lengths) for r in runs]}
        return sum(per["tokens"]) / max(1, sum(per["steps"])), per

    tau_bf16, base = tau(model, "bf16")
    points = []
    settings = [(c, False) for c in tau_points(list(next(iter(table.values()))))]
    if tune is not None:
        settings += [(c, True) for c, _ in settings if c.act and c.clip]
    for c, tuned in settings:
        q = copy.deepcopy(model)
        each = replace(quant, bits=c.bits, group_size=c.group_size, desc_act=c.act, static_groups=c.act)
        outcome = quantize_drafter(q, stats, replace(each, clip_search=c.clip))
        label = fmt_cand(c) + ("+kl" if tuned else "")
        if tuned:
            assert tune is not None
            progress(f"mix: tau map, tuning uniform {label}", None)
            tune(q, outcome.weights)
        t, per = tau(q, f"uniform {label}")
        del q
        b, loss = uniform_loss(table, c)
        points.append(
            {
                "setting": label,
                "bytes": b,
                "loss": loss,
                "tau": round(t, 5),
                "tau_ratio": round(t / tau_bf16, 5),
                "tau_loss": round(1 - t / tau_bf16, 5),
                "per_prompt": per,
            }
        )
    return tau_bf16, base, points


# ---------------------------------------------------------------------------------------------- --fit


def nearest_uniform(
    table: Mapping[str, Mapping[Candidate, tuple[int, float]]], candidates: Sequence[Candidate], mix_bytes: int
) -> Candidate:
    """The smallest uniform setting at least as large as the mix (else the largest)."""
    sizes = sorted(((uniform_loss(table, c)[0], c) for c in candidates), key=lambda x: (x[0], x[1].bits))
    for b, c in sizes:
        if b >= mix_bytes:
            return c
    return sizes[-1][1]


def fmt_cand(c: Candidate) -> str:
    """`bits/group_size`, with `+act` (act-order, static groups) and `+clip` (clip search) when used."""
    return f"{c.bits}/{c.group_size}" + ("+act" if c.act else "") + ("+clip" if c.clip else "")


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
