"""How to quantize one Linear on the GPTQ v1 grid: bits, group width, symmetric or not (torch-free: the CLI checks
settings with it before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_quant.errors import UsageError

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: bits per weight, input columns per group (-1: one group per row), symmetric grid."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    v1_zeros: bool = True

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise UsageError(f"bits={self.bits} is not supported; use one of {list(SUPPORTED_BITS)}")
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size <= 0):
            raise UsageError(
                f"group_size={self.group_size!r} is invalid; use -1 (per row) or a positive width like 128"
            )

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_width(self, in_features: int, name: str = "") -> int:
        """Columns per group for a layer of this input width; rejects sizes that do not divide it."""
        if self.group_size == -1:
            return in_features
        if in_features % self.group_size:
            valid = [g for g in (16, 32, 64, 128, 256, 512, 1024) if in_features % g == 0]
            where = f"layer {name!r}" if name else "the layer"
            raise UsageError(
                f"group_size={self.group_size} does not divide the input width {in_features} of {where}; "
                f"use -1 or one of {valid}"
            )
        return self.group_size

    def n_groups(self, in_features: int, name: str = "") -> int:
        return in_features // self.group_width(in_features, name)
