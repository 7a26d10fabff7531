"""Training of the shipped reference pairs (dflash_quant/reference/pair and dflash2_pair), from a source checkout:

python -m scripts.reference_pair.train --out DIR [--pair dflash|dflash2] [--device cuda] [--corpus DIR] [--smoke]
"""
