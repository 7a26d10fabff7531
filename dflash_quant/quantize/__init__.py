"""Weight quantization: the GPTQ v1 grid, round-to-nearest, and GPTQ."""

from dflash_quant.quantize.gptq import (
    GPTQFallbackWarning,
    HessianAccumulator,
    gptq_quantize,
    relative_output_error,
)
from dflash_quant.quantize.grid import QuantizedWeight, QuantSpec, find_params, group_params
from dflash_quant.quantize.rtn import rtn_quantize

__all__ = [
    "GPTQFallbackWarning",
    "HessianAccumulator",
    "QuantSpec",
    "QuantizedWeight",
    "find_params",
    "group_params",
    "gptq_quantize",
    "relative_output_error",
    "rtn_quantize",
]
