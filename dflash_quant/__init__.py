"""dflash-quant: GPTQ for DFlash block drafters, calibrated on the drafter's own inputs."""

__version__ = "0.1.0"
