"""The mixed-precision stage of `gptq`: sensitivity table -> tau map -> search -> per-Linear picks.

Runs after calibration, before quantization, on the bf16 drafter. The table and the tau map are cached in
`sensitivity.json` of --calib-cache (keyed by drafter, calibration, candidates and dev prompts)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from dflash_quant.artifact.reports import FitServing, Mixed
from dflash_quant.errors import UsageError
from dflash_quant.export.gptq_dynamic import base_setting, vllm_fused_conflicts
from dflash_quant.loading.runtime import stop_tokens
from dflash_quant.memory import fit as mf
from dflash_quant.quantize import mixed_plan as mp
from dflash_quant.quantize.drafter import select_linears
from dflash_quant.quantize.mixed import Candidate, bits_per_weight_bytes, coded_bits_per_weight, max_quality
from dflash_quant.quantize.mixed_table import build_table, load_curve, load_table, save_curve, save_table
from dflash_quant.quantize.tune import tune_scales
from dflash_quant.speculative.verify import CheckSettings, spec_runs


@dataclass
class MixPlan:
    picks: dict[str, tuple[int, int]]  # the stored grid per Linear (what the export writes)
    solve: dict[str, tuple[bool, bool]]  # how GPTQ solves it: (act-order with static groups, clip search)
    base: Candidate
    record: Mixed


def plan_mix(
    job, drafter, target, stats, calib_ids: list[list[int]], calib_key: dict[str, Any], progress, reference=None
) -> MixPlan:
    """reference (gptq-kl): the bf16 drafter's rows on every calibration prompt's replay and, with --tune-anchor,
    its Linears' bf16 weights (pipeline.stages.Teacher), taken once for the map's tunings and the mix's own."""
    goal: mp.MixedGoal = job.mixed
    seconds: dict[str, float] = {}
    # which Linears (profile, --skip); --bits/--group-size do not apply to a mix, so any width is accepted here
    chosen, _ = select_linears(drafter.model, replace(job.quant, bits=8, group_size=-1))
    weights = {n: cast(nn.Linear, drafter.model.get_submodule(n)).weight.detach().float() for n in chosen}
    shapes = [(int(w.shape[0]), int(w.shape[1])) for w in weights.values()]
    candidates = mp.candidates_for(shapes)
    plain = [c for c in candidates if c == c.grid]  # the uniform drafters users make (and the card compares)
    key = {
        **calib_key,
        "linears": chosen,
        "candidates": [mp.fmt_cand(c) for c in candidates],
        "sym": job.quant.sym,
    }
    t = time.perf_counter()
    table = load_table(job.calib_cache, key) if job.calib_cache is not None else None
    if table is None:
        progress(f"mix: sensitivity table ({len(chosen)} Linears x {len(candidates)} settings)", None)
        table = build_table(weights, stats, candidates, sym=job.quant.sym)
        if job.calib_cache is not None:
            save_table(job.calib_cache, table, key)
    seconds["table_s"] = round(time.perf_counter() - t, 3)

    rest = _other_bytes(drafter.model, chosen)
    byte_budget: int | None = None
    loss_budget: float | None = None
    least = sum(min(b for b, _ in c.values()) for c in table.values())
    top = sum(max(b for b, _ in c.values()) for c in table.values())
    fit_opts = None
    if goal.kind == "max_bytes":  # budget checked before the tau map is measured
        assert goal.max_bytes is not None
        byte_budget = goal.max_bytes - rest
        if byte_budget < least:
            raise UsageError(
                f"--max-bytes {goal.max_bytes} leaves {byte_budget} bytes for the quantized Linears after the "
                f"drafter's {rest} bf16 bytes; the smallest mix takes {least}: raise the budget"
            )
    elif goal.kind == "max_bits_per_weight":
        assert goal.max_bits_per_weight is not None
        byte_budget = bits_per_weight_bytes(shapes, goal.max_bits_per_weight)
        if byte_budget < least:
            raise UsageError(
                f"--max-bits-per-weight {goal.max_bits_per_weight} is below the smallest mix "
                f"({coded_bits_per_weight(shapes, least):.3f} bits per weight, every Linear at its narrowest "
                "setting): raise it"
            )
    elif goal.kind == "fit":
        fit_opts = _fit_options(goal, target, drafter, table, candidates, rest, least)
    # the loss -> tau map on the dev prompts (first calibration prompts; the gate's held-out prompts are not used)

    dev_ids = calib_ids[: goal.dev_prompts]
    q = job.quant
    ckey = {
        "dev_prompts": len(dev_ids),
        "dev_max_new_tokens": goal.dev_max_new_tokens,
        "seed": job.seed,
        "per_prompt": True,  # maps cached before tokens/steps per prompt were kept are remeasured
        # gptq-kl: the map also holds tuned uniform drafters, tuned as this run will tune its mix
        **(
            {
                "kl": [
                    q.tune_epochs,
                    q.tune_lr_for(False),
                    q.tune_codes,
                    q.tune_code_travel,
                    q.tune_anchor,
                    "after-dev-prompts",
                    *([q.tune_position_decay] if q.tune_position_decay else []),
                    *(["norms"] if q.tune_norms else []),
                    *([q.tune_rows] if q.tune_rows != "all" else []),
                    *([q.tune_target] if q.tune_target else []),
                ]
            }
            if q.tuned
            else {}
        ),
    }
    t = time.perf_counter()
    curve = load_curve(job.calib_cache, key, ckey) if job.calib_cache is not None else None
    if curve is not None and goal.kind == "fit" and "bf16_lengths" not in curve:
        curve = None  # cached before --fit needed the acceptance lengths: measure again
    if curve is None:
        check = CheckSettings(goal.dev_max_new_tokens, 0.0, drafter.config.block_size, job.seed, stop_tokens(target))
        lengths: list[int] = []
        tune = _kl_tuner(job, target, stats, reference, len(dev_ids)) if q.tuned else None
        tau_bf16, per_prompt, points = mp.measure_points(
            drafter.model, target.model, stats, job.quant, dev_ids, check, table, progress, lengths_out=lengths,
            tune=tune,
        )  # fmt: skip
        hist = {str(a): lengths.count(a) for a in sorted(set(lengths))}
        curve = {"tau_bf16": round(tau_bf16, 5), "per_prompt": per_prompt, "points": points, "bf16_lengths": hist}
        if job.calib_cache is not None:
            save_curve(job.calib_cache, key, ckey, curve)
    seconds["tau_map_s"] = round(time.perf_counter() - t, 3)
    points = curve["points"]
    # a gptq-kl mix is tuned after the pick: its tau follows the tuned uniform drafters' line, not GPTQ's
    kl_points = [p for p in points if mp.kind(str(p["setting"])) == "kl"] if q.tuned else []
    line = kl_points or points
    kl: tuple[float, float, float] | None = None  # the kl line's (lower, fitted, upper) slope, when it plans

    t = time.perf_counter()
    bounds = mp.slope_bounds(curve)
    a_upper = None if bounds is None else bounds[1]
    floor: int | None = None
    serving: FitServing | None = None
    kinds = None
    notes: list[str] = []
    own: dict[str, tuple[float, float]] = {}  # a gptq-kl plan's tuned points: their own tau-loss bounds
    if goal.kind == "max_tau_loss":
        assert goal.max_tau_loss is not None
        # the budget from the slope's upper bound (per solver kind); no Linear below the widths the lower bound
        # says can keep it
        kinds = mp.kind_slope_bounds(curve)
        local = mp.kl_line(curve, kl_points, goal.max_tau_loss) if kl_points else None
        if kinds is not None and local is not None:
            # every Linear will be tuned: each loss counts at the kl line's upper slope, fitted on the tuned points
            # at or above the floor their own measurements set
            line, kl, own = local.points, local.slopes, local.point_bounds
            kinds["kl"] = kl
            note = local.resolution_note(goal.max_tau_loss)
            notes += [note] if note else []
            choice, loss_budget, floor = mp.plan_tau_loss(
                table, line, (kl[0], kl[2]), goal.max_tau_loss, floor=local.floor
            )
        else:
            choice, loss_budget, floor = mp.plan_tau_loss(table, points, bounds, goal.max_tau_loss, kinds)
    else:
        if fit_opts is not None:

            def measure_k(k: int) -> float:
                """bf16 tau on the dev prompts drafting K tokens ([bonus, K masks], as vLLM does), cached."""

                got = curve.setdefault("bf16_tau_by_block", {})
                if str(k + 1) not in got:
                    check_k = CheckSettings(goal.dev_max_new_tokens, 0.0, k + 1, job.seed, stop_tokens(target))
                    runs = spec_runs(drafter.model, target.model, dev_ids, check_k,
                                     progress(f"fit: bf16 tau at K={k}", len(dev_ids)))  # fmt: skip
                    lengths = [a for r in runs for a in r.acceptance_lengths]
                    got[str(k + 1)] = round(sum(lengths) / len(lengths), 5)
                    if job.calib_cache is not None:
                        save_curve(job.calib_cache, key, ckey, curve)
                return float(got[str(k + 1)])

            serving, byte_budget = _fit_choice(goal, fit_opts, table, line, curve["bf16_lengths"], rest, top, measure_k)
            progress(f"fit: {fit_line(serving)}", None)
        assert byte_budget is not None
        choice = max_quality(table, min(byte_budget, top))
    seconds["search_s"] = round(time.perf_counter() - t, 3)

    # each Linear's loss at its solver kind's slope (max_tau_loss), else every kind at the shared one
    # (a tuned mix: every solver kind at the kl line)
    by_kind = {k: kl for k in ("plain", "tuned")} if kl is not None else (kinds or {})
    fitted = {k: b[1] for k, b in by_kind.items()}
    upper = {k: b[2] for k, b in by_kind.items()}
    grids = {n: c.grid for n, c in choice.picks.items()}  # engines see the grid only; the solver leaves no trace
    base = base_setting(grids)
    record = Mixed(
        goal=goal.kind,
        goal_value=goal.value,
        byte_budget=byte_budget,
        loss_budget=None if loss_budget is None else round(loss_budget, 6),
        candidates=[mp.fmt_cand(c) for c in candidates],
        picks={n: mp.fmt_cand(c) for n, c in choice.picks.items()},
        predicted_bytes=choice.total_bytes,
        bits_per_weight=round(coded_bits_per_weight(shapes, choice.total_bytes), 4),
        predicted_loss=round(choice.total_loss, 6),
        predicted_tau_ratio=round(1 - mp.mix_tau_loss(table, choice.picks, fitted, mp.slope(line)), 5),
        predicted_tau_ratio_low=None
        if a_upper is None and not kinds
        else round(1 - mp.mix_tau_loss(table, choice.picks, upper, a_upper or mp.slope(line)), 5),
        solver_slopes=None if not kinds else {k: [round(x, 6) for x in b] for k, b in kinds.items()},
        slope_bounds=None if bounds is None else [round(x, 6) for x in bounds],
        bits_floor=floor,
        notes=notes or None,
        tau_calibration=[
            {
                **{k: v for k, v in p.items() if k != "per_prompt"},
                "tau_bf16": curve["tau_bf16"],
                "slope": round(mp.slope(line), 6),
                **({"tau_loss_bounds": [round(x, 5) for x in own[p["setting"]]]} if p["setting"] in own else {}),
            }
            for p in points
        ],
        dev_prompts=f"{calib_key.get('prompts')} first {len(dev_ids)} x {goal.dev_max_new_tokens} tokens",
        uniform=[
            {
                "setting": mp.fmt_cand(c),
                "bytes": mp.uniform_loss(table, c)[0],
                "loss": round(mp.uniform_loss(table, c)[1], 6),
            }
            for c in plain
        ],
        nearest_uniform=mp.fmt_cand(mp.nearest_uniform(table, plain, choice.total_bytes)),
        vllm_fused_conflicts=vllm_fused_conflicts(grids),
        seconds=seconds,
        serving=serving,
    )
    return MixPlan(
        {n: (c.bits, c.group_size) for n, c in choice.picks.items()},
        {n: (c.act, c.clip) for n, c in choice.picks.items()},
        base,
        record,
    )


