"""`gptq` end to end: the job checked once, its output guarded once (lock held, inputs never overwritten, a temp
dir published atomically), then the stages (pipeline.stages). Torch loads only once both have passed."""

from __future__ import annotations

from dflash_quant.pipeline.job import GptqJob, GptqResult, Progress, RunState, check_job, no_progress
from dflash_quant.pipeline.preflight import guard_run


def run_gptq(job: GptqJob, progress: Progress = no_progress, state: RunState | None = None) -> GptqResult:
    """Quantize job.drafter and write the artifact to job.output; `state` (optional) is kept up to date for a
    caller that reports an interruption."""
    job = check_job(job)
    specs = (job.calib_prompts, job.eval_prompts)
    with guard_run(
        job.output, job.overwrite, job.drafter, job.target, specs, job.calib_cache, job.check_cache
    ) as final:
        from dflash_quant.pipeline.stages import run_stages  # torch: refusals above come before it loads

        return run_stages(job, final, progress, state if state is not None else RunState())
