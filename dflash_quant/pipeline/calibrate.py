"""The calibration stage of `gptq`: Hessians from the drafter speculating with its target, reused from
--calib-cache or the calibration store when the key matches, checkpointed (into --calib-cache, else the
store's slot for the key) so that the rerun of an interrupted command resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_quant.calibration import cache as calib_cache
from dflash_quant.calibration import checkpoint as ckpt
from dflash_quant.calibration.capture import CalibrationStats, capture
from dflash_quant.calibration.peak import predict_run
from dflash_quant.calibration.store import CalibStore, default_dir, store_key
from dflash_quant.loading.drafter import LoadedDrafter
from dflash_quant.loading.runtime import resolve_device, stop_tokens
from dflash_quant.loading.target import LoadedTarget
from dflash_quant.memory.gpus import fmt_bytes
from dflash_quant.pipeline.batching import calib_rows
from dflash_quant.pipeline.job import GptqJob, Progress, RunState
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
    state: RunState | None = None,
) -> tuple[CalibrationStats, dict[str, Any]]:
    """The Hessians of `prompts` and provenance's calibration record (cached, stored, resumed: see the module);
    `state` learns where an unfinished calibration's checkpoint lies while it runs."""
    state = state if state is not None else RunState()
    key = calib_key(job, drafter, target, spec, prompts, drafter_sha)
    info = {
        "prompts": spec,
        "num_prompts": len(prompts),
        "max_new_tokens": job.calib_max_new_tokens,
        "kv_hessian": job.kv_hessian,
        "cached": False,
    }
    return _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info, state)


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
    if job.teacher_forced:  # the target's tokens and taps from a batched greedy decode: keyed apart
        key["teacher_rows"] = rows
    elif rows > 1:  # the same rows summed in another order: keyed apart, batch-1 entries stay valid
        key["calib_batch"] = rows
    return key


def _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info, state: RunState):
    hdev = resolve_hessian_device(job.hessian_device, device)
    if job.calib_cache is not None:
        stats = calib_cache.load(job.calib_cache, key, job.quant.needs_replay, hdev)
        if stats is not None:
            info["cached"] = True
            return stats, info
    store, skey = None, None
    if job.calib_cache is None:  # an explicit --calib-cache takes the store's place, checkpoints included
        store = CalibStore(job.calib_store or default_dir(), job.calib_store_max_bytes)
        skey = store_key(key, drafter, target, prompts, stop_tokens(target), device, hdev)
        stats = store.load(skey, job.quant.needs_replay, hdev) if job.calib_store is not None else None
        if stats is not None:
            info.update(cached=True, store="hit")
            return stats, info
    slot = store.checkpoint(skey) if store is not None and skey is not None and job.calib_checkpoint_every > 0 else None
    if slot is not None:
        try:
            slot.hold()  # before reading it: no other run evicts it meanwhile
        except OSError:  # an unwritable cache: calibrate without checkpoints
            slot = None
    finished = False
    try:
        stats = _capture(job, drafter, target, prompts, progress, target_sha, key, hdev, slot, state)
        if job.calib_cache is not None:
            calib_cache.save(job.calib_cache, stats, key)
            ckpt.clear(job.calib_cache)  # after the statistics: a kill in between loses neither
        if job.calib_store is not None and store is not None and skey is not None:
            info["store"] = store.save(stats, skey)  # before the checkpoint goes, likewise
        finished = True
    finally:
        if slot is not None:
            slot.release(finished)
    state.kept_checkpoint = None  # calibration is complete: nothing left to resume
    info["resumed_prompts"] = stats.resumed_prompts
    info["hessian_device"] = str(hdev)
    rows = key.get("calib_batch", key.get("teacher_rows", 1))
    if rows > 1:
        info["batch_rows"] = rows
    if job.teacher_forced:
        info["teacher_forced"] = True
    info["memory"] = _calib_memory(job, drafter, target, prompts, stats, device, hdev, rows)
    return stats, info


