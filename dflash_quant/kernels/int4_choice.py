"""The `--int4-kernel` choices (torch-free, so the CLI checks them before loading anything)."""

from __future__ import annotations

from dflash_quant.errors import UsageError

# `auto` takes the first that runs every Linear here, fastest first: one Qwen3-8B-DFlash-b16 step's GEMMs at 16
# rows on an H200, eager (CUDA graph), bf16 0.86 (0.68) ms, cuda 0.63 (0.47), triton 1.35 (0.63)
# (benchmarks/results/int4_gemm_h200_cuda_final.json); in an earlier run bf16 0.91 (0.69), tinygemm 1.35 (1.30),
# gemlite 6.55 (0.93) (int4_gemm_h200_gemlite_tinygemm.json): the check runs eagerly, so tinygemm before gemlite.
KERNEL_ORDER = ("cuda", "triton", "tinygemm", "gemlite")
CHOICES = ("auto", "dequant", *KERNEL_ORDER)


def check_int4_kernel(choice: str) -> None:
    if choice not in CHOICES:
        raise UsageError(f"--int4-kernel must be one of {', '.join(CHOICES)}, got {choice!r}")