def _kl_tuner(job, target, stats, reference, n_dev: int):
    """gptq-kl's tuning for the map's uniform drafters, on the calibration prompts after the dev ones (the map
    measures tau on the dev prompts: tuned on them, it would measure its own training prompts)."""
    assert reference is not None  # the pipeline takes gptq-kl's reference before the mix
    replay = (stats.replay or [])[n_dev:]
    if not replay:
        raise UsageError(
            f"--method gptq-kl with a mixed-precision goal tunes the tau map's drafters on the calibration prompts "
            f"after the first {n_dev} (--mix-dev-prompts), and there are none: give more calibration prompts"
        )
    teacher = reference.rows[n_dev:]
    head = target.model.get_output_embeddings()
    q = job.quant

    def tune(model, weights) -> None:
        anchors = {n: (reference.weights[n], stats.for_linear(n).xtx) for n in weights} if q.tune_anchor > 0 else {}
        tune_scales(
            model, weights, replay, teacher, head, epochs=q.tune_epochs, lr=q.tune_lr_for(False), codes=q.tune_codes,
            code_travel=q.tune_code_travel, anchors=anchors, anchor_weight=q.tune_anchor,
            position_decay=q.tune_position_decay, norms=q.tune_norms, rows=q.tune_rows, target_weight=q.tune_target,
            seed=job.seed,
        )  # fmt: skip

    return tune


