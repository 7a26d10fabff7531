"""How fast the drafter's int4 GEMMs could pull their bytes in (issue #16, development probe): loads only, no
MMAs (`int4_load_probe.cu`), the shipped kernel's cp.async pieces against bulk copies by a producer warp, next to
the shipped kernel and bf16 (cuBLAS) on the same shapes, grids and split-K, in one run. Each timing is a CUDA
graph cycling through enough copies of the weight that nothing is served from L2.

python benchmarks/int4/int4_load_probe.py --out benchmarks/int4/results/int4_load_probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_cuda_scaling import SHAPES, graph_us, random_weights  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.kernels.int4_cuda import module  # noqa: E402

ROWS = 16
CHUNK_BYTES = 8192 + 384
ROTATE_BYTES = 400 << 20  # copies of each weight cycled per graph: several times the 60 MB of L2


def rotate_copies(weight_bytes: int) -> int:
    """Copies of a weight of this size that a graph cycles through so that none is served from L2."""
    return max(2, -(-ROTATE_BYTES // weight_bytes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load

    probe = load(
        name="dflash_quant_int4_load_probe",
        sources=[str(Path(__file__).with_name("int4_load_probe.cu"))],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
    )
    ext = module()
    from dflash_quant.kernels import int4_cuda

    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    variants: list[tuple[str, str, tuple[int, ...]]] = [
        ("cpasync S3", "cpasync", (3,)),
        ("cpasync S4", "cpasync", (4,)),
    ]
    variants += [
        (f"bulk S{s} x{c}", "bulk", (s, c))
        for s, c in [(2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (2, 2), (3, 2), (4, 2), (2, 4), (3, 4)]
    ]
    rows = []
    for name, n, k, _count in SHAPES:
        kt = k // 128
        w_bytes = (n // 128) * kt * CHUNK_BYTES
        copies = rotate_copies(w_bytes)
        split = int4_cuda.config(n, k, 128, dev)
        x = torch.randn(ROWS, k, generator=gen, device=dev).bfloat16()
        row: dict = {"shape": name, "n": n, "k": k, "split": split, "copies": copies, "int4_bytes": w_bytes}
        out = torch.empty((n // 128) * kt * 256, dtype=torch.int32, device=dev)
        ws = [torch.randint(0, 255, (w_bytes,), generator=gen, dtype=torch.uint8, device=dev) for _ in range(copies)]
        bf = [torch.randn(n, k, generator=gen, device=dev).bfloat16() for _ in range(rotate_copies(n * k * 2))]
        cw = [random_weights(n, k, gen) for _ in range(copies)]
        timings: dict[str, float] = {}
        timings["bf16"] = graph_us([lambda b=b, x=x: x @ b.T for b in bf])
        timings["shipped"] = graph_us(
            [lambda c=c, x=x: ext.w4a16_mm(x, c.qweight, c.scales, c.zeros, c.counters, 128, c.split, 0) for c in cw]
        )
        for label, fn, extra in variants:
            for sp_label, sp in (("", split), (" half-split", max(1, split // 2))):
                f = getattr(probe, fn)
                calls = [lambda w=w, a=(x, n, sp, out, *extra), f=f: f(w, *a) for w in ws]
                timings[label + sp_label] = graph_us(calls)
        row["us"] = timings
        row["tb_per_s"] = {key: round(w_bytes / us / 1e6, 3) for key, us in timings.items() if key != "bf16"}
        row["tb_per_s"]["bf16"] = round(n * k * 2 / timings["bf16"] / 1e6, 3)
        rows.append(row)
        del ws, bf, cw
        torch.cuda.empty_cache()
        print(name, {key: round(v, 2) for key, v in timings.items()}, flush=True)
    write_json_atomic(args.out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})
    print("step-weighted us (shape x count):")
    keys = rows[0]["us"].keys()
    for key in keys:
        total = sum(r["us"][key] * c for r, (_n, _o, _i, c) in zip(rows, SHAPES, strict=True))
        print(f"  {key:28s} {total:8.1f}")


if __name__ == "__main__":
    main()
