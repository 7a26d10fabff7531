"""The stages of a checked `gptq` job, in order: load -> inputs -> calibrate -> (mix) -> quantize -> (tune) ->
record -> export -> verify -> report -> card, each a plain function of typed inputs and outputs. run_stages runs them
into a temp dir beside the guarded output and publishes it in one rename (pipeline.run holds the guard)."""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dflash_quant import __version__
from dflash_quant.artifact.manifest import write_manifest
from dflash_quant.artifact.reports import Calibration, Parity, Provenance, Quantization, QuantReport, SourceRef
from dflash_quant.artifact.sources import portable_command, portable_path, prompt_label, source_ref
from dflash_quant.calibration.capture import CalibrationStats
from dflash_quant.errors import UsageError
from dflash_quant.export.convert import convert_artifact
from dflash_quant.export.gguf import pairing_problem, write_kquant_gguf
from dflash_quant.export.writer import export_gptq
from dflash_quant.io.atomic import staging
from dflash_quant.io.source import Source, resolve
from dflash_quant.io.weights import BackgroundSha256
from dflash_quant.loading.drafter import LoadedDrafter, measure_resident
from dflash_quant.loading.runtime import (
    default_prompt_spec,
    default_target,
    encode_prompts,
    load_pair,
    resolve_device,
    resolve_dtype,
)
from dflash_quant.loading.target import LoadedTarget
from dflash_quant.memory.plan import embedded_budget
from dflash_quant.memory.report import build_memory_report, write_memory_json
from dflash_quant.model_cards.card import write_card
from dflash_quant.models.config import read_config_json
from dflash_quant.models.devmap import device_summary
from dflash_quant.pipeline.calibrate import calib_key, calibrate
from dflash_quant.pipeline.job import GptqJob, GptqResult, Progress, RunState
from dflash_quant.pipeline.mixed_stage import MixPlan, plan_mix
from dflash_quant.pipeline.parity import check_parity
from dflash_quant.quantize.drafter import QuantOutcome, candidate_linears, quantize_drafter
from dflash_quant.quantize.kquant import grid_for, quantize_drafter_kquant
from dflash_quant.quantize.settings import QuantSettings
from dflash_quant.quantize.tune import TuneReport, teacher_rows, tune_scales


@dataclass
class Loaded:
    """The pair on its device, in the run's dtype."""

    drafter: LoadedDrafter
    target: LoadedTarget
    device: torch.device
    dtype: torch.dtype
    drafter_sha: BackgroundSha256  # the weights' hashes, computed while the pair loads
    target_sha: BackgroundSha256


@dataclass
class Inputs:
    """What the run reads besides the models: the Linears it may quantize, the weights' hashes, the prompts."""

    candidates: list[str]
    drafter_sha: str
    target_sha: str
    calib_spec: str
    calib_ids: list[list[int]]  # empty for round-to-nearest (nothing to calibrate)
    eval_spec: str | None  # None without --verify
    eval_ids: list[list[int]]


@dataclass
class Calibrated:
    stats: CalibrationStats | None  # None: round-to-nearest
    info: dict[str, Any]  # provenance's calibration record (before the placement is added)


@dataclass
class Quantized:
    outcome: QuantOutcome
    quant: QuantSettings  # the settings applied (a mix: its base grid)
    mix: MixPlan | None
    report: QuantReport  # its byte counts are filled in by export


def cap_gpu_memory(device: torch.device, limit: int) -> None:
    """Cap the allocator at `limit` bytes of `device` (an allocation beyond it fails as out of memory)."""
    if device.type != "cuda":  # --device auto found no GPU
        raise UsageError(f"--gpu-memory-limit caps a GPU, and this run is on {device}; drop it or run on CUDA")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    if limit > total:
        raise UsageError(
            f"--gpu-memory-limit {limit / 2**30:.2f} GiB is more than {device} has ({total / 2**30:.2f} GiB); "
            "give a smaller limit or drop it"
        )
    torch.cuda.set_per_process_memory_fraction(limit / total, index)


