"""The verify stage of `gptq`: the bf16 source and the exported drafter (read back from its files) on held-out
prompts with the same target; the parity gate's verdict. The target-only and bf16 runs are cached."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_quant.artifact.reports import Parity
from dflash_quant.artifact.sources import portable_path, prompt_label
from dflash_quant.io.source import resolve
from dflash_quant.io.weights import weights_sha256
from dflash_quant.kernels.int4_linear import use_int4_kernel
from dflash_quant.loading.drafter import LoadedDrafter, load_drafter, read_draft_config
from dflash_quant.loading.runtime import prompt_categories, stop_tokens
from dflash_quant.loading.target import LoadedTarget
from dflash_quant.pipeline.batching import check_rows, config_row_bytes, default_batch, row_bytes
from dflash_quant.pipeline.job import GptqJob, Progress
from dflash_quant.speculative.check_cache import CheckCache, cached_runs, check_key, model_identity
from dflash_quant.speculative.decode import GreedyResult, SpecResult
from dflash_quant.speculative.teacher import greedy_rows_batched
from dflash_quant.speculative.verify import (
    TIMED_PROMPTS,
    CheckSettings,
    baseline_runs,
    by_category,
    lookup_summary,
    parity,
    reference_runs,
    spec_runs,
    summarize,
    untimed,
    warm_up,
)


def check_parity(
    job: GptqJob,
    source_id: str,
    artifact: Path,
    target: LoadedTarget,
    spec: str,
    eval_ids: list[list[int]],
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress,
) -> Parity:
    """bf16 source vs the exported (dequantized) drafter on held-out prompts, same target runs."""
    if job.teacher_forced:
        return _teacher_parity(job, source_id, artifact, target, spec, eval_ids, device, dtype, progress)
    base = load_drafter(job.drafter, device=device, dtype=dtype)
    quant = load_drafter(artifact, device=device, dtype=dtype)
    kernel = use_int4_kernel(quant.model, artifact, quant.quantization, job.int4_kernel)
    block = base.config.block_size
    settings = _settings(job, target, base, eval_ids, device, dtype)
    warm_up(base.model, target.model, eval_ids[0], settings)
    # The target-only and bf16 runs depend on neither the recipe nor the output: reused across runs.
    cache = CheckCache(job.check_cache)
    tkey = check_key(
        target=model_identity(target.source.path), prompts=eval_ids, settings=settings, device=device, dtype=dtype
    )
    dkey = check_key(
        target=tkey["target"],
        prompts=eval_ids,
        settings=settings,
        device=device,
        dtype=dtype,
        drafter=weights_sha256(base.source.path),
    )
    base_runs = cached_runs(
        cache,
        "spec",
        dkey,
        SpecResult,
        lambda: spec_runs(
            base.model, target.model, eval_ids, settings, progress("parity: bf16 drafter", len(eval_ids))
        ),
    )
    if job.full_baseline:  # every prompt decoded target-only, one token per forward

        def reference_of() -> list[GreedyResult]:
            return baseline_runs(
                target.model, eval_ids, settings, progress("parity: target-only baseline", len(eval_ids))
            )
    else:  # the bf16 run's tokens checked in one target forward per prompt; a few prompts decoded for speed
        tkey["reference"] = f"target_check+{TIMED_PROMPTS}"

        def reference_of() -> list[GreedyResult]:
            candidates = [r.tokens for r in base_runs]
            adv = progress("parity: target's greedy output", len(eval_ids))
            return reference_runs(target.model, eval_ids, candidates, settings, TIMED_PROMPTS, adv)

    reference = cached_runs(cache, "baseline", tkey, GreedyResult, reference_of)
    categories = prompt_categories(spec, job.eval_num_prompts)
    checks = []
    drafters = ((source_id, "bf16", base.model, base_runs), (portable_path(job.output), "quantized", quant.model, None))
    for name, label, model, runs in drafters:
        if runs is None:
            runs = spec_runs(
                model, target.model, eval_ids, settings, progress(f"parity: {label} drafter", len(eval_ids))
            )
        check = summarize(name, runs, reference, settings, block)
        if cats := by_category(runs, categories):
            check["by_category"] = cats
        if job.lookup is not None:  # reported beside the gate; the gate's tau stays the drafter's own
            looked = CheckSettings(job.eval_max_new_tokens, 0.0, block, job.seed, settings.stop_token_ids, job.lookup)
            adv = progress(f"parity: {label} drafter + lookup", len(eval_ids))
            check["lookup"] = lookup_summary(
                check, runs, spec_runs(model, target.model, eval_ids, looked, adv), reference, looked, block, categories
            )
        checks.append(check)
    s_base, s_quant = checks
    verdict = parity(s_base, s_quant, job.tolerance, greedy=True, exact=dtype == torch.float32)
    if job.lookup is not None and dtype == torch.float32:
        for check in checks:
            if check["lookup"]["lossless"] is False:
                verdict["passed"] = False
                verdict["reasons"].append(
                    f"greedy output of {check['drafter']} with lookup differs from the target's own"
                )
    record = _record(job, spec, eval_ids, block, device, dtype, target, kernel, s_base, s_quant, verdict)
    # "hit": those runs (and their timings) come from an earlier run's cache, not from this run
    record["cache"] = {
        "target_only": cache.events.get("baseline", "off"),
        "bf16_drafter": cache.events.get("spec", "off"),
    }
    return Parity.from_dict(record)


def _settings(job: GptqJob, target: LoadedTarget, base: LoadedDrafter, eval_ids, device, dtype) -> CheckSettings:
    rows = check_rows(
        job.check_batch, device, dtype, lambda: row_bytes(target, base, eval_ids, job.eval_max_new_tokens)
    )
    return CheckSettings(
        job.eval_max_new_tokens, 0.0, base.config.block_size, job.seed, stop_tokens(target), batch=rows
    )


def _teacher_parity(job, source_id, artifact, target, spec, eval_ids, device, dtype, progress) -> Parity:
    """Both drafters against the target's greedy continuation of each prompt, decoded once in batches: tau and
    per-position acceptance only (the target verifies no block, so losslessness and speed are not measured).

    The greedy record is made before either drafter is loaded, and each drafter is loaded for its own pass only:
    under a GPU cap with a split 27B target, the record's batch and two drafters do not fit at once."""
    raw, config = read_draft_config(resolve(job.drafter))  # the config only: no weights held yet
    n_new = job.eval_max_new_tokens
    rows = default_batch(job.calib_batch, device, lambda: config_row_bytes(target, raw, dtype, eval_ids, n_new))
    adv = progress("parity: target's greedy continuation", len(eval_ids))
    layers = config.target_layer_ids
    teachers = greedy_rows_batched(target.model, eval_ids, job.eval_max_new_tokens, layers, device, rows, adv)
    checks, kernel = [], None
    categories = prompt_categories(spec, job.eval_num_prompts)
    for name, label, src in ((source_id, "bf16", job.drafter), (portable_path(job.output), "quantized", artifact)):
        drafter = load_drafter(src, device=device, dtype=dtype)
        if label == "quantized":
            kernel = use_int4_kernel(drafter.model, artifact, drafter.quantization, job.int4_kernel)
        settings = _settings(job, target, drafter, eval_ids, device, dtype)
        runs = spec_runs(
            drafter.model, target.model, eval_ids, settings, progress(f"parity: {label} drafter", len(eval_ids)),
            teachers=teachers,
        )  # fmt: skip
        check = untimed(summarize(name, runs, None, settings, drafter.config.block_size))
        if cats := by_category(runs, categories):
            check["by_category"] = cats
        checks.append(check)
        del drafter, runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    block = config.block_size
    s_base, s_quant = checks
    verdict = parity(s_base, s_quant, job.tolerance, greedy=False)
    verdict["notes"].append(
        "teacher-forced check (--teacher-forced): tau against the target's greedy continuation; losslessness and "
        "speed not measured"
    )
    record = _record(job, spec, eval_ids, block, device, dtype, target, kernel, s_base, s_quant, verdict)
    record["teacher_forced"] = True
    return Parity.from_dict(record)


def _record(job, spec, eval_ids, block, device, dtype, target, kernel, s_base, s_quant, verdict) -> dict:
    """Parity's fields from the two checks and the verdict."""
    return {
        "passed": verdict["passed"],
        "tolerance": job.tolerance,
        "tau_ratio": verdict["tau_ratio"],
        "per_position_ratio": verdict["per_position_ratio"],
        "lossless": s_quant["lossless"],
        "reasons": verdict["reasons"],
        "notes": verdict["notes"],
        "lossless_gated": verdict["lossless_gated"],
        "lossless_status": verdict["lossless_status"],
        "temperature": 0.0,
        "prompt_set": prompt_label(spec),
        "num_prompts": len(eval_ids),
        "max_new_tokens": job.eval_max_new_tokens,
        "block_size": block,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "baseline": s_base,
        "quantized": s_quant,
        "target_quantization": target.quantization.to_dict() if target.quantization is not None else None,
        "drafter_kernel": kernel,
        "spec_speed_ratio": (
            round(s_quant["spec_tokens_per_s"] / s_base["spec_tokens_per_s"], 4)
            if s_quant.get("spec_tokens_per_s") and s_base.get("spec_tokens_per_s")
            else None
        ),
    }
