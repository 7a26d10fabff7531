"""Does the mixed search's loss -> tau map predict on its own development split? The artifacts that
benchmarks/mixed_reference.sh wrote (WORK/{u3,tau,bytes}) and the bf16 drafter are decoded on the dev prompts the
map was fitted on (the first 32 calibration prompts, 64 new tokens, greedy; the same `spec_runs` call as the
map), and each ratio is set beside the map's prediction (provenance `mixed.predicted_tau_ratio`), with a paired
bootstrap of `--max-bytes` minus uniform 3-bit over the prompts. `gptq` refuses calibration prompts as parity
prompts (that guards the held-out gate), so this check decodes directly.
Usage: python benchmarks/studies/mixed_dev_check.py PAIR WORK OUT.json   (PAIR: reference or reference-dflash2)"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.runtime import encode_prompts, stop_tokens
from dflash_quant.loading.target import load_target
from dflash_quant.speculative.verify import CheckSettings, spec_runs

PAIRS = {"reference": "pair", "reference-dflash2": "dflash2_pair"}
DEV_PROMPTS, NEW_TOKENS, DRAWS = 32, 64, 2000


def tau(tokens: list[int], steps: list[int], idx: list[int]) -> float:
    return sum(tokens[i] for i in idx) / max(1, sum(steps[i] for i in idx))


def main() -> None:
    pair, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    root = Path(__file__).resolve().parents[2] / "dflash_quant" / "reference" / PAIRS[pair]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target = load_target(root / "target")
    ids = encode_prompts(target, f"{pair}:calib", DEV_PROMPTS, True, NEW_TOKENS)
    runs: dict[str, dict[str, list[int]]] = {}
    models = {
        "bf16": root / "drafter",
        "u3": work / "u3",
        "u4": work / "u4",
        "tau": work / "tau",
        "bytes": work / "bytes",
    }
    block = None
    for label, path in models.items():
        drafter = load_drafter(path)
        block = drafter.config.block_size
        check = CheckSettings(NEW_TOKENS, 0.0, block, 0, stop_tokens(target))
        res = spec_runs(drafter.model, target.model, ids, check)
        runs[label] = {
            "tokens": [sum(r.acceptance_lengths) for r in res],
            "steps": [len(r.acceptance_lengths) for r in res],
        }
        print(label, round(tau(runs[label]["tokens"], runs[label]["steps"], list(range(len(ids)))), 4), flush=True)
    every = list(range(len(ids)))
    t0 = tau(runs["bf16"]["tokens"], runs["bf16"]["steps"], every)
    result: dict = {"pair": pair, "dev_prompts": len(ids), "new_tokens": NEW_TOKENS, "tau_bf16": round(t0, 5)}
    for label in ("u3", "u4", "tau", "bytes"):
        r = runs[label]
        entry = {"tau": round(tau(r["tokens"], r["steps"], every), 5)}
        entry["tau_ratio"] = round(entry["tau"] / t0, 5)
        prov = json.loads((work / label / "provenance.json").read_text()).get("mixed")
        if prov:
            entry["predicted_tau_ratio"] = prov["predicted_tau_ratio"]
            entry["predicted_tau_ratio_low"] = prov["predicted_tau_ratio_low"]
        result[label] = entry
    rng = random.Random(0)
    for a, b in (("bytes", "u3"), ("tau", "u4")):
        diffs = []
        for _ in range(DRAWS):
            idx = [rng.randrange(len(ids)) for _ in ids]
            base = tau(runs["bf16"]["tokens"], runs["bf16"]["steps"], idx)
            ra = tau(runs[a]["tokens"], runs[a]["steps"], idx) / base
            rb = tau(runs[b]["tokens"], runs[b]["steps"], idx) / base
            diffs.append(ra - rb)
        diffs.sort()
        point = result[a]["tau_ratio"] - result[b]["tau_ratio"]
        result[f"{a}_minus_{b}"] = {
            "point": round(point, 5),
            "ci95": [round(diffs[int(0.025 * DRAWS)], 5), round(diffs[int(0.975 * DRAWS) - 1], 5)],
        }
    result["per_prompt"] = runs
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=1))


if __name__ == "__main__":
    main()
