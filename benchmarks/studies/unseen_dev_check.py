"""Dev-side check of benchmarks/studies/mixed_unseen.sh's drafters: each is decoded on the 128 prompts of the pair's DEV
file (benchmarks/prompts/<p>_dev_mixed.jsonl; 64 new tokens, greedy, the `spec_runs` call of the tau map) and the
tau ratio is reported per subset: the map's first 32 (and their dev-file / shipped halves), and the 96 prompts the
map never decoded (48 dev-file, 48 shipped calibration). Never the test prompts. `gptq` refuses calibration
prompts as parity prompts, so this decodes directly, as benchmarks/studies/mixed_dev_check.py does.
Usage: python benchmarks/studies/unseen_dev_check.py PAIR WORK OUT.json
(WORK: mixed_unseen.sh's, with its artifacts)"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.runtime import encode_prompts, stop_tokens
from dflash_quant.loading.target import load_target
from dflash_quant.speculative.verify import CheckSettings, spec_runs

PAIRS = {"reference": ("pair", "ref"), "reference-dflash2": ("dflash2_pair", "d2")}
MAP_PROMPTS, NEW_TOKENS, DRAWS = 32, 64, 2000
LABELS = ("devmixed_u4", "devmixed_tau", "default_u4_test", "default_tau_test")


def tau(r: dict[str, list[int]], idx: list[int]) -> float:
    return sum(r["tokens"][i] for i in idx) / max(1, sum(r["steps"][i] for i in idx))


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in PAIRS:
        raise SystemExit(
            "usage: python benchmarks/studies/unseen_dev_check.py reference|reference-dflash2 WORK OUT.json"
        )
    pair, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    repo = Path(__file__).resolve().parents[2]
    root = repo / "dflash_quant" / "reference" / PAIRS[pair][0]
    dev_file = repo / "benchmarks" / "prompts" / f"{PAIRS[pair][1]}_dev_mixed.jsonl"
    kinds = [json.loads(line)["kind"] for line in dev_file.read_text().splitlines() if line.strip()]
    target = load_target(root / "target")
    ids = encode_prompts(target, str(dev_file), None, True, NEW_TOKENS)
    models = {"bf16": root / "drafter", **{label: work / label for label in LABELS}}
    runs: dict[str, dict[str, list[int]]] = {}
    for label, path in models.items():
        if not path.is_dir():
            raise SystemExit(f"{path} is missing; run benchmarks/studies/mixed_unseen.sh {pair} with WORK={work} first")
        drafter = load_drafter(path)
        check = CheckSettings(NEW_TOKENS, 0.0, drafter.config.block_size, 0, stop_tokens(target), batch=16)
        res = spec_runs(drafter.model, target.model, ids, check)
        runs[label] = {
            "tokens": [sum(r.acceptance_lengths) for r in res],
            "steps": [len(r.acceptance_lengths) for r in res],
        }
        print(label, round(tau(runs[label], list(range(len(ids)))), 4), flush=True)
    n = len(ids)
    subsets = {
        "map32": list(range(MAP_PROMPTS)),
        "map32_devfile": [i for i in range(MAP_PROMPTS) if kinds[i] == "unseen_dev_file"],
        "map32_shipped": [i for i in range(MAP_PROMPTS) if kinds[i] == "shipped_calibration"],
        "rest_devfile": [i for i in range(MAP_PROMPTS, n) if kinds[i] == "unseen_dev_file"],
        "rest_shipped": [i for i in range(MAP_PROMPTS, n) if kinds[i] == "shipped_calibration"],
        "all_devfile": [i for i in range(n) if kinds[i] == "unseen_dev_file"],
    }
    result: dict = {"pair": pair, "dev_file": str(dev_file.relative_to(repo)), "new_tokens": NEW_TOKENS, "ratios": {}}
    rng = random.Random(0)
    for name, idx in subsets.items():
        base = tau(runs["bf16"], idx)
        entry: dict = {"prompts": len(idx), "tau_bf16": round(base, 5)}
        for label in LABELS:
            draws = []
            for _ in range(DRAWS):
                pick = [idx[rng.randrange(len(idx))] for _ in idx]
                draws.append(tau(runs[label], pick) / tau(runs["bf16"], pick))
            draws.sort()
            entry[label] = {
                "ratio": round(tau(runs[label], idx) / base, 5),
                "ci95": [round(draws[int(0.025 * DRAWS)], 5), round(draws[int(0.975 * DRAWS) - 1], 5)],
            }
        result["ratios"][name] = entry
    for label in LABELS:
        prov = json.loads((work / label / "provenance.json").read_text()).get("mixed")
        if prov:
            result[f"{label}_predicted"] = [prov["predicted_tau_ratio"], prov["predicted_tau_ratio_low"]]
    result["per_prompt"] = {"kinds": kinds, **runs}
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, entry in result["ratios"].items():
        cells = "  ".join(f"{label} {entry[label]['ratio']:.4f} {entry[label]['ci95']}" for label in LABELS)
        print(f"{name:14s} n={entry['prompts']:3d}  {cells}")


if __name__ == "__main__":
    main()