def _other_bytes(model: nn.Module, chosen: list[str]) -> int:
    """bf16 bytes of everything the export writes besides the searched Linears' weights."""
    skip = {f"{n}.weight" for n in chosen}
    return sum(
        t.numel() * 2
        for k, t in model.state_dict().items()
        if k not in skip and not k.startswith("rotary_emb.") and isinstance(t, torch.Tensor)
    )


# ---------------------------------------------------------------------------------------------- --fit


@dataclass
class _FitOpts:
    options: list
    given_room: int
    want: int  # drafter bytes at uniform 4-bit (else the smallest mix)
    least: int  # drafter bytes of the smallest mix


def _fit_options(goal, target, drafter, table, candidates, rest: int, least: int) -> _FitOpts:
    """The budget side of --fit, before the tau map: every candidate serving setting and its room; refuse at
    once when none leaves room for the smallest mix (memory/fit.py)."""

    assert goal.fit_gpu is not None and goal.context is not None
    block = drafter.config.block_size
    if goal.serving.spec_tokens is not None and block and goal.serving.spec_tokens > block - 1:
        raise UsageError(
            f"--spec-tokens {goal.serving.spec_tokens} is more than this drafter drafts per step (block_size {block}: "
            f"at most {block - 1}); give K <= {block - 1} or leave --spec-tokens to the search"
        )
    options, given_room = mf.fit_options(
        str(target.source.path), str(drafter.source.path), goal.fit_gpu, goal.context, goal.target_weights,
        goal.serving,
    )  # fmt: skip
    four = [c for c in mp.tau_points(candidates) if c.bits == 4]
    want = rest + (mp.uniform_loss(table, four[0])[0] if four else least)
    if max(o.room for o in options) < rest + least:
        raise mf.refuse(goal.fit_gpu, goal.context, options, rest + least)
    return _FitOpts(options, given_room, want, rest + least)


