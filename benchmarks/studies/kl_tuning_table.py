"""Markdown table of kl_tuning.py results (one or more JSON files of the same split), with each tuned row's paired
bootstrap against the GPTQ row of the same pair, grid and solver flags.

    python benchmarks/studies/kl_tuning_table.py benchmarks/results/kl_tuning_dev.json [MORE.json ...] [--merge OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kl_tuning import base_of, paired_interval  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402


def label(row: dict) -> str:
    opts = ":".join(f"{k}={v}" for k, v in row["options"].items())
    return row["method"] + (f" ({opts})" if opts else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--merge", help="write the rows of every file into one JSON")
    args = ap.parse_args()
    docs = [json.loads(Path(f).read_text()) for f in args.files]
    if len({d["split"] for d in docs}) != 1:
        raise SystemExit("the files are of different splits")
    rows, seen = [], set()
    for d in docs:
        for r in d["rows"]:
            key = (r["pair"], r["bits"], r["group_size"], r["method"], json.dumps(r["options"], sort_keys=True))
            if key not in seen:  # a config measured twice (deterministic on CPU) is listed once
                seen.add(key)
                rows.append(r)
    rows.sort(key=lambda r: (r["pair"], -r["bits"], r["method"].replace("gptq-kl", "gptq~"), len(r["options"])))
    print("| pair | grid | method | tau | tau / bf16 | minus its GPTQ [95 % CI] | acceptance at 1 / 4 / 7 | tuning s |")
    print("|---|---|---|---:|---:|---|---|---:|")
    for r in rows:
        base = base_of(r, rows)
        diff = ""
        if base is not None and base is not r:
            lo, hi = paired_interval(r, base)
            diff = f"{r['tau_ratio'] - base['tau_ratio']:+.4f} [{lo:+.4f}, {hi:+.4f}]"
            r["minus_gptq_tau_ratio_95ci"] = [lo, hi]
        acc = r["per_position_acceptance"]
        tuning = r.get("tuning") or {}
        print(
            f"| {r['pair']} (bf16 {r['tau_bf16']:.3f}) | {r['bits']}-bit g{r['group_size']} | {label(r)} | {r['tau']:.3f} "
            f"| {r['tau_ratio']:.4f} | {diff} | {acc[0]:.3f} / {acc[3]:.3f} / {acc[6]:.3f} "
            f"| {tuning.get('seconds', 0):.0f} |"
        )
    if args.merge:
        write_json_atomic(Path(args.merge), {**docs[0], "command": [d["command"] for d in docs], "rows": rows})


if __name__ == "__main__":
    main()