def load(job: GptqJob) -> Loaded:
    """The pair (config and weight headers checked before the target loads), and the checks that need it."""
    device = resolve_device(job.device)
    dtype = resolve_dtype(job.dtype, device)
    if job.gpu_memory_limit is not None:
        cap_gpu_memory(device, job.gpu_memory_limit)
    # Hashing starts first: a 27B target's tens of seconds of it then overlap its loading.
    hashes = [BackgroundSha256(resolve(src).path) for src in (job.drafter, job.target or default_target(job.drafter))]
    drafter, target = load_pair(job.drafter, job.target, device, dtype, job.placement)
    if job.format == "gguf":  # before calibrating: llama.cpp cannot run a drafter that taps the last layer
        if problem := pairing_problem(read_config_json(drafter.source.path), target.source.path):
            raise UsageError(problem)
    if job.lookup is not None:  # its row length against the drafter's block, before any compute
        job.lookup.check(drafter.config.block_size)
    return Loaded(drafter, target, device, dtype, *hashes)


def inputs(job: GptqJob, loaded: Loaded) -> Inputs:
    """Linears, hashes and prompts; every prompt problem (length, overlap) is refused before the target runs."""
    drafter, target = loaded.drafter, loaded.target
    candidates = candidate_linears(drafter.model, job.quant)  # refuses DFlash2-only flags on a v1 drafter
    drafter_sha, target_sha = loaded.drafter_sha.result(), loaded.target_sha.result()
    calib_spec = job.calib_prompts or default_prompt_spec(target, "calib")
    eval_spec, eval_ids = _eval_prompts(job, target, calib_spec) if job.verify else (None, [])
    calib_ids: list[list[int]] = []
    if job.quant.calibrated:
        calib_ids = encode_prompts(
            target, calib_spec, job.calib_num_prompts, job.chat_template, job.calib_max_new_tokens
        )
        seen = set(map(tuple, calib_ids))
        if any(tuple(p) in seen for p in eval_ids):
            raise UsageError("some parity prompts also appear in the calibration prompts; use disjoint prompt sets")
    return Inputs(candidates, drafter_sha, target_sha, calib_spec, calib_ids, eval_spec, eval_ids)


def _eval_prompts(job: GptqJob, target: LoadedTarget, calib_spec: str) -> tuple[str, list[list[int]]]:
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


def calibrated(job: GptqJob, loaded: Loaded, ins: Inputs, progress: Progress, state: RunState) -> Calibrated:
    """GPTQ's Hessians (pipeline.calibrate: cached, stored, checkpointed); round-to-nearest needs none."""
    info: dict[str, Any]
    if not job.quant.calibrated:
        info = {"prompts": None, "num_prompts": 0, "max_new_tokens": 0, "kv_hessian": None, "cached": False}
        return Calibrated(None, info)
    stats, info = calibrate(
        job,
        loaded.drafter,
        loaded.target,
        ins.calib_spec,
        ins.calib_ids,
        ins.drafter_sha,
        loaded.device,
        progress,
        ins.target_sha,
        state,
    )
    info.update(rows=stats.rows(), steps=stats.steps, mean_tau_bf16=stats.mean_tau)
    return Calibrated(stats, info)


def mix(job: GptqJob, loaded: Loaded, ins: Inputs, cal: Calibrated, ref: Teacher | None, progress: Progress) -> MixPlan:
    """The per-Linear bits and groups of a mixed-precision job (pipeline.mixed_stage); gptq-kl's reference is
    shared with the map's tuned drafters."""
    key = calib_key(job, loaded.drafter, loaded.target, ins.calib_spec, ins.calib_ids, ins.drafter_sha)
    return plan_mix(job, loaded.drafter, loaded.target, cal.stats, ins.calib_ids, key, progress, ref)


