"""Load drafters (bf16 or our quantized artifacts, any format) and targets (dense or packed), and pair them."""

from dflash_quant.loading.drafter import LoadedDrafter, LoadedTarget, load_drafter, load_target

__all__ = ["LoadedDrafter", "LoadedTarget", "load_drafter", "load_target"]
