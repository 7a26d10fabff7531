"""`gptq` end to end: load -> calibrate -> quantize -> export -> verify -> report -> card, into one atomic dir."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dflash_quant import __version__
from dflash_quant.artifact.files import portable_path
from dflash_quant.artifact.reports import Calibration, Parity, Provenance, Quantization, QuantReport
from dflash_quant.artifact.sources import portable_command, prompt_label, source_ref
from dflash_quant.calibration import cache as calib_cache
from dflash_quant.calibration.capture import CalibrationStats, capture
from dflash_quant.errors import UsageError
from dflash_quant.export.atomic import staging
from dflash_quant.export.manifest import write_manifest
from dflash_quant.export.writer import export_gptq
from dflash_quant.io.weights import weights_sha256
from dflash_quant.loading import load_drafter
from dflash_quant.lookup import LookupSettings
from dflash_quant.preflight import guard_run
from dflash_quant.quantize.drafter import QuantSettings, candidate_linears, extra_linears, quantize_drafter
from dflash_quant.runtime import (
    default_prompt_spec,
    encode_prompts,
    load_pair,
    prompt_categories,
    resolve_device,
    resolve_dtype,
    stop_tokens,
)
from dflash_quant.verify import (
    TIMED_PROMPTS,
    CheckSettings,
    baseline_runs,
    by_category,
    lookup_summary,
    parity,
    reference_runs,
    spec_runs,
    summarize,
    warm_up,
)

Progress = Callable[[str, int | None], Callable[[], None]]  # (stage label, total) -> advance()


@dataclass
class GptqJob:
    output: Path
    drafter: str = "reference"
    target: str | None = None
    quant: QuantSettings = field(default_factory=QuantSettings)
    overwrite: bool = False
    calib_prompts: str | None = None
    calib_num_prompts: int | None = None
    calib_max_new_tokens: int = 64
    kv_hessian: str = "block+context"
    calib_cache: Path | None = None
    calib_store: Path | None = None  # the user's calibration store (calibration.store; None: off)
    calib_store_max_bytes: int = 20_000_000_000  # its size cap (oldest-used entries evicted first)
    verify: bool = True
    eval_prompts: str | None = None
    eval_num_prompts: int | None = None
    eval_max_new_tokens: int = 128
    tolerance: float = 0.03
    device: str = "auto"
    dtype: str = "auto"
    chat_template: bool = True
    seed: int = 0
    full_baseline: bool = False  # parity: decode every prompt target-only (else check the bf16 run's tokens)
    check_cache: Path | None = None  # reuse the target-only and bf16 drafter runs of the parity check (None: off)
    check_batch: int | None = None  # parity: prompts decoded as rows of one batch (batch_decode; 1 = one by one)
    calib_batch: int | None = None  # calibration: the same for capture; None (both): default_batch
    write_card: bool = True
    command: list[str] = field(default_factory=list)
    format: str = "gptq"  # or compressed-tensors | gguf | mlx: converted from the GPTQ codes at export
    lookup: LookupSettings | None = None  # parity check: also run both drafters with the lookup proposer
    int4_kernel: str = "dequant"  # parity check: how a 4-bit drafter runs on CUDA (dflash_quant.int4_linear)
    gguf_type: str | None = (
        None  # a pure llama.cpp type or a mix (kmix.MIXES): GPTQ directly on its grids (format gguf)
    )
    gguf_scale_search: int = 2  # with gguf_type: +- radius of the in-loop sub-block scale/min search (0: off)
    placement: Any = None  # devmap.Placement: the target split by --device-map / --max-memory
    hessian_device: str | None = None  # where the fp32 Hessians accumulate (default: the drafter's device)
    calib_checkpoint_every: int = 16  # prompts between calibration checkpoints (0: none)
    kept_checkpoint: Any = None  # calibration.checkpoint.Kept on disk while calibration runs (for a rerun to resume)
    mixed: Any = None  # quantize.mixed_plan.MixedGoal: per-Linear bits chosen by a search (--max-tau-loss ...)


@dataclass
class GptqResult:
    output: Path
    passed: bool | None
    parity: dict[str, Any] | None
    quant_report: dict[str, Any]
    timings: dict[str, float]
    reasons: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None  # provenance's Calibration record (memory, placement, resume)
    target_quantization: dict[str, Any] | None = None  # artifact.reports.TargetQuantization of the target used


def _noop_progress(label: str, total: int | None) -> Callable[[], None]:
    return lambda: None


def _calibrate(
    job,
    drafter,
    target,
    spec: str,
    prompts: list[list[int]],
    drafter_sha: str,
    device,
    progress: Progress,
    target_sha: str = "",
) -> tuple[CalibrationStats, dict[str, Any]]:
    key = _calib_key(job, drafter, target, spec, prompts, drafter_sha)
    info = {
        "prompts": spec,
        "num_prompts": len(prompts),
        "max_new_tokens": job.calib_max_new_tokens,
        "kv_hessian": job.kv_hessian,
        "cached": False,
    }
    return _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info)


def _calib_key(job, drafter, target, spec: str, prompts: list[list[int]], drafter_sha: str) -> dict[str, Any]:
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


# Default rows per batch (check and capture) on CPU, where per-call overhead dominates: measured on the
# calibration prompts (benchmarks/results/check_batch_dev.json: CPU time 0.55x of one by one at 4 rows, 0.40x at
# 8, 0.33x at 16, 0.28x at 32, 0.26x at 64); 16 keeps most of the gain while activations (which grow with the
# rows, the prefill's hidden states most) stay 16 requests' worth.
CPU_BATCH = 16
# On a GPU the loop is bound by per-call host work even more (benchmarks/gpu_profile_job.sh), so rows are
# nearly free until memory runs out: GPU_BATCH rows, halved while the rows' predicted activations and caches
# (memory.calibration, per extra row) exceed GPU_BATCH_SHARE of the memory free when the batch is chosen.
GPU_BATCH = 64
GPU_BATCH_SHARE = 0.5


def rows_that_fit(rows: int, per_row_bytes: int, free_bytes: int, share: float = GPU_BATCH_SHARE) -> int:
    while rows > 1 and rows * per_row_bytes > share * free_bytes:
        rows //= 2
    return rows


def row_bytes(target, drafter, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Predicted bytes one more row of a batched decode adds (activations, caches, logits) at its peak."""
    from dflash_quant.memory.calibration import predict_calibration
    from dflash_quant.memory.kv import parse_shape

    dtype = str(next(drafter.model.parameters()).dtype).replace("torch.", "")
    t_shape, d_shape = parse_shape(target.source.path), parse_shape(drafter.raw_config)
    longest = max((len(p) for p in prompts), default=1)

    def peak(rows: int) -> int:
        return predict_calibration(t_shape, 0, d_shape, 0, longest, max_new_tokens, dtype=dtype, rows=rows).peak

    return peak(2) - peak(1)


