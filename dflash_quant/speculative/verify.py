"""The built-in speculative decode check: tau, per-position acceptance, losslessness and speed over prompts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_quant.models.devmap import input_device
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.speculative.batch_decode import batched_speculative_generate, unbatchable
from dflash_quant.speculative.decode import (
    GreedyResult,
    SpecResult,
    speculative_generate,
    target_check,
    target_generate,
)
from dflash_quant.speculative.lookup import LookupSettings
from dflash_quant.speculative.teacher import TeacherRow, TeacherTarget, resident_ends


@dataclass
class CheckSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0
    block_size: int | None = None
    seed: int = 0
    stop_token_ids: list[int] | None = None
    lookup: LookupSettings | None = None  # also propose from each request's history (dflash_quant.speculative.lookup)
    # speculative runs decoded as rows of one batch (batch_decode) where the pair allows it; 1 = one by one
    batch: int = 1


def baseline_runs(
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    settings: CheckSettings,
    progress: Callable[[], None] | None = None,
) -> list[GreedyResult]:
    """Target-only greedy decoding of every prompt (the lossless reference and the speed baseline)."""

    device = input_device(target, torch.device("cpu"))
    runs = []
    for ids in prompts:
        runs.append(
            target_generate(
                target, torch.tensor([ids], device=device), settings.max_new_tokens, settings.stop_token_ids
            )
        )
        if progress:
            progress()
    return runs


# Prompts decoded target-only for the speed baseline when the reference comes from target_check.
TIMED_PROMPTS = 4


def reference_runs(
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    candidates: Sequence[list[int]],
    settings: CheckSettings,
    timed: int = TIMED_PROMPTS,
    progress: Callable[[], None] | None = None,
) -> list[GreedyResult]:
    """The target's greedy output per prompt, as baseline_runs gives it, checked against candidate outputs
    (a speculative run's tokens at T=0) in one forward each (target_check). A prompt whose candidate is not
    the target's greedy output, and the first `timed` prompts (the speed baseline), are decoded target-only
    one token per forward as in baseline_runs; if a decoded prompt disagrees with its check, every prompt is.
    """
    device = next(target.parameters()).device
    runs: list[GreedyResult] = []
    for i, (ids, cand) in enumerate(zip(prompts, candidates, strict=True)):
        prompt = torch.tensor([ids], device=device)
        checked = target_check(target, prompt, cand, settings.max_new_tokens, settings.stop_token_ids)
        if checked is None or i < timed:
            decoded = target_generate(target, prompt, settings.max_new_tokens, settings.stop_token_ids)
            if checked is not None and decoded.tokens != checked.tokens:  # one-forward check unlike decoding
                return baseline_runs(target, prompts, settings, progress)
            checked = decoded
        runs.append(checked)
        if progress:
            progress()
    return runs


def spec_runs(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    settings: CheckSettings,
    progress: Callable[[], None] | None = None,
    timed: int = TIMED_PROMPTS,
    teachers: Sequence[TeacherRow] | None = None,
) -> list[SpecResult]:
    """The speculative run of every prompt. With settings.batch > 1 (and a pair batch_decode takes), the first
    `timed` prompts still run one by one (their times are the speed measurement, as comparable with the
    target-only baseline's as before) and the others as batches of settings.batch rows (same results).
    teachers: one greedy record per prompt (speculative.teacher): each run replays it instead of the target."""

    if teachers is not None:
        if settings.temperature > 0 or settings.lookup is not None:
            raise ValueError("teacher-forced runs are greedy and without lookup")
        device = next(drafter.parameters()).device
        runs = []
        with resident_ends(target, device) as ends:
            for ids, row in zip(prompts, teachers, strict=True):
                runs.append(
                    speculative_generate(
                        drafter,
                        TeacherTarget(target, row, ends),
                        torch.tensor([ids], device=device),
                        settings.max_new_tokens,
                        stop_token_ids=settings.stop_token_ids,
                        block_size=settings.block_size,
                    )
                )
                if progress:
                    progress()
        return runs
    batched = settings.batch > 1 and unbatchable(drafter, target, settings.temperature, settings.lookup) is None
    alone = prompts[:timed] if batched else prompts
    runs = _one_by_one(drafter, target, alone, settings, progress)
    if batched:
        rest = list(prompts[len(alone) :])
        for i in range(0, len(rest), settings.batch):
            chunk = rest[i : i + settings.batch]
            runs += batched_speculative_generate(
                drafter, target, chunk, settings.max_new_tokens, settings.stop_token_ids, settings.block_size
            )
            for _ in chunk:
                if progress:
                    progress()
    return runs


def _one_by_one(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    settings: CheckSettings,
    progress: Callable[[], None] | None,
) -> list[SpecResult]:
    device = next(drafter.parameters()).device  # a split target takes its inputs from the drafter's device
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    runs = []
    for ids in prompts:
        runs.append(
            speculative_generate(
                drafter,
                target,
                torch.tensor([ids], device=device),
                settings.max_new_tokens,
                temperature=settings.temperature,
                stop_token_ids=settings.stop_token_ids,
                block_size=settings.block_size,
                generator=generator,
                lookup=settings.lookup,
            )
        )
        if progress:
            progress()
    return runs


def warm_up(drafter: DFlashDrafter, target: torch.nn.Module, ids: list[int], settings: CheckSettings) -> None:
    """One short run of each path so one-time costs (kernels, allocator) stay out of the timings."""
    short = CheckSettings(
        max_new_tokens=min(8, settings.max_new_tokens), block_size=settings.block_size, lookup=settings.lookup
    )
    spec_runs(drafter, target, [ids], short)
    baseline_runs(target, [ids], short)


# A reduced-precision target may flip its argmax where the top-2 logits are this close: a multi-token verify
# forward rounds differently from one-token decoding. Measured in units in the last place of the top-1 logit
# in the logits' dtype (bf16: 8 ulps of a logit of 20 are 1.0).
NEAR_TIE_ULPS = 8
_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}


def near_tie_margin(top1: float, dtype: str) -> float:
    exponent = math.floor(math.log2(max(abs(top1), 2.0**-14)))
    return NEAR_TIE_ULPS * 2.0 ** (exponent - _MANTISSA_BITS.get(dtype, 23))


def divergences(runs: list[SpecResult], baseline: list[GreedyResult]) -> tuple[float, list[dict[str, Any]]]:
    """Token match rate (common prefix / target-only tokens) and, per differing prompt, where it first
    diverges and the target-only run's top-1/top-2 logit margin there."""
    matched = total = 0
    found = []
    for i, (r, b) in enumerate(zip(runs, baseline, strict=True)):
        k = 0
        while k < min(len(r.tokens), len(b.tokens)) and r.tokens[k] == b.tokens[k]:
            k += 1
        matched += k
        total += len(b.tokens)
        if r.tokens == b.tokens:
            continue
        margin = b.margins[k] if k < len(b.margins) else None
        limit = near_tie_margin(b.top1_logits[k], b.logits_dtype) if margin is not None else None
        found.append(
            {
                "prompt_index": i,
                "position": k,
                "target_margin": None if margin is None else round(margin, 6),
                "near_tie_margin": None if limit is None else round(limit, 6),
                "near_tie": margin is not None and limit is not None and margin <= limit,
            }
        )
    return (matched / total if total else 1.0), found


def summarize(
    name: str, runs: list[SpecResult], baseline: list[GreedyResult] | None, settings: CheckSettings, block: int
) -> dict[str, Any]:
    """One drafter's CHECK record (docs/artifact.md)."""
    lengths = [a for r in runs for a in r.acceptance_lengths]
    widest = max([block - 1, *(d for r in runs for d in r.drafted)])  # lookup `extend` verifies past the block
    drafted = [0] * widest
    accepted = [0] * widest
    histogram = [0] * (widest + 1)
    for r in runs:
        for acc, n_draft in zip(r.accepted, r.drafted, strict=True):
            if n_draft == 0:
                continue
            histogram[acc] += 1
            for k in range(n_draft):
                drafted[k] += 1
                accepted[k] += int(acc > k)
    greedy = settings.temperature == 0
    per_prompt = []
    for i, r in enumerate(runs):
        entry: dict[str, Any] = {
            "prompt_index": i,
            "tau": round(r.tau, 4),
            "steps": len(r.acceptance_lengths),
            "new_tokens": len(r.tokens),
        }
        if greedy and baseline is not None:
            entry["lossless"] = r.tokens == baseline[i].tokens
        per_prompt.append(entry)
    new_tokens = sum(len(r.tokens) for r in runs)
    # speed from the runs decoded one by one; batched runs (batch_rows > 1) only share a batch's time
    alone = [r for r in runs if r.batch_rows == 1]
    spec_s = sum(r.seconds for r in alone)
    spec_tokens = sum(len(r.tokens) for r in alone)
    out: dict[str, Any] = {
        "drafter": name,
        "tau": round(sum(lengths) / max(len(lengths), 1), 4),
        "tau_mean_of_requests": round(sum(r.tau for r in runs) / max(len(runs), 1), 4),
        "per_position_acceptance": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted, strict=True)],
        "acceptance_histogram": histogram,
        "lossless": all(p["lossless"] for p in per_prompt) if greedy and baseline is not None else None,
        "steps": len(lengths),
        "target_forwards": sum(r.target_forwards for r in runs),
        "drafter_forwards": sum(r.drafter_forwards for r in runs),
        # hybrid targets: extra forwards that roll linear-attention state back to the committed tokens
        "target_replay_forwards": sum(r.replay_forwards for r in runs),
        "replayed_tokens": sum(r.replayed_tokens for r in runs),
        "replay_seconds": round(sum(r.replay_seconds for r in runs), 4),
        "new_tokens": new_tokens,
        "spec_seconds": round(spec_s, 4),
        "spec_tokens_per_s": round(spec_tokens / spec_s, 2) if spec_s > 0 else None,
        "per_prompt": per_prompt,
    }
    if len(alone) < len(runs):
        batched = [r for r in runs if r.batch_rows > 1]
        out["spec_timed_prompts"] = len(alone)
        out["spec_batch"] = max(r.batch_rows for r in batched)
        out["spec_batched_prompts"] = len(batched)
        out["spec_batched_seconds"] = round(sum(r.seconds for r in batched), 4)
    if greedy and baseline is not None:
        rate, found = divergences(runs, baseline)
        out["token_match_rate"] = round(rate, 6)
        out["logits_dtype"] = baseline[0].logits_dtype if baseline else None
        out["divergences"] = found
        out["lossless_status"] = (
            "exact" if not found else "near-ties" if all(d["near_tie"] for d in found) else "diverged"
        )
    if baseline is not None:
        timed = [b for b in baseline if b.timed]  # decoded target-only (reference_runs checks the rest)
        base_s = sum(b.seconds for b in timed)
        base_tokens = sum(len(b.tokens) for b in timed)
        out["baseline_timed_prompts"] = len(timed)
        out["baseline_seconds"] = round(base_s, 4)
        out["baseline_tokens_per_s"] = round(base_tokens / base_s, 2) if base_s > 0 else None
        if out["spec_tokens_per_s"] and out["baseline_tokens_per_s"]:
            out["speedup"] = round(out["spec_tokens_per_s"] / out["baseline_tokens_per_s"], 3)
    return out


