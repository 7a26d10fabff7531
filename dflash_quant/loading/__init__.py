"""Load drafters (bf16 or our quantized artifacts, any format) and targets (dense or packed), and pair them."""

from dflash_quant.loading.drafter import LoadedDrafter, load_drafter
from dflash_quant.loading.target import LoadedTarget, load_target

__all__ = ["LoadedDrafter", "LoadedTarget", "load_drafter", "load_target"]
