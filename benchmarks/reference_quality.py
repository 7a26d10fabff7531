"""Acceptance of quantized reference drafters: method x bits x recipe, against the bf16 drafter, same prompts.

Calibrates once (the bf16 drafter speculating on the pair's calibration prompts), then quantizes fresh
copies of the drafter per setting and runs the greedy speculative check on the held-out prompts. Every
row shares the same target-only and bf16 runs. CPU, fp32 (exact and reproducible):

    .venv/bin/python benchmarks/reference_quality.py --out benchmarks/results/reference_quality.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from dflash_quant.calibration.capture import capture
from dflash_quant.loading.runtime import encode_prompts, load_pair, resolve_device, stop_tokens
from dflash_quant.quantize.drafter import quantize_drafter
from dflash_quant.quantize.settings import QuantSettings
from dflash_quant.speculative.verify import CheckSettings, baseline_runs, spec_runs, summarize

# Every recipe spells out act-order and the k/v Hessian rows, so rows stay comparable when defaults change.
GRID = {
    "rtn": dict(method="rtn"),
    "gptq": dict(desc_act=False, kv="block"),
    "gptq desc_act": dict(desc_act=True, kv="block"),
    "gptq desc_act+static": dict(desc_act=True, static_groups=True, kv="block"),
    "gptq sequential": dict(desc_act=False, sequential=True, kv="block"),
    "gptq block+context": dict(desc_act=False, kv="block+context"),  # the `gptq` defaults
    "gptq desc_act block+context": dict(desc_act=True, kv="block+context"),
    "gptq desc_act sequential block+context": dict(desc_act=True, sequential=True, kv="block+context"),
}


def packed_bytes(outcome) -> tuple[int, int]:
    q = sum(
        qw.out_features * qw.in_features * qw.spec.bits // 8
        + qw.n_groups * qw.out_features * (2 + qw.spec.bits / 8)
        + 4 * qw.in_features
        for qw in outcome.weights.values()
    )
    b = sum(2 * qw.out_features * qw.in_features for qw in outcome.weights.values())
    return int(q), b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--recipes", default=",".join(GRID))
    ap.add_argument("--calib-new-tokens", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    device = resolve_device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    drafter, target = load_pair("reference", None, device, dtype)
    stops = stop_tokens(target)
    calib = encode_prompts(target, "reference:calib", None, True)
    heldout = encode_prompts(target, "reference:heldout", args.eval_prompts, True)
    pristine = copy.deepcopy(drafter.model)
    stats = {}
    t = time.perf_counter()
    for kv in ("block", "block+context"):
        stats[kv] = capture(drafter.model, target.model, calib, args.calib_new_tokens, kv, stops, keep_replay=True)
    calib_s = time.perf_counter() - t
    block = drafter.config.block_size
    settings = CheckSettings(args.eval_new_tokens, 0.0, block, 0, stops)
    ref = baseline_runs(target.model, heldout, settings)
    base = summarize("bf16", spec_runs(pristine, target.model, heldout, settings), ref, settings, block)
    rows = [
        {
            "method": "bf16",
            "bits": 16,
            "tau": base["tau"],
            "ratio": 1.0,
            "lossless": base["lossless"],
            "per_position_acceptance": base["per_position_acceptance"],
            "linear_bytes": None,
        }
    ]
    print(
        f"bf16: tau {base['tau']:.3f}  ({len(heldout)} held-out prompts x {args.eval_new_tokens} tokens)",
        file=sys.stderr,
    )
    for bits in [int(b) for b in args.bits.split(",")]:
        for name in args.recipes.split(","):
            opts = dict(GRID[name])
            kv = opts.pop("kv", "block")
            qs = QuantSettings(bits=bits, group_size=args.group_size, **opts)
            model = copy.deepcopy(pristine)
            outcome = quantize_drafter(model, stats[kv] if qs.method == "gptq" else None, qs)
            s = summarize(name, spec_runs(model, target.model, heldout, settings), ref, settings, block)
            qb, bb = packed_bytes(outcome)
            err = [layer["rel_output_error"] for layer in outcome.layers if layer["rel_output_error"] is not None]
            rows.append(
                {
                    "method": name,
                    "bits": bits,
                    "tau": s["tau"],
                    "ratio": round(s["tau"] / base["tau"], 4),
                    "lossless": s["lossless"],
                    "per_position_acceptance": s["per_position_acceptance"],
                    "linear_bytes": qb,
                    "linear_bf16_bytes": bb,
                    "mean_rel_output_error": round(sum(err) / len(err), 5) if err else None,
                }
            )
            print(
                f"{bits}-bit {name:24s} tau {s['tau']:.3f} ratio {s['tau'] / base['tau']:.4f} lossless {s['lossless']}",
                file=sys.stderr,
            )
    result = {
        "pair": "reference",
        "group_size": args.group_size,
        "calibration": {"prompts": len(calib), "new_tokens": args.calib_new_tokens, "seconds": round(calib_s, 1)},
        "eval": {"prompts": len(heldout), "new_tokens": args.eval_new_tokens},
        "rows": rows,
    }
    print("| method | bits | tau | tau / bf16 | lossless | quantized Linear bytes / bf16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        frac = f"{r['linear_bytes'] / r['linear_bf16_bytes']:.3f}" if r["linear_bytes"] else "1"
        print(f"| {r['method']} | {r['bits']} | {r['tau']:.3f} | {r['ratio']:.4f} | {r['lossless']} | {frac} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
