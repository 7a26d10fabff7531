"""The mixed-precision stage of `gptq`: sensitivity table -> tau map -> search -> per-Linear picks.

Runs after calibration, before quantization, on the bf16 drafter. The table and the tau map are cached in
`sensitivity.json` of --calib-cache (keyed by drafter, calibration, candidates and dev prompts)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from dflash_quant.artifact.reports import Mixed
from dflash_quant.errors import UsageError
from dflash_quant.export.gptq_dynamic import base_setting, vllm_fused_conflicts
from dflash_quant.quantize import mixed_plan as mp
from dflash_quant.quantize.drafter import select_linears
from dflash_quant.quantize.mixed import Candidate, max_quality
from dflash_quant.quantize.mixed_table import build_table, load_curve, load_table, save_curve, save_table


@dataclass
class MixPlan:
    picks: dict[str, tuple[int, int]]  # the stored grid per Linear (what the export writes)
    solve: dict[str, tuple[bool, bool]]  # how GPTQ solves it: (act-order with static groups, clip search)
    base: Candidate
    record: Mixed


def plan_mix(job, drafter, target, stats, calib_ids: list[list[int]], calib_key: dict[str, Any], progress) -> MixPlan:
    goal: mp.MixedGoal = job.mixed
    seconds: dict[str, float] = {}
    # which Linears (profile, --skip); --bits/--group-size do not apply to a mix, so any width is accepted here
    chosen, _ = select_linears(drafter.model, replace(job.quant, bits=8, group_size=-1))
    weights = {n: cast(nn.Linear, drafter.model.get_submodule(n)).weight.detach().float() for n in chosen}
    candidates = mp.candidates_for([(int(w.shape[0]), int(w.shape[1])) for w in weights.values()])
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
    if goal.kind != "max_tau_loss":  # budget checked before the tau map is measured
        if goal.kind == "max_bytes":
            assert goal.max_bytes is not None
            room = goal.max_bytes
            what = f"--max-bytes {goal.max_bytes}"
        else:
            assert goal.fit_gpu is not None and goal.context is not None
            fit = mp.fit_drafter_bytes(
                str(target.source.path), str(drafter.source.path), goal.fit_gpu, goal.context, goal.target_weights
            )
            room = fit["drafter_room"]
            what = f"--fit {goal.fit_gpu} --context {goal.context}"
            if room <= rest:
                raise UsageError(
                    f"{what}: the target, its caches and the runtime leave {room} bytes for the drafter, less than "
                    f"its unquantized parts ({rest} bytes); lower --context or quantize the target (--target-weights int4)"
                )
        byte_budget = room - rest
        least = sum(min(b for b, _ in c.values()) for c in table.values())
        if byte_budget < least:
            raise UsageError(
                f"{what} leaves {byte_budget} bytes for the quantized Linears after the drafter's {rest} bf16 bytes; "
                f"the smallest mix takes {least}: raise the budget"
            )

    # the loss -> tau map on the dev prompts (first calibration prompts; the gate's held-out prompts are not used)
    from dflash_quant.runtime import stop_tokens
    from dflash_quant.verify import CheckSettings

    dev_ids = calib_ids[: goal.dev_prompts]
    ckey = {
        "dev_prompts": len(dev_ids),
        "dev_max_new_tokens": goal.dev_max_new_tokens,
        "seed": job.seed,
        "per_prompt": True,  # maps cached before tokens/steps per prompt were kept are remeasured
    }
    t = time.perf_counter()
    curve = load_curve(job.calib_cache, key, ckey) if job.calib_cache is not None else None
    if curve is None:
        check = CheckSettings(goal.dev_max_new_tokens, 0.0, drafter.config.block_size, job.seed, stop_tokens(target))
        tau_bf16, per_prompt, points = mp.measure_points(
            drafter.model, target.model, stats, job.quant, dev_ids, check, table, progress
        )
        curve = {"tau_bf16": round(tau_bf16, 5), "per_prompt": per_prompt, "points": points}
        if job.calib_cache is not None:
            save_curve(job.calib_cache, key, ckey, curve)
    seconds["tau_map_s"] = round(time.perf_counter() - t, 3)
    points = curve["points"]

    t = time.perf_counter()
    bounds = mp.slope_bounds(curve)
    a_upper = None if bounds is None else bounds[1]
    floor: int | None = None
    if goal.kind == "max_tau_loss":
        assert goal.max_tau_loss is not None
        # the budget from the slope's upper bound; no Linear below the widths the lower bound says can keep it
        choice, loss_budget, floor = mp.plan_tau_loss(table, points, bounds, goal.max_tau_loss)
    else:
        assert byte_budget is not None
        top = sum(max(b for b, _ in c.values()) for c in table.values())
        choice = max_quality(table, min(byte_budget, top))
    seconds["search_s"] = round(time.perf_counter() - t, 3)

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
        predicted_loss=round(choice.total_loss, 6),
        predicted_tau_ratio=round(1 - mp.predict_tau_loss(points, choice.total_loss), 5),
        predicted_tau_ratio_low=None
        if a_upper is None
        else round(1 - mp.predict_tau_loss(points, choice.total_loss, a_upper), 5),
        slope_bounds=None if bounds is None else [round(x, 6) for x in bounds],
        bits_floor=floor,
        tau_calibration=[
            {
                **{k: v for k, v in p.items() if k != "per_prompt"},
                "tau_bf16": curve["tau_bf16"],
                "slope": round(mp.slope(points), 6),
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
    )
    return MixPlan(
        {n: (c.bits, c.group_size) for n, c in choice.picks.items()},
        {n: (c.act, c.clip) for n, c in choice.picks.items()},
        base,
        record,
    )


def _other_bytes(model: nn.Module, chosen: list[str]) -> int:
    """bf16 bytes of everything the export writes besides the searched Linears' weights."""
    skip = {f"{n}.weight" for n in chosen}
    return sum(
        t.numel() * 2
        for k, t in model.state_dict().items()
        if k not in skip and not k.startswith("rotary_emb.") and isinstance(t, torch.Tensor)
    )
