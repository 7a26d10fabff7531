"""Paired comparison of gptq --json outputs on the same prompts: tau ratio, per-position acceptance, and a
paired bootstrap (over prompts) of the tau-ratio difference between the first two files.

  python benchmarks/paired_tau.py A.json B.json   # e.g. benchmarks/results/d2_3bit_heldout_*.json
"""

import json
import random
import sys


def load(p):
    d = json.load(open(p))
    return d["parity"]


def tau(pp):  # aggregate tau = tokens / steps over the chosen prompts
    return sum(x["tau"] * x["steps"] for x in pp) / sum(x["steps"] for x in pp)


def ratio_ci(q, b):  # 95 % bootstrap interval of tau_q / tau_bf16, prompts resampled with their bf16 runs
    rng = random.Random(0)
    draws = []
    for _ in range(2000):
        idx = [rng.randrange(len(q)) for _ in q]
        draws.append(tau([q[i] for i in idx]) / tau([b[i] for i in idx]))
    draws.sort()
    return draws[50], draws[1950]


def main():
    files = sys.argv[1:]
    for f in files:
        p = load(f)
        q = p["quantized"]
        lo, hi = ratio_ci(q["per_prompt"], p["baseline"]["per_prompt"])
        print(
            f"{f.split('/')[-1]:28s} tau_b={p['baseline']['tau']:.3f} tau_q={q['tau']:.3f} ratio={p['tau_ratio']:.4f} "
            f"[{lo:.4f}, {hi:.4f}] lossless={p['lossless']} acc={' / '.join(f'{a:.3f}' for a in q['per_position_acceptance'])}"
        )
    if len(files) >= 2:
        a, b = load(files[0]), load(files[1])
        pa, pb, base = a["quantized"]["per_prompt"], b["quantized"]["per_prompt"], a["baseline"]["per_prompt"]
        n = len(pa)
        random.seed(0)
        diffs = []
        for _ in range(2000):
            idx = [random.randrange(n) for _ in range(n)]
            tb = tau([base[i] for i in idx])
            diffs.append((tau([pa[i] for i in idx]) - tau([pb[i] for i in idx])) / tb)
        diffs.sort()
        print(
            f"paired bootstrap ratio diff {files[0].split('/')[-1]} - {files[1].split('/')[-1]}: point {(a['tau_ratio'] - b['tau_ratio']):+.4f}, 95% CI [{diffs[50]:+.4f}, {diffs[1950]:+.4f}]"
        )


if __name__ == "__main__":
    main()