def quantize(
    job: GptqJob, loaded: Loaded, ins: Inputs, cal: Calibrated, plan: MixPlan | None, progress: Progress
) -> Quantized:
    """GPTQ (or RTN) of the chosen Linears, in place: the drafter now holds the dequantized weights."""
    quant = job.quant if plan is None else replace(job.quant, bits=plan.base.bits, group_size=plan.base.group_size)
    label = "mixed" if plan is not None else f"{quant.bits}-bit"
    advance = progress(f"quantizing ({quant.method}, {label})", len(ins.candidates))
    model = loaded.drafter.model
    if job.gguf_type is not None:
        outcome = quantize_drafter_kquant(
            model, cal.stats, quant, job.gguf_type, progress=lambda name: advance(), scale_search=job.gguf_scale_search
        )
    else:
        outcome = quantize_drafter(
            model,
            cal.stats,
            quant,
            progress=lambda name: advance(),
            picks=plan.picks if plan else None,
            solve=plan.solve if plan else None,
        )
    return Quantized(outcome, quant, plan, _quant_report(outcome))


def _quant_report(outcome: QuantOutcome, tuning: TuneReport | None = None) -> QuantReport:
    return QuantReport.from_dict(
        {
            "layers": outcome.layers,
            "kept_bf16": outcome.kept,
            "original_bytes": sum(2 * qw.in_features * qw.out_features for qw in outcome.weights.values()),
            "quantized_bytes": None,  # export fills it from the written file
            "seconds": round(outcome.seconds, 3),
            "tuning": tuning.to_dict() if tuning is not None else None,
        }
    )


@dataclass
class Teacher:
    """gptq-kl's reference, taken before quantize changes the weights: the bf16 drafter's output rows on the
    recorded calibration inputs and, with --tune-anchor, every Linear's bf16 weight."""

    rows: list[torch.Tensor]
    weights: dict[str, torch.Tensor]


def teacher(job: GptqJob, loaded: Loaded, cal: Calibrated) -> Teacher:
    assert cal.stats is not None and cal.stats.replay is not None  # calibration keeps the replay for gptq-kl
    model = loaded.drafter.model
    weights = {}
    if job.quant.tune_anchor > 0:
        # in the model's dtype: tune converts each to fp32 once, on its device
        weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return Teacher(teacher_rows(model, cal.stats.replay), weights)


def tune(job: GptqJob, loaded: Loaded, cal: Calibrated, q: Quantized, ref: Teacher, progress: Progress) -> None:
    """gptq-kl: the GPTQ grid's scales (and codes, one step at most) tuned on the drafter's KL to its bf16 self
    (quantize.tune); the drafter, the outcome and the quant report follow."""
    assert cal.stats is not None and cal.stats.replay is not None
    quant, outcome = q.quant, q.outcome
    rows = ref.rows
    step = progress(
        f"tuning ({quant.tune_epochs} passes over the recorded drafter inputs)", quant.tune_epochs * len(rows)
    )
    anchors = {}
    if quant.tune_anchor > 0:
        anchors = {n: (ref.weights[n], cal.stats.for_linear(n).xtx) for n in outcome.weights}
    tuning = tune_scales(
        loaded.drafter.model,
        outcome.weights,
        cal.stats.replay,
        rows,
        loaded.target.model.get_output_embeddings(),  # type: ignore[operator]
        epochs=quant.tune_epochs,
        lr=quant.tune_lr_for(job.gguf_type is not None),
        codes=quant.tune_codes,
        code_travel=quant.tune_code_travel,
        anchors=anchors,
        anchor_weight=quant.tune_anchor,
        position_decay=quant.tune_position_decay,
        norms=quant.tune_norms,
        rows=quant.tune_rows,
        target_weight=quant.tune_target,
        seed=job.seed,
        progress=step,
    )
    for layer in outcome.layers:
        if layer.get("method") == "gptq" and not tuning.kept_gptq_scales:
            layer["method"] = "gptq-kl"
    outcome.seconds += tuning.seconds
    q.report = _quant_report(outcome, tuning)