def default_batch(requested: int | None, device: torch.device, per_row_bytes: Callable[[], int] | None = None) -> int:
    """--check-batch / --calib-batch when given, else CPU_BATCH on CPU and, on CUDA, GPU_BATCH capped by memory."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return CPU_BATCH
    if device.type != "cuda" or per_row_bytes is None:
        return 1
    free, _ = torch.cuda.mem_get_info(device)
    return rows_that_fit(GPU_BATCH, per_row_bytes(), free)


def check_rows(
    requested: int | None, device: torch.device, dtype: torch.dtype, per_row_bytes: Callable[[], int]
) -> int:
    """Parity check rows: as default_batch, but one by one on CUDA in 16-bit dtypes unless asked.

    A row's bf16 numerics change with the batch (GEMM shapes, padding, rows leaving), so near-ties flip
    differently in the two drafters' runs: on the H200 the reference pair's int4 tau ratio spread over
    0.956-1.011 in seven batched runs, 0.9971 in three one by one (benchmarks/results/gpu_main_sweep_h200.json). In fp32
    (the CPU's dtype) batched rows give the one-by-one tokens, so batching stays the default there."""
    if requested is None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return 1
    return default_batch(requested, device, per_row_bytes)


def calib_rows(job, drafter, target, prompts: list[list[int]]) -> int:
    """Prompts capture decodes as rows of one batch: --calib-batch (default by device), 1 where it cannot."""
    from dflash_quant.calibration.capture import capture_unbatchable

    device = next(drafter.model.parameters()).device
    rows = default_batch(job.calib_batch, device, lambda: row_bytes(target, drafter, prompts, job.calib_max_new_tokens))
    if rows > 1 and (job.quant.sequential or capture_unbatchable(drafter.model, target.model) is not None):
        return 1  # sequential GPTQ replays per-prompt drafter calls; other pairs decode one by one
    return max(1, min(rows, len(prompts)))


def _capture_or_load(job, drafter, target, prompts, device, progress, target_sha, key, info):
    hdev = resolve_hessian_device(job.hessian_device, device)
    if job.calib_cache is not None:
        stats = calib_cache.load(job.calib_cache, key, job.quant.sequential, hdev)
        if stats is not None:
            info["cached"] = True
            return stats, info
    store, skey = None, None
    if job.calib_cache is None:  # an explicit --calib-cache takes the store's place, checkpoints included
        from dflash_quant.calibration.store import CalibStore, default_dir, store_key

        store = CalibStore(job.calib_store or default_dir(), job.calib_store_max_bytes)
        skey = store_key(key, drafter, target, prompts, stop_tokens(target), device, hdev)
        stats = store.load(skey, job.quant.sequential, hdev) if job.calib_store is not None else None
        if stats is not None:
            info.update(cached=True, store="hit")
            return stats, info
    slot = store.checkpoint(skey) if store is not None and job.calib_checkpoint_every > 0 else None
    if slot is not None:
        try:
            slot.hold()  # before reading it: no other run evicts it meanwhile
        except OSError:  # an unwritable cache: calibrate without checkpoints
            slot = None
    finished = False
    try:
        stats = _capture(job, drafter, target, prompts, progress, target_sha, key, hdev, slot)
        if job.calib_cache is not None:
            from dflash_quant.calibration import checkpoint as ckpt

            calib_cache.save(job.calib_cache, stats, key)
            ckpt.clear(job.calib_cache)  # after the statistics: a kill in between loses neither
        if job.calib_store is not None and store is not None and skey is not None:
            info["store"] = store.save(stats, skey)  # before the checkpoint goes, likewise
        finished = True
    finally:
        if slot is not None:
            slot.release(finished)
    job.kept_checkpoint = None  # calibration is complete: nothing left to resume
    info["resumed_prompts"] = stats.resumed_prompts
    info["hessian_device"] = str(hdev)
    if key.get("calib_batch", 1) > 1:
        info["batch_rows"] = key["calib_batch"]
    info["memory"] = _calib_memory(job, drafter, target, prompts, stats, device, hdev, key.get("calib_batch", 1))
    return stats, info


def _capture(job, drafter, target, prompts, progress, target_sha, key, hdev, slot) -> CalibrationStats:
    """capture, resuming from and checkpointing into --calib-cache or the store's slot for this calibration;
    job.kept_checkpoint names the checkpoint on disk while it runs (the CLI's interruption message)."""
    from dflash_quant.calibration import checkpoint as ckpt

    # An interrupted run resumes only under the same drafter, target weights, prompt ids and settings.
    ckey = {
        **key,
        "target_sha256": target_sha,
        "prompt_ids_sha256": ckpt.prompts_digest(prompts),
        "sequential": job.quant.sequential,
    }
    ckdir = Path(job.calib_cache) if job.calib_cache is not None else slot.path if slot is not None else None
    every = job.calib_checkpoint_every if ckdir is not None else 0
    resume = ckpt.load(ckdir, ckey, hdev) if ckdir is not None and every > 0 else None

    def kept(done: int) -> None:
        assert ckdir is not None  # checkpoints exist only with a folder for them
        job.kept_checkpoint = ckpt.Kept(ckdir / ckpt.FILE, done, len(prompts))

    def save(state) -> None:
        assert ckdir is not None
        if slot is None:
            ckpt.save(ckdir, ckey, state)
        elif not slot.save(ckey, state):  # over the cache's cap: the previous checkpoint (if any) stays
            return
        kept(state.done)

    if resume is not None:
        kept(resume.done)
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
        extra=key.get("extra_linears", []),
        hessian_device=hdev,
        resume=resume,
        checkpoint=save,
        checkpoint_every=every,
        measure=True,
        batch=key.get("calib_batch", 1),
    )
    return stats


