"""Where the int4 kernel's time goes (issue #16, development probe): builds of `dflash_quant/kernels/int4_cuda.cu` with one
stage left out each (no loads after the pipeline's fill, no split-K sum, no multiply, no zero subtraction, no MMA),
each timed on the drafter's GEMM shapes at 16 rows as the kernel variants asked for (`--variants 0,8`: the default
and variant 8), next to the unchanged build and bf16, in one run. A part left out of one kernel leaves the other
as it is. The builds that leave something out compute wrong results: they exist only to be timed. Each timing is a
CUDA graph cycling through enough copies of the weight that nothing is served from L2.

python benchmarks/int4/int4_cuda_parts.py --out benchmarks/int4/results/int4_cuda_parts.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_cuda_scaling import SHAPES, graph_us, random_weights  # noqa: E402
from int4_load_probe import rotate_copies  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.kernels import int4_cuda  # noqa: E402

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
    "bulk_no_multiply": [
        (
            "        tile.multiply(c, reinterpret_cast<const __nv_bfloat16*>(st + St::CODES + St::ZS) + 128 * ci, St::XROW / 2,\n"
            "                      group_end, lane);",
            "        tile.acc[0][0][0] += __int_as_float(c.w[0].x ^ c.w[1].y ^ c.z[0][0] ^ c.s[1][0]);",
        )
    ],
    "no_mma": [
        (
            "        for (int m = 0; m < MT; ++m) mma(part[m][i], a[m], b0, b1);",
            "        for (int m = 0; m < MT; ++m) part[m][i][0] += __int_as_float(a[m][0] ^ a[m][3] ^ b0 ^ b1);",
        )
    ],
}


# probes of the split-K sum: a build that keeps the sum's code but does not run it, one that
# counts in without ordering, one whose blocks store their partials and exit (no count-in), one that counts in but
# whose last block adds nothing (wrong results, all four: timing only). Discarding the dead partials is
# development variant 6 (`--variants 0,6`), not an edit.
PROBES: dict[str, list[tuple[str, str]]] = {
    "sum_not_run": [("  if (split == 1) {", "  if (split == 1 || M < 1000) {")],
    "sum_relaxed": [("atom.add.acq_rel.gpu.s32", "atom.add.relaxed.gpu.s32")],
    "sum_stores_only": [
        ("  // count in: the barrier orders", "  if (M < 1000) return;  // probe: no count-in\n  // the barrier orders")
    ],
    "sum_no_last": [("  if (!last) return;", "  if (!last || M < 1000) return;")],
}


def parts_for(source: str) -> dict[str, list[tuple[str, str]]]:
    """The parts that this kernel source has: the bulk-copy kernel's only where it is in the source."""
    bulk = "w4a16_bulk_kernel" in source
    return {name: edits for name, edits in PARTS.items() if bulk or not name.startswith("bulk_")}


def variant_source(edits: list[tuple[str, str]], folder: Path, name: str) -> Path:
    text = int4_cuda.SOURCE.read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: {old!r} occurs {text.count(old)} times in {int4_cuda.SOURCE.name}")
        text = text.replace(old, new)
    path = folder / f"int4_cuda_{name}.cu"
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="0", help="kernel variants to time each build as, e.g. 0,8")
    ap.add_argument("--parts", help=f"builds to time (default: every part left out); also {', '.join(PROBES)}")
    args = ap.parse_args()
    variants = [int(v) for v in args.variants.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="int4_parts_"))
    known = parts_for(int4_cuda.SOURCE.read_text()) | PROBES
    names = args.parts.split(",") if args.parts else list(parts_for(int4_cuda.SOURCE.read_text()))
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown parts {unknown}: choose from {', '.join(known)}")
    sources = {"shipped": int4_cuda.SOURCE} | {name: variant_source(known[name], folder, name) for name in names}
    with ThreadPoolExecutor(len(sources)) as pool:  # nvcc runs in subprocesses: the builds overlap
        builds = dict(
            zip(
                sources,
                pool.map(lambda src: int4_cuda.build(src, "dflash_quant_int4_part"), sources.values()),
                strict=True,
            )
        )
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    rows: list[dict] = []
    for name, n, k, _count in SHAPES:
        x = torch.randn(ROWS, k, generator=gen, device=dev).bfloat16()
        w_bytes = n * k // 2
        cw = [random_weights(n, k, gen) for _ in range(rotate_copies(w_bytes))]
        bf = [torch.randn(n, k, generator=gen, device=dev).bfloat16() for _ in range(rotate_copies(2 * n * k))]
        timings = {"bf16": graph_us([lambda b=b, x=x: x @ b.T for b in bf])}
        splits = {v: int4_cuda.config(n, k, 128, dev, v) for v in variants}
        for label, ext in builds.items():
            for v in variants:  # the same build's kernels: a part left out of one leaves the other as it is
                timings[f"{label} v{v}"] = graph_us(
                    [
                        lambda c=c, e=ext, x=x, v=v, sp=splits[v]: e.w4a16_mm(
                            x, c.qweight, c.scales, c.zeros, c.counters, 128, sp, v
                        )
                        for c in cw
                    ]
                )
        rows.append({"shape": name, "n": n, "k": k, "splits": splits, "us": timings})
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
