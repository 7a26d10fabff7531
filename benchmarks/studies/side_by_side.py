"""auto-round next to the kl_tuning.py rows measured on the same prompts: tau, tau / bf16, per-position acceptance,
and 95 % paired bootstrap intervals (over prompts) of every pair of methods' tau-ratio difference.

    python benchmarks/studies/side_by_side.py benchmarks/results/kl_tuning_extra_calib.json \
        benchmarks/results/autoround_side_reference_extra_3.json benchmarks/results/autoround_side_reference-dflash2_extra_3.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def _tau(rows: list[dict], idx: list[int]) -> float:
    return sum(rows[i]["tau"] * rows[i]["steps"] for i in idx) / sum(rows[i]["steps"] for i in idx)


def interval(a: list[dict], b: list[dict], bf16: list[dict], draws: int = 2000) -> tuple[float, float, float]:
    """(a - b) in tau ratio, with its 95 % paired bootstrap interval over prompts."""
    n = len(bf16)
    full = list(range(n))
    point = (_tau(a, full) - _tau(b, full)) / _tau(bf16, full)
    rng = random.Random(0)
    out = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        out.append((_tau(a, idx) - _tau(b, idx)) / _tau(bf16, idx))
    out.sort()
    return point, out[int(0.025 * draws)], out[int(0.975 * draws)]


def main() -> None:
    study = json.loads(Path(sys.argv[1]).read_text())
    methods: dict[tuple, dict[str, dict]] = {}
    for row in study["rows"]:
        calib = row["options"].get("calib")
        label = row["method"] + (f" ({128 + int(calib)} prompts)" if calib else " (128 prompts)")
        methods.setdefault((row["pair"], row["bits"], row["group_size"]), {})[label] = row
    for path in sys.argv[2:]:
        ar = json.loads(Path(path).read_text())
        v = ar["verify"]
        key = (ar["pair"], ar["bits"], ar["group_size"])
        methods.setdefault(key, {})[f"auto-round {ar['auto_round']} ({ar['calib_prompts']} prompts)"] = {
            "tau": v["summary"]["tau"],
            "tau_bf16": v["baseline"]["tau"],
            "per_prompt": v["summary"]["per_prompt"],
            "per_prompt_bf16": v["baseline"]["per_prompt"],
            "per_position_acceptance": v["summary"]["per_position_acceptance"],
            "lossless": v["summary"]["lossless"],
        }
    for (pair, bits, group), rows in methods.items():
        bf16s = {round(r["tau_bf16"], 4) for r in rows.values()}
        if len(bf16s) != 1:
            raise SystemExit(f"{pair}: the rows were not measured on the same prompts (bf16 tau {sorted(bf16s)})")
        bf16 = next(iter(rows.values()))["per_prompt_bf16"]
        print(f"\n{pair} {bits}-bit g{group}, bf16 tau {bf16s.pop()}, {len(bf16)} prompts")
        print("| method | tau | tau / bf16 | acceptance at 1..7 | lossless |")
        print("|---|---:|---:|---|---|")
        for label, r in rows.items():
            acc = " / ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
            print(f"| {label} | {r['tau']:.3f} | {r['tau'] / r['tau_bf16']:.4f} | {acc} | {r['lossless']} |")
        labels = list(rows)
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                d, lo, hi = interval(rows[a]["per_prompt"], rows[b]["per_prompt"], bf16)
                print(f"{a} - {b}: {d:+.4f} [{lo:+.4f}, {hi:+.4f}]")


if __name__ == "__main__":
    main()
