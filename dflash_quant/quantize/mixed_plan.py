"""Mixed precision chosen from measurement: the goal flags, the loss -> tau map (`--fit`'s budget and serving
settings: memory/fit.py).

The search (mixed.py) minimises the summed relative output error of the Linears. That sum is tied to
acceptance by measuring tau on development prompts (the first calibration prompts, never the held-out ones)
for each uniform setting: the points (summed loss, 1 - tau_q / tau_bf16) are fitted by a line through the
origin (tau loss ~= a * loss). `--max-tau-loss x` becomes the loss budget x / a; `--max-bytes` / `--fit` need
only the ordering of the losses, and the map reports the tau ratio it predicts for the pick.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dflash_quant.errors import UsageError
from dflash_quant.memory.fit import ServingKnobs
from dflash_quant.quantize.mixed import Candidate

BITS = (2, 3, 4, 8)
GROUPS = (32, 128)


def candidates_for(shapes: Sequence[tuple[int, int]]) -> list[Candidate]:
    """bits 2/3/4/8 x groups 32/128, keeping the groups every Linear's input width splits into (GPTQ v1 packs
    whole int32 words: widths of drafters are multiples of 32); per channel when neither group fits."""
    groups = [g for g in GROUPS if all(i % g == 0 for _, i in shapes)] or [-1]
    bits = [b for b in BITS if all((o * b) % 32 == 0 and (i * b) % 32 == 0 for o, i in shapes)]
    return [Candidate(b, g) for b in bits for g in groups]


def tau_points(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The uniform settings measured for the tau map: each bit width at the widest searched group."""
    widest = max({c.group_size for c in candidates}, key=lambda g: (g == -1, g))
    return [c for c in candidates if c.group_size == widest]


@dataclass
class MixedGoal:
    max_tau_loss: float | None = None
    max_bytes: int | None = None
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
        return "max_bytes" if self.max_bytes is not None else "fit"

    @property
    def value(self) -> str:
        if self.kind == "max_tau_loss":
            return str(self.max_tau_loss)
        if self.kind == "max_bytes":
            return str(self.max_bytes)
        given = "".join(f" {k} {v}" for k, v in self.serving.given().items())
        return f"{self.fit_gpu} context {self.context} target weights {self.target_weights or 'from files'}{given}"

    def check(self) -> None:
        given = [
            f for f, v in (("--max-tau-loss", self.max_tau_loss), ("--max-bytes", self.max_bytes), ("--fit", self.fit_gpu))
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
            raise UsageError("give a mixed-precision goal: --max-tau-loss, --max-bytes or --fit")
        if self.max_tau_loss is not None and not (0 < self.max_tau_loss < 1):
            raise UsageError(f"--max-tau-loss must be in (0, 1) (0.01 keeps 99 % of bf16 tau), got {self.max_tau_loss}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise UsageError(f"--max-bytes must be a positive size like 900KB or 1.2GB, got {self.max_bytes}")
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


def predict_tau_loss(points: Sequence[Mapping[str, Any]], loss: float) -> float:
    """Tau loss the map predicts for a summed loss."""
    return max(0.0, slope(points)) * loss


def loss_budget(points: Sequence[Mapping[str, Any]], max_tau_loss: float) -> float:
    """The largest summed loss whose predicted tau loss is <= max_tau_loss (every measured loss if the
    measurements show no tau loss at all)."""
    a = slope(points)
    if a <= 0:
        return max(float(p["loss"]) for p in points)
    return max_tau_loss / a


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
) -> tuple[float, list[dict[str, Any]]]:
    """bf16 tau and, per uniform setting, (summed loss, tau, tau ratio, tau loss) on the dev prompts;
    `lengths_out` receives the bf16 drafter's acceptance lengths (for tau at fewer tokens, `--fit`)."""
    from dflash_quant.quantize.drafter import quantize_drafter
    from dflash_quant.verify import spec_runs

    def tau(m, label: str) -> float:
        runs = spec_runs(m, target_model, dev_ids, check, progress(f"mix: tau map, {label}", len(dev_ids)))
        lengths = [a for r in runs for a in r.acceptance_lengths]
        if label == "bf16" and lengths_out is not None:
            lengths_out.extend(lengths)
        return sum(lengths) / len(lengths)

    tau_bf16 = tau(model, "bf16")
    points = []
    for c in tau_points(list(next(iter(table.values())))):
        q = copy.deepcopy(model)
        quantize_drafter(q, stats, replace(quant, bits=c.bits, group_size=c.group_size))
        t = tau(q, f"uniform {c.bits}/{c.group_size}")
        del q
        b, loss = uniform_loss(table, c)
        points.append(
            {
                "setting": f"{c.bits}/{c.group_size}",
                "bytes": b,
                "loss": loss,
                "tau": round(t, 5),
                "tau_ratio": round(t / tau_bf16, 5),
                "tau_loss": round(1 - t / tau_bf16, 5),
            }
        )
    return tau_bf16, points


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
    return f"{c.bits}/{c.group_size}"


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