def resolve_hessian_device(name: str | None, device: torch.device) -> torch.device:
    if name is None:
        return device
    return resolve_device(name)


def _calib_memory(job, drafter, target, prompts, stats, device, hdev, rows: int = 1) -> dict[str, Any] | None:
    """Predicted (memory.calibration) and measured (calibration.peak) peak of the capture just run."""
    from dflash_quant.calibration.peak import predict_run

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


def _eval_prompts(job, target, calib_spec: str) -> tuple[str, list[list[int]]]:
    spec = job.eval_prompts or default_prompt_spec(target, "heldout")
    if spec == calib_spec:
        raise UsageError(
            f"parity prompts {spec!r} are the calibration prompts; pass held-out prompts with --eval-prompts"
        )
    return spec, encode_prompts(
        target,
        spec,
        job.eval_num_prompts,
        job.chat_template,
        job.eval_max_new_tokens,
        "--eval-max-new-tokens",
        "--eval-num-prompts",
    )


def run_gptq(job: GptqJob, progress: Progress = _noop_progress) -> GptqResult:
    """Quantize job.drafter and write the artifact to job.output (atomically, holding the output's lock)."""
    job.quant = job.quant.normalized()
    job.quant.check()
    if job.lookup is not None:
        job.lookup.check()
    if job.gguf_type is not None:
        from dflash_quant.quantize.kquant import grid_for

        grid_for(job.gguf_type)
        if not 0 <= job.gguf_scale_search <= 8:
            raise UsageError(f"--gguf-scale-search must be 0..8 (0: off), got {job.gguf_scale_search}")
        if job.format != "gguf":
            raise UsageError(f"--gguf-type {job.gguf_type} writes GGUF; add --format gguf")
    if job.mixed is not None:
        job.mixed.check()
        if job.quant.method != "gptq" or job.quant.sequential or job.gguf_type is not None:
            raise UsageError(
                "the mixed-precision search (--max-tau-loss/--max-bytes/--fit) runs plain GPTQ from the calibration "
                "Hessians; drop --method rtn, --sequential and --gguf-type"
            )
        if job.format in ("gguf", "mlx"):
            raise UsageError(
                f"--format {job.format} holds one bit width for all Linears, not a per-Linear mix; use --format gptq "
                "or compressed-tensors, or a uniform --bits"
            )
    if job.gguf_type is None and job.format != "gptq":
        from dflash_quant.export.convert import format_problem

        permuted = job.quant.desc_act and not job.quant.static_groups
        if problem := format_problem(job.format, job.quant.bits, job.quant.group_size, job.quant.sym, permuted):
            raise UsageError(problem)
    # Output, inputs and cache are checked and the output locked before anything is loaded or computed.
    specs = (job.calib_prompts, job.eval_prompts)
    with guard_run(
        job.output, job.overwrite, job.drafter, job.target, specs, job.calib_cache, job.check_cache
    ) as final:
        return _run(job, final, progress)


