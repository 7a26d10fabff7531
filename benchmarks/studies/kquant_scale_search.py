"""GPTQ on llama.cpp grids with and without the in-loop sub-block scale search (`gptq_kquant(scale_search=R)`):
the relative output error sqrt(tr(E H E^T) / tr(W H W^T)) of every Linear of the reference drafter under its
calibration Hessians (the development split: the pair's calibration prompts), per tensor and per grid type, for
llama.cpp's per-tensor mixes. In-sample for GPTQ, which minimizes exactly this, unless --eval-calib names the
Hessians of other calibration prompts (quantize on one half, measure on the other); tau is measured separately.

    python benchmarks/studies/kquant_scale_search.py --calib /tmp/llama_cpp_check/calib --radii 0 1 2 3 5 \
        --out benchmarks/studies/results/kquant_scale_search_insample.json
    # fit on one half of the calibration prompts, error measured on the other (the development split):
    head -64 dflash_quant/reference/pair/calibration_prompts.jsonl > calA.jsonl   # tail -n +65 > calB.jsonl
    dflash-quant gptq --format gguf --gguf-type Q3_K_S --no-verify --no-card --calib-prompts calA.jsonl \
        --calib-cache calibA -o outA                                                # likewise B
    python benchmarks/studies/kquant_scale_search.py --calib calibA --eval-calib calibB --radii 0 1 2 3 5 \
        --out benchmarks/studies/results/kquant_scale_search_cv_AB.json             # and B -> A
    python benchmarks/studies/kquant_scale_search.py --cost 1024 2048 --radii 0 2 --out ...cost.json   # solver time
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_quant.calibration.capture import input_group
from dflash_quant.io.gguf_names import gguf_name
from dflash_quant.quantize.kmix import tensor_types
from dflash_quant.quantize.kquant import GRIDS, gptq_kquant, relative_error

PAIR = Path(__file__).resolve().parents[2] / "dflash_quant" / "reference" / "pair"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=Path, help="a gptq --calib-cache folder of the reference pair (required)")
    ap.add_argument(
        "--eval-calib",
        type=Path,
        help="measure the error under this folder's Hessians instead (another half of the calibration prompts)",
    )
    ap.add_argument("--mixes", nargs="*", default=["Q3_K_M", "Q3_K_S", "Q4_K_M", "Q2_K_MIX"])
    ap.add_argument("--radii", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--cost", type=int, nargs=2, metavar=("ROWS", "COLS"), help="only time a random [ROWS, COLS]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cost:
        cost(args.cost[0], args.cost[1], args.radii, args.out)
        return
    if args.calib is None:
        ap.error("--calib is required (unless --cost)")
    cfg = json.loads((PAIR / "drafter" / "config.json").read_text())
    weights = {
        k[: -len(".weight")]: v.float()
        for k, v in load_file(str(PAIR / "drafter" / "model.safetensors")).items()
        if v.dim() == 2 and k != "embed_tokens.weight" and "norm" not in k
    }
    hess = load_file(str(args.calib / "hessians.safetensors"))
    judge = load_file(str(args.eval_calib / "hessians.safetensors")) if args.eval_calib else hess
    calib = json.loads((args.calib / "calibration.json").read_text())
    doc: dict = {"what": __doc__.split("\n\n")[0], "calibration": calib, "mixes": {}}
    if args.eval_calib:
        doc["error_measured_on"] = json.loads((args.eval_calib / "calibration.json").read_text())
    for mix in args.mixes:
        names = {gguf_name(f"{n}.weight"): n for n in weights}
        types = tensor_types(
            mix,
            list(names),
            cfg["num_hidden_layers"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        )
        per: dict = {}
        for radius in args.radii:
            t0 = time.perf_counter()
            rows = {}
            for t, n in names.items():
                group = f"{input_group(n, 'block+context')}.xtx"
                qw = gptq_kquant(weights[n], hess[group].float(), GRIDS[types[t]], scale_search=radius, name=n)
                err = relative_error(weights[n], qw.dequantize(), judge[group].float())
                rows[t] = {"type": types[t], "rel_err": round(err, 5)}
            by_type: dict[str, list[float]] = {}
            for r in rows.values():
                by_type.setdefault(r["type"], []).append(r["rel_err"])
            per[f"radius_{radius}"] = {
                "mean": round(sum(r["rel_err"] for r in rows.values()) / len(rows), 5),
                "mean_by_type": {k: round(sum(v) / len(v), 5) for k, v in sorted(by_type.items())},
                "seconds": round(time.perf_counter() - t0, 2),
                "tensors": rows,
            }
            print(
                f"{mix:9s} radius {radius}: mean {per[f'radius_{radius}']['mean']:.5f} "
                f"by type {per[f'radius_{radius}']['mean_by_type']} ({per[f'radius_{radius}']['seconds']} s)",
                flush=True,
            )
        doc["mixes"][mix] = per
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


def cost(rows: int, cols: int, radii: list[int], out: Path) -> None:
    """Seconds of gptq_kquant per grid and radius on one random weight and Hessian (one thread), as ratios to
    radius 0 measured in the same run."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(rows, cols, generator=g) * 0.02
    X = torch.randn(4 * cols, cols, generator=g)
    H = X.T @ X
    doc: dict = {"what": cost.__doc__, "shape": [rows, cols], "threads": 1, "grids": {}}
    for kind in ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"):
        secs = {}
        for radius in radii:
            t0 = time.perf_counter()
            gptq_kquant(W, H, GRIDS[kind], scale_search=radius)
            secs[radius] = round(time.perf_counter() - t0, 2)
        doc["grids"][kind] = {
            "seconds": {f"radius_{r}": v for r, v in secs.items()},
            "ratio_to_radius_0": {f"radius_{r}": round(v / secs[radii[0]], 2) for r, v in secs.items()},
        }
        print(kind, doc["grids"][kind], flush=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
