"""The `--int4-kernel` choices (torch-free, so the CLI checks them before loading anything)."""

from __future__ import annotations

from dflash_quant.errors import UsageError

# `auto` takes the first that runs every Linear here. tinygemm before gemlite: the check runs eagerly, and one
# drafter step's GEMMs at 16 rows on an H200 took bf16 0.91 ms, tinygemm 1.35 ms, gemlite 6.55 ms launched
# eagerly (0.69 / 1.30 / 0.93 ms from a CUDA graph; benchmarks/results/int4_gemm_h200_gemlite_tinygemm.json).
KERNEL_ORDER = ("cuda", "triton", "tinygemm", "gemlite")
CHOICES = ("auto", "dequant", *KERNEL_ORDER)


def check_int4_kernel(choice: str) -> None:
    if choice not in CHOICES:
        raise UsageError(f"--int4-kernel must be one of {', '.join(CHOICES)}, got {choice!r}")