def record(job: GptqJob, loaded: Loaded, ins: Inputs, cal: Calibrated, q: Quantized) -> Provenance:
    """provenance.json: tool, command, sources and their hashes, calibration, quantization, mix, device."""
    target = loaded.target
    calib_info = dict(cal.info)
    if job.placement is not None:
        placed = device_summary(target.model) or {}
        calib_info["target_placement"] = {
            **job.placement.describe(),
            "resolved": placed.get("map"),
            "weight_bytes": placed.get("weight_bytes"),
            "streamed_bytes": target.streamed,
        }
    return Provenance(
        tool="dflash-quant",
        tool_version=__version__,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        command=portable_command(job.command),
        source_drafter=source_ref(loaded.drafter.source, ins.drafter_sha),
        target=source_ref(target.source, ins.target_sha),
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
                # the tuning settings only where tuning ran
                **{k: v for k, v in asdict(q.quant).items() if q.quant.tuned or not k.startswith("tune_")},
                "skip": list(q.quant.skip),
                "skipped": q.outcome.kept,
                **_grid_fields(job.gguf_type, q.outcome.layers, job.gguf_scale_search),
            }
        ),
        mixed=q.mix.record if q.mix is not None else None,
        device=str(loaded.device),
        dtype=str(loaded.dtype).replace("torch.", ""),
    )


def _grid_fields(gguf_type: str | None, layers: list[dict[str, Any]], scale_search: int = 0) -> dict[str, Any]:
    """A run on a llama.cpp grid records that grid (a mix: its default grid, and bits/weight over all its
    tensors), not the GPTQ v1 defaults it did not use."""
    if gguf_type is None:
        return {}
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


def export(
    tmp: Path, final: Path, job: GptqJob, loaded: Loaded, cal: Calibrated, q: Quantized, provenance: Provenance
) -> None:
    """The weights in the job's format, config, provenance, quant report and memory.json (a llama.cpp grid is
    written as GGUF directly, with no GPTQ v1 step; another format is converted from the GPTQ codes)."""
    drafter, target = loaded.drafter, loaded.target
    if job.gguf_type is not None:
        write_kquant_gguf(
            tmp,
            drafter.model,
            drafter.raw_config,
            drafter.source.path,
            q.outcome,
            job.gguf_type,
            target.source.path,
            provenance,
            q.report,
            cal.stats,
        )
    else:
        export_gptq(
            tmp,
            drafter.model,
            drafter.raw_config,
            q.outcome,
            q.quant,
            provenance,
            q.report,
            q.mix.picks if q.mix else None,
        )
    # memory of the tensors as written (a conversion below restates it for its own files)
    target_name = provenance.target.id if provenance.target is not None else None
    _memory(tmp, final, drafter.source, target_name, target.source.path, loaded.device)
    if job.format != "gptq" and job.gguf_type is None:  # same codes in the engine's layout; parity loads these
        convert_artifact(tmp, tmp, job.format, target=target.source.path, command=job.command)


def _memory(
    artifact: Path, final: Path, source: Source, target_name: str | None, target: Path, device: torch.device
) -> None:
    """memory.json with a 24 GB budget for this target (int4 weights, 8k context, vLLM defaults).

    Measured in the temp dir, recorded under the names the artifact will have (never the temp dir's)."""
    name = portable_path(final)
    budget = embedded_budget(str(target), str(artifact), target_label=target_name, drafter_label=name)
    report = build_memory_report(
        artifact,
        baseline=source.path,
        resident=lambda: measure_resident(artifact, device.type),
        budget_24gb=budget,
        artifact_name=name,
        baseline_name=source_ref(source).id,
    )
    write_memory_json(report, artifact)