def untimed(check: dict[str, Any]) -> dict[str, Any]:
    """A teacher-forced run's check: its seconds time the drafter alone (no target verifies), so no speed."""
    check["spec_seconds"] = check["spec_tokens_per_s"] = None
    return check


def parity(
    baseline: dict[str, Any], quantized: dict[str, Any], tolerance: float, greedy: bool, exact: bool = True
) -> dict[str, Any]:
    """tau ratio and pass/fail reasons for a quantized drafter against its bf16 source.

    In exact (fp32) runs any difference from the target's own greedy output fails. In bf16 the target's logits
    for a multi-token verify differ in rounding from one-token decoding, so near-ties can flip with any drafter,
    the bf16 one included (seen on an H200: 2 of 32 prompts for both): a divergence at a near-tie is reported
    as "lossless up to numerics", one at a clear margin still fails.
    """
    ratio = quantized["tau"] / baseline["tau"] if baseline["tau"] else 0.0
    reasons, notes = [], []
    if ratio < 1 - tolerance:
        reasons.append(f"tau ratio {ratio:.4f} < {1 - tolerance:.4f} (tolerance {tolerance})")
    status = quantized.get("lossless_status")
    if greedy and quantized.get("lossless") is False:
        message = "greedy output of the quantized drafter differs from the target's own greedy output"
        if exact:
            reasons.append(message)
        elif status == "near-ties":
            n = len(quantized.get("divergences") or [])
            notes.append(
                f"lossless up to {quantized.get('logits_dtype', 'reduced-precision')} numerics: {n} prompt(s) "
                f"diverge, each at a near-tie of the target (top-1/top-2 margin <= {NEAR_TIE_ULPS} ulps)"
            )
        elif status is None:  # no margins recorded (a summary from an older run): report only
            notes.append(message + " (reduced-precision run without divergence margins: reported, not gated)")
        else:
            reasons.append(
                message + f" at a clear margin (more than {NEAR_TIE_ULPS} ulps of the top-1 logit), "
                "which reduced-precision numerics do not explain"
            )
    per_pos = [
        round(q / b, 4) if b and q is not None else None
        for b, q in zip(baseline["per_position_acceptance"], quantized["per_position_acceptance"], strict=False)
    ]
    return {
        "tau_ratio": round(ratio, 4),
        "per_position_ratio": per_pos,
        "passed": not reasons,
        "reasons": reasons,
        "notes": notes,
        "lossless_gated": bool(greedy and (exact or status is not None)),
        "lossless_status": status,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _tau(runs: list[SpecResult]) -> float:
    lengths = [a for r in runs for a in r.acceptance_lengths]
    return round(sum(lengths) / max(len(lengths), 1), 4)


def by_category(runs: list[SpecResult], categories: Sequence[str | None]) -> dict[str, dict[str, Any]] | None:
    """tau per prompt category (the built-in set's code / math / chat / reproduce); None without categories."""
    if not any(categories):
        return None
    out: dict[str, dict[str, Any]] = {}
    for cat in dict.fromkeys(c or "other" for c in categories):
        picked = [r for r, c in zip(runs, categories, strict=False) if (c or "other") == cat]
        out[cat] = {"prompts": len(picked), "tau": _tau(picked)}
    return out


def _split_acceptance(runs: list[SpecResult]) -> tuple[list[float | None], list[float | None], int]:
    """Per-position acceptance of the drafter's positions and of the lookup's (index j: the lookup's j+1-th
    token, over the steps that proposed one), and the steps that verified any lookup token. A `both` step with
    two rows counts each row's own accepted tokens, whichever row was committed."""
    counts: dict[str, list[list[int]]] = {"drafter": [], "lookup": []}
    lookup_steps = 0

    def add(source: str, j: int, ok: bool) -> None:
        rows = counts[source]
        while len(rows) <= j:
            rows.append([0, 0])
        rows[j][0] += 1
        rows[j][1] += int(ok)

    for r in runs:
        both = r.row_accepted or [[]] * len(r.accepted)
        heads = r.row_drafts or [0] * len(r.accepted)
        for acc, n_draft, d, two, g in zip(r.accepted, r.drafted, r.drafter_drafts, both, heads, strict=False):
            if two:  # `both`: the drafter's row (its g drafts; the lookup tail after them is not counted) and the
                lookup_steps += 1  # lookup's, n_draft tokens
                for k in range(g or n_draft):
                    add("drafter", k, two[0] > k)
                for k in range(n_draft):
                    add("lookup", k, two[1] > k)
                continue
            lookup_steps += n_draft > d
            for k in range(n_draft):
                add(*(("drafter", k) if k < d else ("lookup", k - d)), acc > k)
    drafter, lookup = ([round(a / n, 4) if n else None for n, a in counts[s]] for s in ("drafter", "lookup"))
    return drafter, lookup, lookup_steps


def lookup_summary(
    plain: dict[str, Any],
    plain_runs: list[SpecResult],
    runs: list[SpecResult],
    baseline: list[GreedyResult] | None,
    settings: CheckSettings,
    block: int,
    categories: Sequence[str | None] = (),
) -> dict[str, Any]:
    """The same drafter with the lookup proposer (Check.lookup): tau with and without it, where it helped."""
    lk = settings.lookup
    assert lk is not None
    full = summarize(plain["drafter"], runs, baseline, settings, block)
    drafter_pos, lookup_pos, lookup_steps = _split_acceptance(runs)
    out: dict[str, Any] = {
        "mode": lk.mode,
        "min_ngram": lk.min_ngram,
        "max_ngram": lk.max_ngram,
        "max_tokens": lk.tokens(block),
        "tau": full["tau"],
        "tau_without": plain["tau"],
        "tau_ratio": _ratio(full["tau"], plain["tau"]),
        "lossless": full["lossless"],
        "steps": full["steps"],
        "lookup_steps": lookup_steps,
        "lookup_step_share": round(lookup_steps / full["steps"], 4) if full["steps"] else None,
        "per_position_acceptance_drafter": drafter_pos,
        "per_position_acceptance_lookup": lookup_pos,
        "target_forwards": full["target_forwards"],
        "verified_tokens": sum(r.verified_tokens for r in runs),
        "verified_tokens_without": sum(r.verified_tokens for r in plain_runs),
        "verified_tokens_ratio": _ratio(
            sum(r.verified_tokens for r in runs), sum(r.verified_tokens for r in plain_runs)
        ),
        "two_row_steps": sum(n > 1 for r in runs for n in r.verify_rows),
        "lookup_row_steps": sum(
            n > 1 and d == 0 for r in runs for n, d in zip(r.verify_rows, r.drafter_drafts, strict=False)
        ),
        "drafter_forwards": full["drafter_forwards"],
        "target_replay_forwards": full["target_replay_forwards"],
        "spec_seconds": full["spec_seconds"],
        "lookup_seconds": round(sum(r.lookup_seconds for r in runs), 4),
        "spec_tokens_per_s": full["spec_tokens_per_s"],
        "speedup": full.get("speedup"),
    }
    for key in ("lossless_status", "token_match_rate", "divergences"):
        if key in full:
            out[key] = full[key]
    without, with_ = by_category(plain_runs, categories), by_category(runs, categories)
    if without and with_:
        cats = {}
        for cat, row in with_.items():
            picked = [r for r, c in zip(runs, categories, strict=False) if (c or "other") == cat]
            _, _, steps = _split_acceptance(picked)
            n_steps = sum(len(r.acceptance_lengths) for r in picked)
            cats[cat] = {
                "prompts": row["prompts"],
                "tau_without": without[cat]["tau"],
                "tau": row["tau"],
                "tau_ratio": _ratio(row["tau"], without[cat]["tau"]),
                "verified_tokens_ratio": _ratio(
                    sum(r.verified_tokens for r in picked),
                    sum(
                        r.verified_tokens for r, c in zip(plain_runs, categories, strict=False) if (c or "other") == cat
                    ),
                ),
                "lookup_step_share": round(steps / n_steps, 4) if n_steps else None,
            }
        out["by_category"] = cats
    return out