def _capture(job, drafter, target, prompts, progress, target_sha, key, hdev, slot, state: RunState) -> CalibrationStats:
    """capture, resuming from and checkpointing into --calib-cache or the store's slot for this calibration;
    state.kept_checkpoint names the checkpoint on disk while it runs (the CLI's interruption message)."""
    # An interrupted run resumes only under the same drafter, target weights, prompt ids and settings.
    ckey = {
        **key,
        "target_sha256": target_sha,
        "prompt_ids_sha256": ckpt.prompts_digest(prompts),
        "sequential": job.quant.needs_replay,
    }
    ckdir = Path(job.calib_cache) if job.calib_cache is not None else slot.path if slot is not None else None
    every = job.calib_checkpoint_every if ckdir is not None else 0
    resume = ckpt.load(ckdir, ckey, hdev) if ckdir is not None and every > 0 else None

    if ckdir is not None and every > 0:
        state.kept_checkpoint = ckpt.Kept(ckdir / ckpt.FILE, ckey, len(prompts))

    def save(capture_state) -> None:
        assert ckdir is not None  # checkpoints exist only with a folder for them
        if slot is None:
            ckpt.save(ckdir, ckey, capture_state)
        else:  # over the cache's cap it writes nothing: the previous checkpoint (if any) stays
            slot.save(ckey, capture_state)

    advance = progress(stage_label(job, target), len(prompts))
    for _ in range(resume.done if resume else 0):
        advance()
    stats = capture(
        drafter.model,
        target.model,
        prompts,
        job.calib_max_new_tokens,
        job.kv_hessian,
        stop_token_ids=stop_tokens(target),
        keep_replay=job.quant.needs_replay,
        progress=advance,
        extra=key.get("extra_linears", []),
        hessian_device=hdev,
        resume=resume,
        checkpoint=save,
        checkpoint_every=every,
        measure=True,
        batch=key.get("calib_batch", key.get("teacher_rows", 1)),
        teacher=job.teacher_forced,
    )
    return stats


def stage_label(job: GptqJob, target: LoadedTarget) -> str:
    """The calibration stage's line; for a split target it says what every target forward streams (tens of GB
    per token at the 27B scale under a 24 GB plan), so a slow decode is explained before it starts."""
    what = (
        "drafter on the target's greedy continuations" if job.teacher_forced else "drafter speculating with its target"
    )
    streamed = target.streamed
    if streamed is not None:
        parts = []
        if streamed["host"]:
            parts.append(
                f"{fmt_bytes(streamed['host'])} from host memory ({fmt_bytes(streamed['pinned'])} page-locked)"
            )
        if streamed["disk"]:
            parts.append(f"{fmt_bytes(streamed['disk'])} from disk")
        what += "; every target forward streams " + " and ".join(parts)
    return f"calibrating ({what})"


def resolve_hessian_device(name: str | None, device: torch.device) -> torch.device:
    if name is None:
        return device
    return resolve_device(name)


def _calib_memory(job, drafter, target, prompts, stats, device, hdev, rows: int = 1) -> dict[str, Any] | None:
    """Predicted (memory.calibration) and measured (calibration.peak) peak of the capture just run."""
    if stats.memory is None:
        return None
    pred, comparable = predict_run(
        target.model, drafter.model, target.source.path, drafter.raw_config,
        prompts, job.calib_max_new_tokens, next(drafter.model.parameters()).dtype, job.kv_hessian, device, hdev,
        rows=rows, teacher_taps=len(drafter.model.target_layer_ids) if job.teacher_forced else 0,
    )  # fmt: skip
    measured = stats.memory["measured_bytes"]
    return {
        "predicted_peak_bytes": pred.peak,
        "predicted_resident_bytes": pred.resident,
        "predicted": pred.to_dict(),
        **stats.memory,
        "ratio": round(measured / comparable, 4) if comparable else None,
    }
