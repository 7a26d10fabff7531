"""Where the shipped int4 kernel's time goes (issue #16, development probe): builds of `dflash_quant/int4_cuda.cu`
with one stage left out each (no loads after the pipeline's fill, no split-K sum, no multiply, no zero subtraction,
no MMA), timed on the drafter's GEMM shapes at 16 rows next to the shipped build and bf16, in one run. The builds
that leave something out compute wrong results: they exist only to be timed. Each timing is a CUDA graph cycling
through enough copies of the weight that nothing is served from L2.

python benchmarks/int4_cuda_parts.py --out results/int4_cuda_dev/int4_cuda_parts.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_cuda_ab import SHAPES  # noqa: E402
from int4_cuda_scaling import random_weights  # noqa: E402
from int4_load_probe import ROTATE_BYTES, graph_us  # noqa: E402

from dflash_quant.artifact.files import write_json_atomic  # noqa: E402
from dflash_quant.int4_cuda import SOURCE  # noqa: E402

ROWS = 16
# name -> [(text in the shipped source, its replacement)]: each must occur exactly once
PARTS: dict[str, list[tuple[str, str]]] = {
    "no_loads": [("    fetch_next();     // chunk k + S - 1", "    commit();  // chunk k + S - 1")],
    "no_sum": [("  if (split == 1) {", "  if (true) {")],
    "no_loads_no_sum": [
        ("    fetch_next();     // chunk k + S - 1", "    commit();  // chunk k + S - 1"),
        ("  if (split == 1) {", "  if (true) {"),
    ],
    "no_multiply": [
        (
            "    tile.multiply(c, reinterpret_cast<const __nv_bfloat16*>(sl), SlotT::ROW, group_end, lane);",
            "    tile.acc[0][0][0] += __int_as_float(c.w[0].x ^ c.w[1].y ^ c.z[0][0] ^ c.s[1][0]);",
        )
    ],
    "no_zero": [
        ("minus_zero(code_pair(bits), neg_zero[i])", "code_pair(bits)"),
        ("minus_zero(code_pair(bits >> 4), neg_zero[i])", "code_pair(bits >> 4)"),
    ],
    "no_mma": [
        (
            "        for (int m = 0; m < MT; ++m) mma(part[m][i], a[m], b0, b1);",
            "        for (int m = 0; m < MT; ++m) part[m][i][0] += __int_as_float(a[m][0] ^ a[m][3] ^ b0 ^ b1);",
        )
    ],
}


def variant_source(edits: list[tuple[str, str]], folder: Path, name: str) -> Path:
    text = SOURCE.read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: {old!r} occurs {text.count(old)} times in {SOURCE.name}")
        text = text.replace(old, new)
    path = folder / f"int4_cuda_{name}.cu"
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="int4_parts_"))
    sources = {"shipped": SOURCE} | {name: variant_source(e, folder, name) for name, e in PARTS.items()}

    def build(item: tuple[str, Path]):
        name, src = item
        return name, load(
            name=f"dflash_quant_int4_part_{name}", sources=[str(src)], extra_cflags=["-O3"], extra_cuda_cflags=["-O3"]
        )

    with ThreadPoolExecutor(len(sources)) as pool:  # nvcc runs in subprocesses: the builds overlap
        builds = dict(pool.map(build, sources.items()))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    rows: list[dict] = []
    for name, n, k, _count in SHAPES:
        x = torch.randn(ROWS, k, generator=gen, device=dev).bfloat16()
        w_bytes = n * k // 2
        cw = [random_weights(n, k, gen) for _ in range(max(2, -(-ROTATE_BYTES // w_bytes)))]
        bf = [
            torch.randn(n, k, generator=gen, device=dev).bfloat16()
            for _ in range(max(2, -(-ROTATE_BYTES // (2 * n * k))))
        ]
        timings = {"bf16": graph_us([lambda b=b, x=x: x @ b.T for b in bf])}
        for label, ext in builds.items():
            timings[label] = graph_us(
                [
                    lambda c=c, e=ext, x=x: e.w4a16_mm(x, c.qweight, c.scales, c.zeros, c.counters, 128, c.split, 0)
                    for c in cw
                ]
            )
        rows.append({"shape": name, "n": n, "k": k, "split": cw[0].split, "us": timings})
        print(name, {key: round(v, 2) for key, v in timings.items()}, flush=True)
        del cw, bf
        torch.cuda.empty_cache()
    totals = {
        key: round(sum(r["us"][key] * c for r, (_n, _o, _i, c) in zip(rows, SHAPES, strict=True)), 1)
        for key in rows[0]["us"]
    }
    write_json_atomic(
        args.out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "step_us": totals}
    )
    print("step-weighted us:", totals)


if __name__ == "__main__":
    main()
