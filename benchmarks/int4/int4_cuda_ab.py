"""Two builds of our CUDA int4 kernel in one run (issue #16): the working tree's `dflash_quant/kernels/int4_cuda.cu` against
another source of it (OLD, e.g. `git show REV:dflash_quant/kernels/int4_cuda.cu > old.cu`), the shipped configuration of
each, on the drafter's GEMM shapes (Qwen3-8B-DFlash-b16) at 16, 32 and 8 rows. Each shape from a CUDA graph of
back-to-back launches, the builds in alternating order, medians; outputs compared bit for bit; the step total
weights each shape by its count in a step. --rotate: each graph cycles through enough copies of the weight that
none is served from L2, as in a drafter step (without it the small weights stay in L2 between launches).

python benchmarks/int4/int4_cuda_ab.py OLD.cu [--new NEW.cu] [--rotate] --out benchmarks/int4/results/int4_cuda_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_cuda_scaling import SHAPES, graph_us, per_launch_us, random_weights  # noqa: E402
from int4_load_probe import rotate_copies  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.kernels.int4_cuda import build, module  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="the other int4_cuda.cu")
    ap.add_argument("--new", type=Path, help="a third source in place of the working tree's")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rotate", action="store_true", help="cycle through copies of each weight (no L2 reuse)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    builds = {
        "old": build(args.old, "dflash_quant_int4_ab"),
        "new": module() if args.new is None else build(args.new, "dflash_quant_int4_ab"),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "old": str(args.old),
        "new": str(args.new or "the working tree"),
        "rotate": args.rotate,
        "rows": {},
    }
    for rows in (16, 32, 8):
        shapes, step = [], {"old": 0.0, "new": 0.0}
        for name, n, k, count in SHAPES:
            copies = [random_weights(n, k, gen) for _ in range(rotate_copies(n * k // 2) if args.rotate else 1)]
            x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()

            def call(ext, w, x=x):
                return ext.w4a16_mm(x, w.qweight, w.scales, w.zeros, w.counters, 128, w.split, 0)

            w = copies[0]
            same = torch.equal(call(builds["old"], w), call(builds["new"], w))
            times: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(args.repeats):
                for b in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    ext = builds[b]
                    if args.rotate:
                        times[b].append(graph_us([lambda ext=ext, c=c: call(ext, c) for c in copies]))
                    else:
                        times[b].append(per_launch_us(lambda ext=ext, w=w: call(ext, w)))
            med = {b: statistics.median(v) for b, v in times.items()}
            for b in step:
                step[b] += count * med[b]
            shapes.append(
                {"shape": name, "split": w.split, "us": med, "new_over_old": med["new"] / med["old"], "same_bits": same}
            )
            print(
                rows,
                name,
                {b: round(v, 2) for b, v in med.items()},
                "same bits" if same else "DIFFERENT BITS",
                flush=True,
            )
            del copies
            torch.cuda.empty_cache()
        result["rows"][str(rows)] = {"shapes": shapes, "step_us": step, "new_over_old": step["new"] / step["old"]}
        print("rows", rows, "step", {b: round(v, 1) for b, v in step.items()}, round(step["new"] / step["old"], 4))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
