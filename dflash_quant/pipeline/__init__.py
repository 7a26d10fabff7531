"""The `gptq` job: load -> calibrate -> quantize -> export -> verify -> report -> card."""

from dflash_quant.pipeline.gptq import GptqJob, GptqResult, run_gptq

__all__ = ["GptqJob", "GptqResult", "run_gptq"]
