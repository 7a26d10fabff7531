"""How many prompts a batched decode takes as rows: calibration's capture and the parity check."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_quant.calibration.capture import capture_unbatchable
from dflash_quant.loading.drafter import LoadedDrafter
from dflash_quant.loading.target import LoadedTarget
from dflash_quant.memory.calibration import predict_calibration
from dflash_quant.memory.kv import parse_shape
from dflash_quant.models.gpu import gpu_room
from dflash_quant.pipeline.job import GptqJob

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
    return config_row_bytes(target, drafter.raw_config, next(drafter.model.parameters()).dtype, prompts, max_new_tokens)


def config_row_bytes(
    target, raw_config: dict, dtype: torch.dtype, prompts: list[list[int]], max_new_tokens: int
) -> int:
    """row_bytes from the drafter's config.json alone (no weights loaded)."""
    dtype_name = str(dtype).replace("torch.", "")
    t_shape, d_shape = parse_shape(target.source.path), parse_shape(raw_config)
    longest = max((len(p) for p in prompts), default=1)

    def peak(rows: int) -> int:
        return predict_calibration(t_shape, 0, d_shape, 0, longest, max_new_tokens, dtype=dtype_name, rows=rows).peak

    return peak(2) - peak(1)


def default_batch(requested: int | None, device: torch.device, per_row_bytes: Callable[[], int] | None = None) -> int:
    """--check-batch / --calib-batch when given, else CPU_BATCH on CPU and, on CUDA, GPU_BATCH capped by memory."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return CPU_BATCH
    if device.type != "cuda" or per_row_bytes is None:
        return 1
    return rows_that_fit(GPU_BATCH, per_row_bytes(), gpu_room(device))  # under --gpu-memory-limit: within its cap


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


def calib_rows(job: GptqJob, drafter: LoadedDrafter, target: LoadedTarget, prompts: list[list[int]]) -> int:
    """Prompts capture decodes as rows of one batch: --calib-batch (default by device), 1 where it cannot."""
    device = next(drafter.model.parameters()).device
    rows = default_batch(job.calib_batch, device, lambda: row_bytes(target, drafter, prompts, job.calib_max_new_tokens))
    if job.teacher_forced:  # the target's greedy decode takes any pair's prompts as rows
        return max(1, min(rows, len(prompts)))
    if rows > 1 and (job.quant.sequential or capture_unbatchable(drafter.model, target.model) is not None):
        return 1  # sequential GPTQ replays per-prompt drafter calls; other pairs decode one by one
    return max(1, min(rows, len(prompts)))
