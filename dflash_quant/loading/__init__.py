"""Load drafters (bf16 or our quantized artifacts, any format: drafter.py) and targets (dense or packed:
target.py, target_quant.py), and pair them for a run (runtime.py)."""