def _run(job: GptqJob, final: Path, progress: Progress) -> GptqResult:
    device = resolve_device(job.device)
    dtype = resolve_dtype(job.dtype, device)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    drafter, target = load_pair(job.drafter, job.target, device, dtype, job.placement)
    if job.format == "gguf":  # before calibrating: llama.cpp cannot run a drafter that taps the last layer
        from dflash_quant.config import read_config_json
        from dflash_quant.export.gguf import pairing_problem

        if problem := pairing_problem(read_config_json(drafter.source.path), target.source.path):
            raise UsageError(problem)
    if job.lookup is not None:  # its row length against the drafter's block, before any compute
        job.lookup.check(drafter.config.block_size)
    timings["load_s"] = time.perf_counter() - t0
    candidates = candidate_linears(drafter.model, job.quant)  # refuses DFlash2-only flags on a v1 drafter

    drafter_sha = weights_sha256(drafter.source.path)
    target_sha = weights_sha256(target.source.path)
    calib_info: dict[str, Any]
    stats, calib_info = (
        None,
        {"prompts": None, "num_prompts": 0, "max_new_tokens": 0, "kv_hessian": None, "cached": False},
    )
    calib_spec = job.calib_prompts or default_prompt_spec(target, "calib")
    eval_spec, eval_ids = _eval_prompts(job, target, calib_spec) if job.verify else (None, [])
    if job.quant.method == "gptq":
        calib_ids = encode_prompts(
            target, calib_spec, job.calib_num_prompts, job.chat_template, job.calib_max_new_tokens
        )
        seen = set(map(tuple, calib_ids))
        if any(tuple(p) in seen for p in eval_ids):  # checked before the target runs
            raise UsageError("some parity prompts also appear in the calibration prompts; use disjoint prompt sets")
        t = time.perf_counter()
        stats, calib_info = _calibrate(
            job, drafter, target, calib_spec, calib_ids, drafter_sha, device, progress, target_sha
        )
        calib_info.update(rows=stats.rows(), steps=stats.steps, mean_tau_bf16=stats.mean_tau)
        timings["calibrate_s"] = time.perf_counter() - t

    mix = None
    if job.mixed is not None:
        from dflash_quant.quantize.mixed_stage import plan_mix

        t = time.perf_counter()
        mix = plan_mix(
            job,
            drafter,
            target,
            stats,
            calib_ids,
            _calib_key(job, drafter, target, calib_spec, calib_ids, drafter_sha),
            progress,
        )
        job.quant = replace(job.quant, bits=mix.base.bits, group_size=mix.base.group_size)
        timings["mix_s"] = time.perf_counter() - t
    t = time.perf_counter()
    label = "mixed" if mix is not None else f"{job.quant.bits}-bit"
    advance = progress(f"quantizing ({job.quant.method}, {label})", len(candidates))
    if job.gguf_type is not None:
        from dflash_quant.quantize.kquant import quantize_drafter_kquant

        outcome = quantize_drafter_kquant(
            drafter.model,
            stats,
            job.quant,
            job.gguf_type,
            progress=lambda name: advance(),
            scale_search=job.gguf_scale_search,
        )
    else:
        outcome = quantize_drafter(
            drafter.model,
            stats,
            job.quant,
            progress=lambda name: advance(),
            picks=mix.picks if mix else None,
            solve=mix.solve if mix else None,
        )
    timings["quantize_s"] = time.perf_counter() - t

    quant_report = QuantReport.from_dict(
        {
            "layers": outcome.layers,
            "kept_bf16": outcome.kept,
            "original_bytes": sum(2 * qw.in_features * qw.out_features for qw in outcome.weights.values()),
            "quantized_bytes": None,  # export fills it from the written file
            "seconds": round(outcome.seconds, 3),
        }
    )
    source = source_ref(drafter.source, drafter_sha)
    target_ref = source_ref(target.source, target_sha)
    if job.placement is not None:
        from dflash_quant.devmap import device_summary

        placed = device_summary(target.model) or {}
        calib_info["target_placement"] = {
            **job.placement.describe(),
            "resolved": placed.get("map"),
            "weight_bytes": placed.get("weight_bytes"),
        }
    provenance = Provenance(
        tool="dflash-quant",
        tool_version=__version__,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        command=portable_command(job.command),
        source_drafter=source,
        target=target_ref,
        target_quantization=target.quantization,
        calibration=Calibration.from_dict(
            {
                **calib_info,
                "prompts": prompt_label(calib_info["prompts"]),
                "seed": job.seed,
                "chat_template": job.chat_template,
            }
        ),
        quantization=Quantization.from_dict(
            {
                **asdict(job.quant),
                "skip": list(job.quant.skip),
                "skipped": outcome.kept,
                **_grid_fields(job.gguf_type, outcome.layers, job.gguf_scale_search),
            }
        ),
        mixed=mix.record if mix is not None else None,
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
    )

    result = GptqResult(output=job.output, passed=None, parity=None, quant_report={}, timings=timings)
    result.calibration = provenance.calibration.to_dict() if provenance.calibration is not None else None
    result.target_quantization = target.quantization.to_dict() if target.quantization is not None else None
    with staging(final, job.overwrite) as tmp:
        if job.gguf_type is not None:  # already on llama.cpp's grid: written as GGUF directly, no GPTQ v1 step
            from dflash_quant.quantize.kquant import write_kquant_gguf

            write_kquant_gguf(tmp, drafter, outcome, job.gguf_type, target.source.path, provenance, quant_report, stats)
        else:
            export_gptq(tmp, drafter, outcome, job.quant, provenance, quant_report, mix.picks if mix else None)
        result.quant_report = quant_report.to_dict()
        # memory of the tensors as written (a conversion below restates it for its own files)
        _memory(tmp, final, drafter.source, target_ref.id, target.source.path, device)
        if job.format != "gptq" and job.gguf_type is None:  # same codes in the engine's layout; parity loads these
            from dflash_quant.export.convert import convert_artifact

            convert_artifact(tmp, tmp, job.format, target=target.source.path, command=job.command)
        if job.verify:
            t = time.perf_counter()
            report = _parity(job, source.id, tmp, target, eval_spec, eval_ids, device, dtype, progress)
            timings["verify_s"] = time.perf_counter() - t
            report.write(tmp)
            result.parity = report.to_dict()
            result.passed = report.passed
            result.reasons = report.reasons or []
        if job.write_card:
            from dflash_quant.model_cards.card import write_card

            write_card(tmp, command=job.command)
        write_manifest(tmp)
    timings["total_s"] = time.perf_counter() - t0
    return result


