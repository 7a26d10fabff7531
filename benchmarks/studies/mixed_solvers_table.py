"""What each GPTQ solver buys the mixed search, on a real calibration (the search's loss only, no tau measured).

For every Linear of the table (names from the calibration's sensitivity.json) and every grid bits 2/3/4/8 x
groups 32/64/128/per channel, the relative output error of the four solvers (plain, act-order with static
groups, clip search, both); then uniform 2/3/4-bit g128 per solver and the search's least loss at uniform
3-bit g128's bytes with the solver sets plain / +act / +clip / all four.
Usage: python benchmarks/studies/mixed_solvers_table.py DRAFTER_DIR CALIB_DIR OUT.json"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_quant.calibration import cache
from dflash_quant.quantize.mixed import Candidate, max_quality
from dflash_quant.quantize.mixed_plan import SOLVERS, candidates_for, fmt_cand
from dflash_quant.quantize.mixed_table import TABLE, build_table

SETS = {
    "plain": [(False, False)],
    "plain+act": [(False, False), (True, False)],
    "plain+clip": [(False, False), (False, True)],
    "all four": list(SOLVERS),
}


def main() -> None:
    drafter, calib, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    meta = json.loads((calib / cache.META).read_text())
    stats = cache.load(calib, meta["key"], need_replay=False, device=torch.device("cpu"))
    assert stats is not None
    names = list(json.loads((calib / TABLE).read_text())["linears"])
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(drafter.glob("*.safetensors")):
        sd |= load_file(str(f))
    weights = {n: sd[f"{n}.weight"].float() for n in names}
    cands = candidates_for([tuple(w.shape) for w in weights.values()])
    t0 = time.perf_counter()
    table = build_table(weights, stats, cands)
    seconds = time.perf_counter() - t0
    u3 = sum(table[n][Candidate(3, 128)][0] for n in names)

    def uniform(c: Candidate) -> float:
        return round(sum(table[n][c][1] for n in names), 4)

    res: dict = {
        "linears": len(names),
        "candidates": len(cands),
        "table_build_s": round(seconds, 1),
        "uniform_g128_loss": {
            fmt_cand(Candidate(b, 128, a, c)): uniform(Candidate(b, 128, a, c)) for b in (2, 3, 4) for a, c in SOLVERS
        },
        "uniform_3b_g128_bytes": u3,
        "search_loss_at_uniform_3b_bytes": {},
    }
    for label, solvers in SETS.items():
        sub = {n: {c: v for c, v in row.items() if (c.act, c.clip) in solvers} for n, row in table.items()}
        choice = max_quality(sub, u3, resolution=1)
        res["search_loss_at_uniform_3b_bytes"][label] = {
            "loss": round(choice.total_loss, 4),
            "bytes": choice.total_bytes,
        }
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
