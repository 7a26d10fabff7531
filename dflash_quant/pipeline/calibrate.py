"""The calibration stage of `gptq`: Hessians from the drafter speculating with its target, reused from
--calib-cache or the calibration store when the key matches, checkpointed so an interrupted run resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_quant.calibration import cache as calib_cache
from dflash_quant.calibration import checkpoint as ckpt
from dflash_quant.calibration.capture import CalibrationStats, capture
from dflash_quant.calibration.checkpoint import prompts_digest
from dflash_quant.calibration.peak import predict_run
from dflash_quant.calibration.store import CalibStore, store_key
from dflash_quant.loading.drafter import LoadedDrafter
from dflash_quant.loading.runtime import resolve_device, stop_tokens
from dflash_quant.loading.target import LoadedTarget
from dflash_quant.pipeline.batching import calib_rows
from dflash_quant.pipeline.job import GptqJob, Progress
from dflash_quant.quantize.drafter import extra_linears


def calibrate(
    job: GptqJob,
    drafter: LoadedDrafter,
    target: LoadedTarget,
    spec: str,
    prompts: list[list[int]],
    drafter_sha: str,
    device: torch.device,
    progress: Progress,
    target_sha: str = "",
) -> tuple[CalibrationStats, dict[str, Any]]:
    """The Hessians of `prompts` and provenance's calibration record (cached, stored, resumed: see the module)."""
    key = calib_key(job, drafter, target, spec, prompts, drafter_sha)
    info = {
        "prompts": spec,
        "num_prompts": len(prompts),
        "max_new_tokens": job.calib_max_new_tokens,
        "kv_hessian": job.kv_hessian,
        "cached": False,
    }
    return _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info)


def calib_key(
    job: GptqJob, drafter: LoadedDrafter, target: LoadedTarget, spec: str, prompts: list[list[int]], drafter_sha: str
) -> dict[str, Any]:
    """What calibration statistics depend on: a cache entry (or checkpoint) is reused only under the same key."""
    key = {
        "drafter_sha256": drafter_sha,
        "target": target.source.id,
        "prompts": spec,
        "num_prompts": len(prompts),
        "max_new_tokens": job.calib_max_new_tokens,
        "kv_hessian": job.kv_hessian,
        "chat_template": job.chat_template,
        "dtype": str(next(drafter.model.parameters()).dtype),
    }
    extra = extra_linears(drafter.model, job.quant)  # DFlash2 conv/selector projections, only when asked
    if extra:  # keyed only then, so caches of the default recipe stay valid
        key["extra_linears"] = extra
    rows = calib_rows(job, drafter, target, prompts)
    if rows > 1:  # the same rows summed in another order: keyed apart, batch-1 entries stay valid
        key["calib_batch"] = rows
    return key


def _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info):
    extra = key.get("extra_linears", [])
    hdev = resolve_hessian_device(job.hessian_device, device)
    if job.calib_cache is not None:
        stats = calib_cache.load(job.calib_cache, key, job.quant.sequential, hdev)
        if stats is not None:
            info["cached"] = True
            return stats, info
    store, skey = None, None
    if job.calib_cache is None and job.calib_store is not None:  # an explicit --calib-cache takes its place
        store = CalibStore(job.calib_store, job.calib_store_max_bytes)
        skey = store_key(key, drafter, target, prompts, stop_tokens(target), device, hdev)
        stats = store.load(skey, job.quant.sequential, hdev)
        if stats is not None:
            info.update(cached=True, store="hit")
            return stats, info
    # An interrupted run resumes only under the same drafter, target weights, prompt ids and settings.
    ckey = {
        **key,
        "target_sha256": target_sha,
        "prompt_ids_sha256": prompts_digest(prompts),
        "sequential": job.quant.sequential,
    }
    ckdir = checkpoint_dir(job)
    resume = ckpt.load(ckdir, ckey, hdev) if job.calib_checkpoint_every > 0 else None
    advance = progress("calibrating (drafter speculating with its target)", len(prompts))
    for _ in range(resume.done if resume else 0):
        advance()
    stats = capture(
        drafter.model,
        target.model,
        prompts,
        job.calib_max_new_tokens,
        job.kv_hessian,
        stop_token_ids=stop_tokens(target),
        keep_replay=job.quant.sequential,
        progress=advance,
        extra=extra,
        hessian_device=hdev,
        resume=resume,
        checkpoint=lambda state: ckpt.save(ckdir, ckey, state),
        checkpoint_every=job.calib_checkpoint_every,
        measure=True,
        batch=key.get("calib_batch", 1),
    )
    if job.calib_cache is not None:
        calib_cache.save(job.calib_cache, stats, key)
    if store is not None and skey is not None:
        info["store"] = store.save(stats, skey)
    ckpt.clear(ckdir)
    if job.calib_cache is None and ckdir.is_dir() and not any(ckdir.iterdir()):
        ckdir.rmdir()
    info["resumed_prompts"] = stats.resumed_prompts
    info["hessian_device"] = str(hdev)
    if key.get("calib_batch", 1) > 1:
        info["batch_rows"] = key["calib_batch"]
    info["memory"] = _calib_memory(job, drafter, target, prompts, stats, device, hdev, key.get("calib_batch", 1))
    return stats, info


def resolve_hessian_device(name: str | None, device: torch.device) -> torch.device:
    if name is None:
        return device
    return resolve_device(name)


def checkpoint_dir(job: GptqJob) -> Path:
    """--calib-cache when given, else a hidden folder beside --output (removed once calibration finishes)."""
    if job.calib_cache is not None:
        return Path(job.calib_cache)
    return job.output.parent / f".{job.output.name}.calib-checkpoint"


def _calib_memory(job, drafter, target, prompts, stats, device, hdev, rows: int = 1) -> dict[str, Any] | None:
    """Predicted (memory.calibration) and measured (calibration.peak) peak of the capture just run."""
    if stats.memory is None:
        return None
    pred, comparable = predict_run(
        target.model, drafter.model, target.source.path, drafter.raw_config,
        prompts, job.calib_max_new_tokens, next(drafter.model.parameters()).dtype, job.kv_hessian, device, hdev,
        rows=rows,
    )  # fmt: skip
    measured = stats.memory["measured_bytes"]
    return {
        "predicted_peak_bytes": pred.peak,
        "predicted_resident_bytes": pred.resident,
        "predicted": pred.to_dict(),
        **stats.memory,
        "ratio": round(measured / comparable, 4) if comparable else None,
    }
