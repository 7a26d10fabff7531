"""The int4 runtime: how a 4-bit GPTQ drafter runs on CUDA (our CUDA and Triton kernels, tinygemm, gemlite)."""
