"""Quantize a whole drafter: choose the Linears (profile, --skip), run GPTQ or RTN, report per layer."""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from dflash_quant.calibration.capture import CalibrationStats, input_group, replay_capture
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.models.gpu import gpu_room
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.quantize.gptq import GPTQFallbackWarning, relative_output_error
from dflash_quant.quantize.gptq_batched import gptq_quantize_groups
from dflash_quant.quantize.grid import QuantizedWeight
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.settings import PROFILES, QuantSettings


@dataclass
class QuantOutcome:
    weights: dict[str, Any]  # QuantizedWeight, or KQuantWeight for a llama.cpp grid
    kept: list[str]
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def check_variant(model: DFlashDrafter, settings: QuantSettings) -> None:
    """The DFlash2-only flags on a v1 drafter are a usage error, caught before any compute."""
    flags = [
        f
        for f, on in (("--quantize-conv", settings.quantize_conv), ("--quantize-selector", settings.quantize_selector))
        if on
    ]
    if flags and not model.config.is_dflash2:
        raise UsageError(
            f"{' and '.join(flags)} only apply to a DFlash2 drafter (conv/selector); this is a DFlash v1 drafter, drop the flag"
        )


def extra_linears(model: DFlashDrafter, settings: QuantSettings) -> list[str]:
    """The DFlash2 Linears outside the backbone that the flags ask to quantize, in execution order."""
    check_variant(model, settings)
    names = []
    for name in model.other_linear_names():
        leaf = name.rsplit(".", 1)[-1]
        if (leaf == "kernel_projection" and settings.quantize_conv) or (
            leaf == "hidden_projection" and settings.quantize_selector
        ):
            names.append(name)
    return names


_SUBLAYER_ORDER = {"attention_conv": 0, "self_attn": 1, "mlp_conv": 2, "mlp": 3}


def _execution_key(name: str) -> tuple[float, int]:
    """fc first, then per layer: attention conv, attention, MLP conv, MLP; the selector last."""
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1]), _SUBLAYER_ORDER.get(parts[2], 4)
    return (-1, 0) if name == "fc" else (float("inf"), 0)


def candidate_linears(model: DFlashDrafter, settings: QuantSettings) -> list[str]:
    """Every Linear the settings may quantize (before profile/--skip), in execution order (sequential GPTQ
    quantizes a conv's kernel_projection before the sublayer it wraps)."""
    return sorted(model.linear_names() + extra_linears(model, settings), key=_execution_key)


def select_linears(model: DFlashDrafter, settings: QuantSettings) -> tuple[list[str], list[str]]:
    """(to quantize, kept in bf16), in execution order; norms are never Linears, so never quantized."""
    patterns = [re.compile(p) for p in PROFILES[settings.profile] + list(settings.skip)]
    chosen: list[str] = []
    kept: list[str] = []
    for name in candidate_linears(model, settings):
        (kept if any(p.search(name) for p in patterns) else chosen).append(name)
    if not chosen:
        raise UsageError("the profile and --skip patterns leave no Linear to quantize; loosen --skip")
    for name in chosen:
        module = cast(nn.Linear, model.get_submodule(name))
        settings.spec().group_width(module.in_features, name)  # group size must divide the width
        if (module.in_features * settings.bits) % 32 or (module.out_features * settings.bits) % 32:
            # GPTQ v1 packs qweight along the inputs and qzeros along the outputs into whole int32 words
            raise UsageError(
                f"{name} [{module.out_features}, {module.in_features}] cannot be packed at {settings.bits} bits by GPTQ v1 "
                "(in*bits and out*bits must be multiples of 32); keep it bf16 (--skip, or drop --quantize-conv / "
                "--quantize-selector) or change --bits"
            )
    return chosen, kept


def stages(names: list[str], kv_hessian: str) -> list[list[str]]:
    """Sequential order: fc, then per layer q/k/v, o, gate/up, down (Linears sharing an input go together)."""
    out: list[list[str]] = []
    for name in names:
        group = input_group(name, kv_hessian)
        if out and input_group(out[-1][-1], kv_hessian) == group:
            out[-1].append(name)
        elif out and group.endswith(".kv") and out[-1][-1].endswith("q_proj"):
            out[-1].append(name)  # q and k/v sit in one stage even with separate Hessians
        else:
            out.append([name])
    return out


def _quantize_group(
    names: list[str], modules: list[nn.Linear], acc: HessianAccumulator | None, settings: QuantSettings
) -> list[tuple[QuantizedWeight, dict[str, Any]]]:
    """Quantize Linears that share one input (and so one Hessian) together."""
    return _quantize_groups([(names, modules, acc)], settings)[0]