def _parity(job, source_id, artifact: Path, target, spec, eval_ids, device, dtype, progress) -> Parity:
    """bf16 source vs the exported (dequantized) drafter on held-out prompts, same target runs."""
    base = load_drafter(job.drafter, device=device, dtype=dtype)
    quant = load_drafter(artifact, device=device, dtype=dtype)
    from dflash_quant.int4_linear import use_int4_kernel

    kernel = use_int4_kernel(quant.model, artifact, quant.quantization, job.int4_kernel)
    block = base.config.block_size
    settings = CheckSettings(
        job.eval_max_new_tokens,
        0.0,
        block,
        job.seed,
        stop_tokens(target),
        batch=check_rows(
            job.check_batch, device, dtype, lambda: row_bytes(target, base, eval_ids, job.eval_max_new_tokens)
        ),
    )
    warm_up(base.model, target.model, eval_ids[0], settings)
    # The target-only and bf16 runs depend on neither the recipe nor the output: reused across runs.
    from dflash_quant.check_cache import CheckCache, cached_runs, check_key, model_identity
    from dflash_quant.decode import GreedyResult, SpecResult

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
    return Parity.from_dict(
        {
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
            # "hit": those runs (and their timings) come from an earlier run's cache, not from this run
            "cache": {
                "target_only": cache.events.get("baseline", "off"),
                "bf16_drafter": cache.events.get("spec", "off"),
            },
        }
    )


