"""The `gptq` job as one typed record, checked once (check_job) before any path is touched or anything heavy
loads. Torch-free: the CLI builds and checks a job at start-up speed; run_gptq (pipeline.run) runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_quant.errors import UsageError, check_count, check_tolerance
from dflash_quant.kernels.int4_choice import check_int4_kernel
from dflash_quant.memory.gpus import resolve_gpu
from dflash_quant.models.placement import Placement, check_hessian_device
from dflash_quant.pipeline.preflight import KV_MODES
from dflash_quant.quantize.settings import QuantSettings

if TYPE_CHECKING:  # built by the caller; their modules load torch
    from dflash_quant.calibration.checkpoint import Kept
    from dflash_quant.quantize.mixed_plan import MixedGoal
    from dflash_quant.speculative.lookup import LookupSettings

Progress = Callable[[str, int | None], Callable[[], None]]  # (stage label, total) -> advance()


def no_progress(label: str, total: int | None) -> Callable[[], None]:
    return lambda: None


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
    # calibration and check: the target's greedy continuation decoded once in batches (speculative.teacher)
    teacher_forced: bool = False
    write_card: bool = True
    command: list[str] = field(default_factory=list)
    format: str = "gptq"  # or compressed-tensors | gguf | mlx: converted from the GPTQ codes at export
    lookup: LookupSettings | None = None  # parity check: also run both drafters with the lookup proposer
    int4_kernel: str = "dequant"  # parity check: how a 4-bit drafter runs on CUDA (dflash_quant.kernels.int4_linear)
    gguf_type: str | None = (
        None  # a pure llama.cpp type or a mix (kmix.MIXES): GPTQ directly on its grids (format gguf)
    )
    gguf_scale_search: int = 2  # with gguf_type: +- radius of the in-loop sub-block scale/min search (0: off)
    placement: Placement | None = None  # the target split by --device-map / --max-memory (models.placement)
    hessian_device: str | None = None  # where the fp32 Hessians accumulate (default: the drafter's device)
    # bytes this run may hold on its GPU (a card shared with a server, a smaller card emulated): the allocator is
    # capped there and the GPTQ solve budgets within it
    gpu_memory_limit: int | None = None
    calib_checkpoint_every: int = 16  # prompts between calibration checkpoints (0: none)
    mixed: MixedGoal | None = None  # per-Linear bits chosen by a search (--max-tau-loss, --max-bytes, --fit)


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


@dataclass
class RunState:
    """What a running job leaves for its caller besides the artifact, readable after an interruption."""

    kept_checkpoint: Kept | None = None  # an unfinished calibration's checkpoint on disk (a rerun resumes it)


def check_job(job: GptqJob) -> GptqJob:
    """Every check of a job's settings, in one place, before its output is touched or anything loads (the checks
    that need the models, such as llama.cpp's pairing, run once they are loaded). Returns the job with its
    quantization settings normalized; a one-line UsageError names the first problem."""
    check_count(job.calib_num_prompts, "--num-prompts")
    check_count(job.eval_num_prompts, "--eval-num-prompts")
    check_tolerance(job.tolerance)
    if job.kv_hessian not in KV_MODES:
        raise UsageError(f"--kv-hessian must be one of {', '.join(KV_MODES)}, got {job.kv_hessian!r}")
    check_count(job.check_batch, "--check-batch")
    check_count(job.calib_batch, "--calib-batch")
    check_int4_kernel(job.int4_kernel)
    check_hessian_device(job.hessian_device)
    if job.gpu_memory_limit is not None and str(job.device) in ("cpu", "mps"):
        raise UsageError(f"--gpu-memory-limit caps a GPU; use it with --device cuda[:N], not {job.device!r}")
    if job.mixed is not None:
        job.mixed.check()
        if job.mixed.fit_gpu is not None:
            resolve_gpu(job.mixed.fit_gpu)
    if job.lookup is not None:
        job.lookup.check()
        if job.teacher_forced:
            raise UsageError(
                "--lookup needs the target to verify blocks in the loop; drop --teacher-forced or --lookup"
            )
    if job.teacher_forced and job.full_baseline:
        raise UsageError("--full-baseline decodes the target in the loop; drop --teacher-forced or --full-baseline")
    quant = job.quant.normalized()
    quant.check()
    if quant.tuned:  # the step size this run tunes with, recorded as such in provenance
        quant = replace(quant, tune_lr=quant.tune_lr_for(job.gguf_type is not None))
    if job.gguf_type is not None:
        from dflash_quant.quantize.kquant import grid_for  # torch: only a --gguf-type job loads it here

        grid_for(job.gguf_type)
        if not 0 <= job.gguf_scale_search <= 8:
            raise UsageError(f"--gguf-scale-search must be 0..8 (0: off), got {job.gguf_scale_search}")
        if job.format != "gguf":
            raise UsageError(f"--gguf-type {job.gguf_type} writes GGUF; add --format gguf")
    if job.mixed is not None:
        if not quant.calibrated or quant.sequential or job.gguf_type is not None:
            # gptq-kl is allowed: the search picks each Linear's grid from plain GPTQ, the tuning then runs on the mix
            raise UsageError(
                "the mixed-precision search (--max-tau-loss/--max-bytes/--max-bits-per-weight/--fit) runs GPTQ from the "
                "calibration Hessians; drop --method rtn, --sequential and --gguf-type"
            )
        if job.format in ("gguf", "mlx"):
            raise UsageError(
                f"--format {job.format} holds one bit width for all Linears, not a per-Linear mix; use --format gptq "
                "or compressed-tensors, or a uniform --bits"
            )
    if job.format == "gguf" and (quant.quantize_conv or quant.quantize_selector):
        raise UsageError(
            "--format gguf keeps DFlash2's convolution and selector projections BF16 (as llama.cpp's converter writes "
            "them); drop --quantize-conv / --quantize-selector"
        )
    if job.gguf_type is None and job.format != "gptq":
        from dflash_quant.export.convert import format_problem  # torch: only a job for another format loads it

        permuted = quant.desc_act and not quant.static_groups
        if problem := format_problem(job.format, quant.bits, quant.group_size, quant.sym, permuted):
            raise UsageError(problem)
    return replace(job, quant=quant)