def release(loaded: Loaded, q: Quantized) -> None:
    """Once the artifact is written, free the GPU memory the check does not need: the calibrated drafter (the
    check reads both drafters back from files) and the codes (moved to the host). Under a GPU cap with a split
    27B target, these ~6 GB are what the check's batched greedy decode needs."""
    loaded.drafter.model.to("meta")  # type: ignore[arg-type]  # transformers wraps .to(): mypy sees it unbound
    for qw in q.outcome.weights.values():
        for name, value in vars(qw).items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                setattr(qw, name, value.cpu())
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()


def verify(job: GptqJob, loaded: Loaded, ins: Inputs, source: SourceRef, artifact: Path, progress: Progress) -> Parity:
    """The parity gate: the bf16 source against the exported files (pipeline.parity)."""
    assert ins.eval_spec is not None  # verify runs only with --verify, which encodes the parity prompts
    return check_parity(
        job,
        cast(str, source.id),
        artifact,
        loaded.target,
        ins.eval_spec,
        ins.eval_ids,
        loaded.device,
        loaded.dtype,
        progress,
    )


def report(artifact: Path, parity: Parity | None) -> None:
    """parity.json beside the weights (nothing without --verify)."""
    if parity is not None:
        parity.write(artifact)


def card(job: GptqJob, artifact: Path) -> None:
    """The model card (README.md, charts), then manifest.json over every file: the last write of the artifact."""
    if job.write_card:
        write_card(artifact, command=job.command)
    write_manifest(artifact)


def run_stages(job: GptqJob, final: Path, progress: Progress, state: RunState) -> GptqResult:
    """The stages of a checked job whose output `final` is guarded by the caller (pipeline.run.run_gptq)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    progress("loading the drafter and its target", None)  # minutes at the 27B scale: say so before it starts
    loaded = load(job)
    timings["load_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    ins = inputs(job, loaded)
    timings["inputs_s"] = time.perf_counter() - t  # mostly what is left of hashing the weights after loading
    t = time.perf_counter()
    cal = calibrated(job, loaded, ins, progress, state)
    if cal.stats is not None:
        timings["calibrate_s"] = time.perf_counter() - t
    plan = None
    t = time.perf_counter()
    ref = teacher(job, loaded, cal) if job.quant.tuned else None  # of the bf16 drafter: before mix and quantize
    teacher_s = time.perf_counter() - t
    if job.mixed is not None:
        t = time.perf_counter()
        plan = mix(job, loaded, ins, cal, ref, progress)
        timings["mix_s"] = time.perf_counter() - t
    t = time.perf_counter() - teacher_s
    q = quantize(job, loaded, ins, cal, plan, progress)
    if ref is not None:
        tune(job, loaded, cal, q, ref, progress)
    timings["quantize_s"] = time.perf_counter() - t
    provenance = record(job, loaded, ins, cal, q)
    parity = None
    with staging(final, job.overwrite) as tmp:
        t = time.perf_counter()
        progress("writing the quantized drafter", None)  # tens of seconds at the 27B scale: no silent gap
        export(tmp, final, job, loaded, cal, q, provenance)
        timings["export_s"] = time.perf_counter() - t
        if job.verify:
            release(loaded, q)
            t = time.perf_counter()
            assert provenance.source_drafter is not None  # record() always sets it
            parity = verify(job, loaded, ins, provenance.source_drafter, tmp, progress)
            timings["verify_s"] = time.perf_counter() - t
        t = time.perf_counter()
        progress("memory report and model card", None)
        report(tmp, parity)
        card(job, tmp)
        timings["report_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    tq = loaded.target.quantization
    return GptqResult(
        output=job.output,
        passed=parity.passed if parity is not None else None,
        parity=parity.to_dict() if parity is not None else None,
        quant_report=q.report.to_dict(),
        timings=timings,
        reasons=(parity.reasons or []) if parity is not None else [],
        calibration=provenance.calibration.to_dict() if provenance.calibration is not None else None,
        target_quantization=tq.to_dict() if tq is not None else None,
    )