def _grid_fields(gguf_type: str | None, layers: list[dict[str, Any]], scale_search: int = 0) -> dict[str, Any]:
    """A run on a llama.cpp grid records that grid (a mix: its default grid, and bits/weight over all its
    tensors), not the GPTQ v1 defaults it did not use."""
    if gguf_type is None:
        return {}
    from dflash_quant.quantize.kquant import grid_for

    grid = grid_for(gguf_type)
    sizes = [(math.prod(layer["shape"]), layer["bits_per_weight"]) for layer in layers]
    total = sum(n for n, _ in sizes)
    return {
        "bits": grid.code_bits,
        "group_size": grid.sub,
        "sym": not grid.has_min,
        "desc_act": False,
        "static_groups": False,
        "gguf_type": gguf_type,
        "gguf_scale_search": scale_search,
        "bits_per_weight": round(sum(n * b for n, b in sizes) / total, 4) if total else grid.bits_per_weight,
    }


def _memory(artifact: Path, final: Path, source, target_name: str | None, target: Path, device: torch.device) -> None:
    """memory.json with a 24 GB budget for this target (int4 weights, 8k context, vLLM defaults).

    Measured in the temp dir, recorded under the names the artifact will have (never the temp dir's)."""
    from dflash_quant.memory.plan import embedded_budget
    from dflash_quant.memory.report import build_memory_report, write_memory_json

    name = portable_path(final)
    budget = embedded_budget(str(target), str(artifact), target_label=target_name, drafter_label=name)
    report = build_memory_report(
        artifact,
        baseline=source.path,
        device=device.type,
        budget_24gb=budget,
        artifact_name=name,
        baseline_name=source_ref(source).id,
    )
    write_memory_json(report, artifact)
