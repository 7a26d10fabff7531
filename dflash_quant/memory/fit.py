"""`gptq --fit`: room for the drafter next to a target on one card, and the serving settings that make room.

The budget (memory/budget.py, vLLM engine, batch 1) prices everything but the drafter's weights; the room is
``usable - required(weightless drafter)``. The serving settings the user did not give are searched; the
candidates, least costly first:

1. settings that leave the drafter's proposals alone, fewest changes first, in this order within a size:
   prefix caching off (``--no-enable-prefix-caching``: repeated prompt prefixes are prefilled again; one
   state page per request less), fp8 KV cache (``--kv-cache-dtype fp8``: target and drafter KV halve; vLLM
   has one KV dtype for both), bf16 recurrent state (``--mamba-ssm-cache-dtype bfloat16``: the Qwen3.5
   config asks for fp32; the state halves). The last two change the target's numerics slightly;
2. fewer speculative tokens K (each K frees a state slot and a conv row), with the settings of step 1 again
   at each K. Capping K caps acceptance: at temperature 0 a step's acceptance length becomes min(L, K + 1),
   so ``tau_K = 1 + sum_{i<=K} P(accept >= i)``, computed from the bf16 drafter's acceptance lengths
   measured on the development prompts (`tau_at_k`). That is an estimate: vLLM drafts ``[bonus, K masks]``
   (a shorter block) and DFlash's in-block attention is non-causal, so gptq also decodes the dev prompts at
   the chosen K and records the measured tau beside it.

Per K the least costly step-1 setting that leaves room for the uniform 4-bit drafter is taken (else the one
with the most room). Across K, fewer tokens buy room for more bits, so the choice is the K with the highest
predicted tau = tau_K(bf16) x the mix's predicted tau ratio in that room (gptq's tau map), ties to the
larger K. Given settings are kept as given. Raising ``--gpu-memory-utilization`` or dropping CUDA graphs
(``--cuda-graphs 0``: ``--enforce-eager``) is never chosen (the first risks out-of-memory outside what vLLM
profiles, the second slows every decode step); the user can pass them, and the refusal says what the most
permissive candidate reached.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from dflash_quant.errors import UsageError
from dflash_quant.memory.budget import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_CHUNK,
    BudgetSettings,
    ModelSpec,
    required_bytes,
)
from dflash_quant.memory.gpus import fmt_bytes, parse_bytes
from dflash_quant.memory.kv import dtype_bytes
from dflash_quant.memory.plan import budget_objects

# the step-1 changes, in the order tried within one number of changes
FREE_CHANGES = ("no_prefix_caching", "kv_fp8", "state_bf16")


@dataclass(frozen=True)
class ServingKnobs:
    """The serving settings `--fit` was given; None = left to the search (engine default first)."""

    spec_tokens: int | None = None
    kv_dtype: str | None = None
    drafter_kv_dtype: str | None = None
    state_dtype: str | None = None
    prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = None
    cuda_graphs: str | None = None

    def given(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check(self) -> None:
        """Refuse a bad value before anything is loaded (the same checks `budget` makes)."""

        for flag, value in (("--kv-dtype", self.kv_dtype), ("--drafter-kv-dtype", self.drafter_kv_dtype),
                            ("--state-dtype", self.state_dtype)):  # fmt: skip
            if value is not None and value != "auto":
                dtype_bytes(value, what=flag)
        if self.spec_tokens is not None and self.spec_tokens < 1:
            raise UsageError(f"--spec-tokens must be at least 1 (got {self.spec_tokens})")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1] (got {u})")
        if self.cuda_graphs is not None:
            parse_bytes(self.cuda_graphs, what="--cuda-graphs")


@dataclass
class FitChoice:
    """What `--fit` settled on: the settings, the room they leave and the engine flags to serve with."""

    gpu: str
    context: int
    target_weights: str | None
    settings: dict  # spec_tokens, kv_dtype, drafter_kv_dtype, state_dtype, prefix_caching, utilization, cuda_graphs
    changed: list[str]  # what the search changed from the given settings (empty: they fit as given)
    drafter_room: int  # bytes the drafter's weights may take
    usable_bytes: int
    required_without_drafter: int
    given_room: int  # room at the settings as given
    engine_flags: list[str]
    tried: int  # settings evaluated
    notes: list[str] = field(default_factory=list)
    # from the tau side (gptq): tau the bf16 drafter keeps at this K on the dev prompts, and the prediction
    tau_bf16_at_k: float | None = None
    tau_bf16_at_k_measured: float | None = None
    tau_bf16_full: float | None = None
    predicted_tau: float | None = None
    options: list[dict] = field(default_factory=list)  # per K: settings changed, room, predicted tau

    def as_dict(self) -> dict:
        return asdict(self)


def budget_for(target: str, drafter: str, gpu: str, context: int, target_weights: str | None, knobs: ServingKnobs):
    """(target, drafter, settings) as `budget` builds them from the same flags (vLLM engine, batch 1)."""

    return budget_objects(
        target, drafter, gpu, context, 1, knobs.spec_tokens, target_weights, knobs.kv_dtype,
        knobs.drafter_kv_dtype, knobs.state_dtype, "vllm", knobs.gpu_memory_utilization, None, knobs.cuda_graphs,
        DEFAULT_PREFILL_CHUNK, DEFAULT_MAX_NUM_SEQS, None, 0, 128,
        prefix_caching=True if knobs.prefix_caching is None else knobs.prefix_caching,
    )  # fmt: skip


def room(t: ModelSpec, d: ModelSpec, s: BudgetSettings) -> tuple[int, int, int]:
    """(drafter room, usable, required with a weightless drafter)."""
    usable = int(s.gpu_bytes * s.utilization)
    need, _ = required_bytes(t, replace(d, weight_bytes=0), s, s.context, 1)
    return usable - need, usable, need


def candidates(s: BudgetSettings, knobs: ServingKnobs, has_state: bool) -> list[tuple[BudgetSettings, list[str]]]:
    """Settings to try, least costly first (module docstring): step-1 changes by count, then K down to 1."""
    free = [
        c for c in FREE_CHANGES
        if (c == "no_prefix_caching" and knobs.prefix_caching is None and has_state)
        or (c == "kv_fp8" and knobs.kv_dtype is None and knobs.drafter_kv_dtype is None)
        or (c == "state_bf16" and knobs.state_dtype is None and has_state)
    ]  # fmt: skip
    combos = [list(c) for n in range(len(free) + 1) for c in itertools.combinations(free, n)]
    ks = [s.spec_tokens] if knobs.spec_tokens is not None else list(range(s.spec_tokens, 0, -1))
    out = []
    for k in ks:
        for combo in combos:
            c = replace(s, spec_tokens=k)
            if "no_prefix_caching" in combo:
                c = replace(c, prefix_caching=False)
            if "kv_fp8" in combo:
                c = replace(c, kv_dtype="fp8")
            if "state_bf16" in combo:
                c = replace(c, state_dtype="bf16")
            changed = ([f"spec_tokens {s.spec_tokens} -> {k}"] if k != s.spec_tokens else []) + combo
            out.append((c, changed))
    return out


def engine_flags(s: BudgetSettings, drafter_repo: str = "DRAFTER") -> list[str]:
    """`vllm serve` flags for these settings (vLLM's defaults left out, K always given)."""
    spec = f'{{"method": "dflash", "model": "{drafter_repo}", "num_speculative_tokens": {s.spec_tokens}}}'
    flags = [f"--speculative-config '{spec}'"]
    if s.kv_dtype:
        flags.append(f"--kv-cache-dtype {_vllm_dtype(s.kv_dtype)}")
    if s.state_dtype:
        flags.append(f"--mamba-ssm-cache-dtype {_vllm_dtype(s.state_dtype)}")
    if not s.prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if s.gpu_memory_utilization is not None:
        flags.append(f"--gpu-memory-utilization {s.gpu_memory_utilization}")
    if s.cuda_graph_bytes == 0:
        flags.append("--enforce-eager")
    return flags


def _vllm_dtype(name: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(name, name)


def _settings_dict(s: BudgetSettings) -> dict:
    return {
        "spec_tokens": s.spec_tokens,
        "kv_dtype": s.kv_dtype or "auto",
        "drafter_kv_dtype": s.drafter_kv_dtype or s.kv_dtype or "auto",
        "state_dtype": s.state_dtype or "auto",
        "prefix_caching": s.prefix_caching,
        "gpu_memory_utilization": s.utilization,
        "cuda_graph_bytes": s.cuda_graphs,
    }


@dataclass
class FitOption:
    settings: BudgetSettings
    changed: list[str]
    room: int
    usable: int
    required: int
    rank: int  # place in the cost order


def fit_options(
    target: str, drafter: str, gpu: str, context: int, target_weights: str | None, knobs: ServingKnobs
) -> tuple[list[FitOption], int]:
    """Every candidate setting in the cost order with the room it leaves, and the room at the given settings."""
    t, d, s0 = budget_for(target, drafter, gpu, context, target_weights, knobs)
    dm = d.as_model("bf16")
    given_room = room(t, dm, s0)[0]
    cands = candidates(s0, knobs, t.shape.recurrent is not None)
    return [FitOption(c, changed, *room(t, dm, c), rank=i) for i, (c, changed) in enumerate(cands)], given_room


def per_k(options: Sequence[FitOption], want: int, least: int) -> list[FitOption]:
    """One option per K, largest K first: the least costly that leaves `want` bytes, else the one that leaves
    the most room (when that holds at least `least`)."""
    out = []
    for k in sorted({o.settings.spec_tokens for o in options}, reverse=True):
        at = [o for o in options if o.settings.spec_tokens == k]
        good = [o for o in at if o.room >= want]
        pick = good[0] if good else max(at, key=lambda o: (o.room, -o.rank))
        if pick.room >= least:
            out.append(pick)
    return out


def choose(
    options: Sequence[FitOption], want: int, least: int, predict: Callable[[FitOption], float], gpu: str, context: int
) -> tuple[FitOption, list[tuple[FitOption, float]]]:
    """The option with the highest predicted tau among `per_k`'s (ties: the larger K, then the cheaper)."""
    ks = per_k(options, want, least)
    if not ks:
        raise refuse(gpu, context, options, least)
    scored = [(o, predict(o)) for o in ks]
    best = max(scored, key=lambda x: (round(x[1], 6), x[0].settings.spec_tokens, -x[0].rank))
    return best[0], scored


def refuse(gpu: str, context: int, options: Sequence[FitOption], least: int) -> UsageError:
    best = max(options, key=lambda o: (o.room, -o.rank))
    reach = ", ".join(best.changed) or "the given settings"
    flags = " ".join(engine_flags(best.settings)[1:]) or "no other flags"
    return UsageError(
        f"--fit {gpu} --context {context}: no serving setting leaves room for the drafter (the smallest mix "
        f"needs {fmt_bytes(least)}); the most permissive ({reach}; K={best.settings.spec_tokens}, {flags}) leaves "
        f"{fmt_bytes(best.room)}: lower --context, quantize the target further (--target-weights), or pass "
        "--gpu-memory-utilization / --cuda-graphs 0"
    )


def choice_record(
    gpu: str, context: int, target_weights: str | None, opt: FitOption, given_room: int, tried: int, **extra
) -> FitChoice:
    s = opt.settings
    notes = []
    if s.drafter_kv_dtype and s.drafter_kv_dtype != s.kv_dtype:
        notes.append("vLLM has one --kv-cache-dtype for target and drafter; --drafter-kv-dtype is a budget what-if")
    return FitChoice(
        gpu=s.gpu_name, context=context, target_weights=target_weights, settings=_settings_dict(s),
        changed=opt.changed, drafter_room=opt.room, usable_bytes=opt.usable, required_without_drafter=opt.required,
        given_room=given_room, engine_flags=engine_flags(s), tried=tried, notes=notes, **extra,
    )  # fmt: skip


def tau_at_k(lengths_hist: dict, k: int) -> float:
    """tau with at most K drafted tokens per step, from measured acceptance lengths (bonus token included):
    min(L, K + 1) per step, i.e. 1 + sum_{i<=K} P(accept >= i) at temperature 0."""
    n = sum(int(c) for c in lengths_hist.values())
    if n == 0:
        return float("nan")
    return sum(min(int(a), k + 1) * int(c) for a, c in lengths_hist.items()) / n


def hist_from_positions(per_position: Sequence[float], steps: int = 10_000) -> dict[str, int]:
    """Acceptance-length counts from a parity report's per-position acceptance (P(accept >= i), i = 1..),
    for `tau_at_k` when only that report exists."""
    ge = [1.0, *per_position, 0.0]
    return {str(n + 1): round(steps * (ge[n] - ge[n + 1])) for n in range(len(per_position) + 1)}


def drafter_linear_shapes(shape) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear a DFlash drafter config implies (fc, attention, MLP), for budgets without
    weights (the presets)."""
    h, m = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = {"fc": (h, h * shape.num_taps)}
    for i in range(shape.num_layers):
        for leaf, shp in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q)),
                          ("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):  # fmt: skip
            out[f"layers.{i}.{leaf}"] = shp
    return out
