"""Where our CUDA int4 kernel's time goes (issue #16): one GEMM at 16 rows from a CUDA graph of back-to-back
launches, (a) at a fixed grid (4096 outputs, split-K 16: one wave of 512 blocks) with 1..16 chunks of 128 inputs a
block, so that the slope is the time per chunk and the intercept the fixed cost (launch, pipeline fill, split-K
sum); (b) at a fixed weight (4096 x 20480, the drafter's fc) with split-K 1..16; (c) the split-K sum's cost: the same
blocks, chunks and bytes with and without a split (65536 x 128 unsplit against 4096 x 2048 in 16 splits, and so
on), and a launch of a one-element torch kernel for the graph's own cost per node. bf16 (torch.matmul) on the
same shapes in the same run.

python benchmarks/int4/int4_cuda_scaling.py --out benchmarks/int4/results/int4_cuda_scaling.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.kernels.int4_cuda import CudaWeights, matmul  # noqa: E402

ROWS, LAUNCHES, REPLAYS = 16, 20, 15


# (name, out, in, GEMMs of this shape in a step)
SHAPES = [
    ("fc", 4096, 20480, 1),
    ("q", 4096, 4096, 5),
    ("o", 4096, 4096, 5),
    ("kv", 2048, 4096, 5),
    ("gateup", 24576, 4096, 5),
    ("down", 4096, 12288, 5),
]


def graph_us(fns: list) -> float:
    """Median over REPLAYS replays of one CUDA graph calling each of fns once, per call, in microseconds (the first
    three calls made once before capture: builds, allocations)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    return statistics.median(times)


def per_launch_us(fn) -> float:
    """A graph of LAUNCHES back-to-back calls of fn, per call, in microseconds."""
    return graph_us([fn] * LAUNCHES)


def random_weights(n: int, k: int, gen: torch.Generator) -> CudaWeights:
    """A random int4 [n, k] Linear in the kernel's layout, group 128."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device="cuda")
    zeros = torch.randint(1, 16, (k // 128, n), generator=gen, device="cuda")
    scales = (torch.rand(k // 128, n, generator=gen, device="cuda") * 0.02 + 1e-3).to(torch.float16)
    return CudaWeights(codes, zeros, scales, 128)


def measure(k: int, split: int, gen: torch.Generator, n: int = 4096) -> dict:
    w = random_weights(n, k, gen)
    x = torch.randn(ROWS, k, generator=gen, device="cuda").bfloat16()
    bf16 = torch.randn(n, k, generator=gen, device="cuda").bfloat16()
    chunks = -(-(k // 128) // split)
    row = {
        "n": n,
        "k": k,
        "split": split,
        "chunks_per_block": chunks,
        "blocks": -(-n // 128) * -(-(k // 128) // chunks),
        "int4_us": per_launch_us(lambda: matmul(x, w.qweight, w.scales, w.zeros, w.counters, 128, split)),
        "bf16_us": per_launch_us(lambda: x @ bf16.T),
        "int4_mb": (n * k // 2 + w.scales.numel() * 3) / 1e6,
    }
    return row


def fit(rows: list[dict]) -> dict:
    """Least squares int4_us = fixed + per_chunk * chunks_per_block."""
    line = statistics.linear_regression([r["chunks_per_block"] for r in rows], [r["int4_us"] for r in rows])
    return {"fixed_us": line.intercept, "per_chunk_us": line.slope}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [measure(128 * 16 * c, 16, gen) for c in (1, 2, 4, 8, 16)]
    splits = [measure(20480, s, gen) for s in (1, 2, 4, 8, 16)]
    # (n, k, split): pairs with the same blocks, chunks a block and bytes, unsplit first
    pairs = [(65536, 128, 1), (4096, 2048, 16), (32768, 256, 1), (4096, 2048, 8), (16384, 512, 1), (4096, 2048, 4)]
    split_cost = [measure(k, s, gen, n) for n, k, s in pairs]
    one = torch.zeros(1, device="cuda")
    node_us = per_launch_us(lambda: one.add_(1))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": ROWS,
        "fixed_grid": chunks,
        "fixed_grid_fit": fit(chunks),
        "fixed_weight": splits,
        "split_cost": split_cost,
        "one_element_kernel_us": node_us,
    }
    for r in chunks + splits + split_cost:
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    print("fit", result["fixed_grid_fit"], "one-element kernel", round(node_us, 2), "us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