def _quantize_groups(
    groups: list[tuple[list[str], list[nn.Linear], HessianAccumulator | None]],
    settings: QuantSettings,
    device: torch.device | None = None,
) -> list[list[tuple[QuantizedWeight, dict[str, Any]]]]:
    """Quantize several shared-input groups; GPTQ solves the groups of one shape as one batch
    (gptq_batched: the textbook's result per group, in far fewer launches). device: solve there instead of on
    the weights' device (the CPU, for a group the GPU has no room for)."""
    spec = settings.spec()
    prepared = []
    for names, modules, acc in groups:
        hessian = None
        if acc is not None:
            if acc.rows < settings.min_rows:
                raise DFlashQuantError(
                    f"only {acc.rows} calibration rows reached {names[0]} (need at least {settings.min_rows}); "
                    "raise --num-prompts or --max-new-tokens"
                )
            hessian = acc.hessian() if device is None else acc.hessian().to(device)
        weights = [m.weight.detach().to(device or m.weight.device).float() for m in modules]
        prepared.append((names, weights, acc, hessian))
    if settings.calibrated:
        if hessian is None:
            raise DFlashQuantError(f"no calibration rows reached {names[0]}; check the calibration prompts")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GPTQFallbackWarning)
            solved = gptq_quantize_groups(
                [(weights, cast(torch.Tensor, hessian), names) for names, weights, _, hessian in prepared],
                spec,
                desc_act=settings.desc_act,
                static_groups=settings.static_groups,
                damp_percent=settings.damp,
                block_size=settings.lazy_block,
                clip=settings.clip_search,
            )
        for w in caught:
            warnings.warn(str(w.message), GPTQFallbackWarning, stacklevel=2)
    else:
        solved = [
            [rtn_quantize(w, spec, name=n) for w, n in zip(weights, names, strict=False)]
            for names, weights, _, _ in prepared
        ]
    out = []
    for (names, weights, acc, hessian), qws in zip(prepared, solved, strict=False):
        results = []
        for name, weight, qw in zip(names, weights, qws, strict=False):
            entry: dict[str, Any] = {
                "name": name,
                "shape": list(weight.shape),
                "bits": settings.bits,
                "group_size": settings.group_size,
                "method": "rtn" if qw.fallback or not settings.calibrated else "gptq",
                "hessian_rows": acc.rows if acc is not None else None,
                "damp": qw.damp_used,
                "fallback": qw.fallback,
                "rel_output_error": None,
            }
            if hessian is not None:  # ||X dW^T|| / ||X W^T|| over the calibration rows
                entry["rel_output_error"] = round(
                    math.sqrt(max(relative_output_error(weight, qw.dequantize(), hessian), 0.0)), 6
                )
            results.append((qw, entry))
        out.append(results)
    return out


def quantize_drafter(
    model: DFlashDrafter,
    stats: CalibrationStats | None,
    settings: QuantSettings,
    progress: Callable[[str], None] | None = None,
    picks: Mapping[str, tuple[int, int]] | None = None,
    solve: Mapping[str, tuple[bool, bool]] | None = None,
) -> QuantOutcome:
    """Quantize the chosen Linears in place (weights replaced by their dequantized values) and return codes.

    `picks`: (bits, group_size) per Linear name, a mixed-precision choice; Linears it omits use `settings`.
    `solve`: (act-order with static groups, clip search) per Linear name, how GPTQ solves its pick."""
    settings = settings.normalized()
    settings.check()
    if settings.calibrated and stats is None:
        raise UsageError("GPTQ needs calibration statistics; run calibration or use --method rtn")
    if settings.sequential and (stats is None or stats.replay is None):
        raise UsageError("sequential GPTQ needs recorded drafter inputs (calibration with replay)")
    chosen, kept = select_linears(model, settings)
    outcome = QuantOutcome(weights={}, kept=kept)
    t0 = time.perf_counter()
    kv_mode = stats.kv_hessian if stats is not None else "block"
    # Without sequential mode no stage changes another's Hessian: every group is solved in one call, so
    # the matrices of one shape across layers form one batch. Sequential mode goes stage by stage.
    pending: list[tuple[list[str], list[nn.Linear], HessianAccumulator | None]] = []
    for stage in stages(chosen, kv_mode):
        accs: dict[str, HessianAccumulator] = {}
        if stats is not None:
            groups = {input_group(n, kv_mode) for n in stage}
            missing = sorted(g for g in groups if g not in stats.hessians)
            if missing and not settings.sequential:
                raise DFlashQuantError(f"no calibration rows reached {missing[0]}; check the calibration prompts")
            if settings.sequential:
                assert stats.replay is not None  # calibration keeps the replay when GPTQ is sequential
                accs = replay_capture(model, stats.replay, groups, kv_mode)
            else:
                accs = {g: stats.hessians[g] for g in groups}
        shared: dict[str, list[str]] = {}
        for name in stage:
            shared.setdefault(input_group(name, kv_mode), []).append(name)
        for group, names in shared.items():
            pending.append((names, [cast(nn.Linear, model.get_submodule(n)) for n in names], accs.get(group)))
        if settings.sequential:
            _apply(pending, settings, outcome, progress, picks, solve)
            pending = []
    _apply(pending, settings, outcome, progress, picks, solve)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    outcome.seconds = time.perf_counter() - t0
    return outcome