def _fit_choice(
    goal, fo: _FitOpts, table, points, hist: dict, rest: int, top: int, measure_k
) -> tuple[FitServing, int]:
    """Per K the least costly setting with room (memory/fit.per_k); the K whose predicted tau (tau_K of the bf16
    drafter x the mix's predicted ratio in that room) is highest. tau_K is estimated from the full block's
    acceptance lengths; vLLM drafts a shorter block for a smaller K and DFlash's block attention is non-causal,
    so the chosen K is also measured (`measure_k`, one decode of the dev prompts) and recorded beside the
    estimate. Returns the record and the Linears' budget."""

    assert goal.fit_gpu is not None and goal.context is not None
    cache: dict[int, float] = {}

    def ratio(budget: int) -> float:
        if budget not in cache:
            cache[budget] = 1 - mp.predict_tau_loss(points, max_quality(table, min(budget, top)).total_loss)
        return cache[budget]

    def predict(o) -> float:
        return mf.tau_at_k(hist, o.settings.spec_tokens) * ratio(o.room - rest)

    best, scored = mf.choose(fo.options, fo.want, fo.least, predict, goal.fit_gpu, goal.context)
    full_k = max(int(a) for a in hist) - 1  # the block the tau map decoded: K = block - 1
    full = mf.tau_at_k(hist, full_k + 1)
    k = best.settings.spec_tokens
    measured = measure_k(k) if k < full_k else round(full, 5)
    rec = mf.choice_record(
        goal.fit_gpu, goal.context, goal.target_weights, best, fo.given_room, len(fo.options),
        tau_bf16_at_k=round(mf.tau_at_k(hist, k), 5), tau_bf16_full=round(full, 5), tau_bf16_at_k_measured=measured,
        predicted_tau=round(predict(best), 5),
        options=[
            {"spec_tokens": o.settings.spec_tokens, "changed": o.changed, "drafter_room": o.room,
             "tau_bf16_at_k": round(mf.tau_at_k(hist, o.settings.spec_tokens), 5),
             "predicted_tau": round(p, 5)}
            for o, p in scored
        ],
    )  # fmt: skip
    return FitServing.from_dict(rec.as_dict()), best.room - rest


def fit_line(f: FitServing) -> str:
    changed = ", ".join(f.changed or []) or "none (the given settings fit)"
    return (
        f"K={(f.settings or {}).get('spec_tokens')}, changed: {changed}; drafter room {f.drafter_room} bytes; "
        f"predicted tau {f.predicted_tau} (bf16 drafter at this K {f.tau_bf16_at_k} estimated, "
        f"{f.tau_bf16_at_k_measured} measured, {f.tau_bf16_full} at the full block); "
        f"serve with: vllm serve TARGET {' '.join(f.engine_flags or [])}"
    )
