"""Tau ratio pooled over several held-out sets: gptq --json outputs of one drafter on disjoint prompt sets,
their prompts put together (tokens / steps over all of them), with a 95 % bootstrap interval over prompts.

  python benchmarks/pooled_tau.py benchmarks/results/mixed_reference_kind_tau.json benchmarks/results/mixed_reference_kind_tau_test.json
"""

import json
import random
import sys


def per_prompt(paths: list[str]) -> tuple[list[dict], list[dict]]:
    q, b = [], []
    for path in paths:
        parity = json.load(open(path))["parity"]
        q += parity["quantized"]["per_prompt"]
        b += parity["baseline"]["per_prompt"]
    return q, b


def tau(pp: list[dict]) -> float:
    return sum(x["tau"] * x["steps"] for x in pp) / sum(x["steps"] for x in pp)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/pooled_tau.py RESULT.json [RESULT.json ...]")
    q, b = per_prompt(sys.argv[1:])
    rng = random.Random(0)
    draws = []
    for _ in range(2000):
        idx = [rng.randrange(len(q)) for _ in q]
        draws.append(tau([q[i] for i in idx]) / tau([b[i] for i in idx]))
    draws.sort()
    names = " + ".join(p.split("/")[-1] for p in sys.argv[1:])
    print(f"{names}: {len(q)} prompts, tau ratio {tau(q) / tau(b):.4f} [{draws[50]:.4f}, {draws[1950]:.4f}]")


if __name__ == "__main__":
    main()
