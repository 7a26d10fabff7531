"""Weight quantization: the GPTQ v1 grid, round-to-nearest, GPTQ (plain, batched, shared inputs), llama.cpp's
grids (k-quants), and the per-Linear mixed-precision search. Algorithms and grids only: no file formats."""