def _by_setting(
    groups,
    settings: QuantSettings,
    picks: Mapping[str, tuple[int, int]] | None,
    solve: Mapping[str, tuple[bool, bool]] | None = None,
):
    """Split shared-input groups by each Linear's (bits, group_size) and solver, so each batch is solved one way."""
    out: dict[tuple[int, int, bool, bool], list] = {}
    own = (settings.desc_act, settings.clip_search)
    for names, modules, acc in groups:
        parts: dict[tuple[int, int, bool, bool], tuple[list[str], list[nn.Linear]]] = {}
        for name, module in zip(names, modules, strict=True):
            key = (*(picks or {}).get(name, (settings.bits, settings.group_size)), *(solve or {}).get(name, own))
            part = parts.setdefault(key, ([], []))
            part[0].append(name)
            part[1].append(module)
        for key, (ns, ms) in parts.items():
            out.setdefault(key, []).append((ns, ms, acc))
    return [
        (
            replace(settings, bits=b, group_size=g)
            if (act, clip) == own
            else replace(settings, bits=b, group_size=g, desc_act=act, static_groups=act, clip_search=clip),
            gs,
        )
        for (b, g, act, clip), gs in out.items()
    ]


def _group_bytes(modules: list[nn.Linear]) -> int:
    """What solving one shared-input group holds at once on its device: its fp32 weights about four times (the
    copy, the stacked problem, codes, scratch) and four [in, in] fp32 matrices (H, its damped copy, the inverse
    factor, the batch's stacked copy)."""
    n = modules[0].in_features
    return 4 * (4 * sum(m.weight.numel() for m in modules) + 4 * n * n)


def solve_plan(groups: list, budget: int | None) -> list[tuple[list, bool]]:
    """Chunks of `groups` to solve one after another, each within `budget` bytes (None: all at once), and
    whether the chunk goes to the CPU: a group larger than the budget alone is solved there. At the 27B scale the
    drafter's fp32 weights and Hessian copies for every group at once (~25 GB) do not fit beside the target."""
    if budget is None:
        return [(groups, False)] if groups else []
    plan: list[tuple[list, bool]] = []
    chunk: list = []
    used = 0
    for group in groups:
        size = _group_bytes(group[1])
        if size > budget:
            plan.append(([group], True))
            continue
        if chunk and used + size > budget:
            plan.append((chunk, False))
            chunk, used = [], 0
        chunk.append(group)
        used += size
    if chunk:
        plan.append((chunk, False))
    return plan


def _solve_budget(groups: list) -> int | None:
    """Bytes the batched solve may take on the weights' device: 80 % of what the process may still allocate there
    (models.gpu: under --gpu-memory-limit, of what the cap leaves); no limit on CPU, where the GPTQ solver
    batches within its own cap."""
    device = groups[0][1][0].weight.device
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return int(gpu_room(device) * 0.8)


def _apply(groups, settings: QuantSettings, outcome: QuantOutcome, progress, picks=None, solve=None, budget=-1) -> None:
    """Quantize `groups` and write the dequantized weights back into their modules, in order. budget: bytes per
    solve chunk (-1: from the device's free memory; None: no limit)."""
    if not groups:
        return
    if budget == -1:
        budget = _solve_budget(groups)
    solved = []
    cpu = torch.device("cpu")
    for each, part in _by_setting(groups, settings, picks, solve):
        for chunk, on_cpu in solve_plan(part, budget):
            solved += list(zip(chunk, _quantize_groups(chunk, each, cpu if on_cpu else None), strict=True))
    order = {name: i for i, (names, _, _) in enumerate(groups) for name in names}
    solved.sort(key=lambda item: order[item[0][0][0]])
    for (names, modules, _), results in solved:
        for module, name, (qw, entry) in zip(modules, names, results, strict=False):
            with torch.no_grad():
                module.weight.copy_(qw.dequantize().to(module.weight.dtype))
            outcome.weights[name] = qw
            outcome.layers.append(entry)
            if progress:
                progress(name)
