"""Tau ratio pooled over several held-out sets: gptq --json outputs of one drafter on disjoint prompt sets,
their prompts put together (tokens / steps over all of them), with a 95 % bootstrap interval over prompts.

  python benchmarks/studies/pooled_tau.py benchmarks/studies/results/mixed_reference_kind_tau.json \
      benchmarks/studies/results/mixed_reference_kind_tau_test.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired_tau import ratio_ci, tau  # noqa: E402  (benchmarks/paired_tau.py, a script, not a package)


def per_prompt(paths: list[str]) -> tuple[list[dict], list[dict]]:
    q, b = [], []
    for path in paths:
        parity = json.load(open(path))["parity"]
        q += parity["quantized"]["per_prompt"]
        b += parity["baseline"]["per_prompt"]
    return q, b


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/studies/pooled_tau.py RESULT.json [RESULT.json ...]")
    q, b = per_prompt(sys.argv[1:])
    lo, hi = ratio_ci(q, b)
    names = " + ".join(p.split("/")[-1] for p in sys.argv[1:])
    print(f"{names}: {len(q)} prompts, tau ratio {tau(q) / tau(b):.4f} [{lo:.4f}, {hi:.4f}]")


if __name__ == "__main__":
    main()
