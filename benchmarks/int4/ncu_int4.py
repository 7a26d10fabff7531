"""Our CUDA int4 kernel under Nsight Compute (issue #16): three drafter-step shapes at 16 rows, each launched
three times to warm up and once more to be profiled.

ncu --clock-control none -k regex:w4a16 --launch-skip 9 --launch-count 3 --section SpeedOfLight ... \
    python benchmarks/int4/ncu_int4.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_quant.kernels.int4_cuda import CudaWeights, matmul  # noqa: E402

SHAPES = [("fc", 4096, 20480), ("gateup", 24576, 4096), ("q", 4096, 4096)]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for name, n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device="cuda")
        zeros = torch.randint(1, 16, (k // 128, n), generator=gen, device="cuda")
        scales = (torch.rand(k // 128, n, generator=gen, device="cuda") * 0.02 + 1e-3).to(torch.float16)
        layers.append((name, CudaWeights(codes, zeros, scales, 128), torch.randn(16, k, device="cuda").bfloat16()))
    for _ in range(4):  # three warm-ups, then the profiled launches
        for _name, w, x in layers:
            matmul(x, w.qweight, w.scales, w.zeros, w.counters, 128, w.split)
    torch.cuda.synchronize()
    for name, w, _ in layers:
        print(name, "split:", w.split)


if __name__ == "__main__":
    main()
