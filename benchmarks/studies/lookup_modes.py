"""Lookup proposer: which rule per step, measured on a DEVELOPMENT prompt split (never the held-out one).

Runs the greedy speculative check once without lookup and once per (mode, n-gram) setting on the same
prompts and target-only reference, and prints tau with/without lookup per prompt category. CPU, fp32:

    python benchmarks/studies/lookup_modes.py --pair reference --prompts builtin:calib \
        --out benchmarks/studies/results/lookup_modes_dev.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_quant.loading.runtime import encode_prompts, load_pair, resolve_device, stop_tokens
from dflash_quant.prompts import load_prompts
from dflash_quant.speculative.lookup import LookupSettings
from dflash_quant.speculative.verify import CheckSettings, baseline_runs, lookup_summary, spec_runs, summarize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="reference")
    ap.add_argument("--prompts", default="builtin:calib")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--settings",
        default="prefer:2-4,prefer:3-6,agree:2-4,agree:3-6,extend:2-4,extend:3-6,extend:2-4:14,both:2-4:7,both:3-6:7",
        help="mode:min-max[:max lookup tokens], comma-separated (`both` without tokens: its default row length)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if "heldout" in args.prompts:
        sys.exit("choose the rule on a development split (e.g. builtin:calib), never the held-out prompts")
    dev = resolve_device("cpu")
    import torch

    drafter, target = load_pair(args.pair, None, dev, torch.float32)
    ids = encode_prompts(target, args.prompts, None, True)
    cats = [p.category for p in load_prompts(args.prompts)]
    block = drafter.config.block_size
    base_settings = CheckSettings(args.max_new_tokens, 0.0, block, 0, stop_tokens(target))
    reference = baseline_runs(target.model, ids, base_settings)
    plain_runs = spec_runs(drafter.model, target.model, ids, base_settings)
    plain = summarize(args.pair, plain_runs, reference, base_settings, block)
    rows = {
        "off": {
            "tau": plain["tau"],
            "lossless": plain["lossless"],
            "verified_tokens": sum(r.verified_tokens for r in plain_runs),
        }
    }
    print(f"off: tau {plain['tau']}", flush=True)
    for spec in args.settings.split(","):
        mode, grams, *tokens = spec.split(":")  # mode:min-max[:max lookup tokens]
        lo, hi = map(int, grams.split("-"))
        lk = LookupSettings(mode, lo, hi, int(tokens[0]) if tokens else None)
        settings = CheckSettings(args.max_new_tokens, 0.0, block, 0, stop_tokens(target), lk)
        rec = lookup_summary(
            plain, plain_runs, spec_runs(drafter.model, target.model, ids, settings), reference, settings, block, cats
        )
        rows[spec] = rec
        by = " ".join(f"{c}:{v['tau_without']}->{v['tau']}" for c, v in (rec.get("by_category") or {}).items())
        print(
            f"{spec}: tau {rec['tau']} ratio {rec['tau_ratio']} lossless {rec['lossless']} "
            f"lookup share {rec['lookup_step_share']} verified tokens x"
            f"{rec['verified_tokens'] / max(rec['verified_tokens_without'], 1):.3f} | {by}",
            flush=True,
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"pair": args.pair, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
