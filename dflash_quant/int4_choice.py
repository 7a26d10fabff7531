"""The `--int4-kernel` choices (torch-free, so the CLI checks them before loading anything)."""

from __future__ import annotations

from dflash_quant.errors import UsageError

KERNEL_ORDER = ("triton", "gemlite", "tinygemm")  # `auto` takes the first that runs every Linear here
CHOICES = ("auto", "dequant", *KERNEL_ORDER)


def check_int4_kernel(choice: str) -> None:
    if choice not in CHOICES:
        raise UsageError(f"--int4-kernel must be one of {', '.join(CHOICES)}, got {choice!r}")
