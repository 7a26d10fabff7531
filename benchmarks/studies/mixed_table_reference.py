"""Sensitivity table on a real calibration (from `gptq --calib-cache DIR`) and the search at uniform budgets.

Reports predicted totals only (sum of relative GPTQ output errors): no tau is measured here.
Usage: python benchmarks/studies/mixed_table_reference.py DRAFTER_DIR CALIB_DIR OUT.json"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_quant.calibration import cache
from dflash_quant.quantize.mixed import Candidate, max_quality, min_bytes
from dflash_quant.quantize.mixed_table import build_table


def main() -> None:
    drafter, calib, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    meta = json.loads((calib / cache.META).read_text())
    stats = cache.load(calib, meta["key"], need_replay=False, device=torch.device("cpu"))
    assert stats is not None
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(drafter.glob("*.safetensors")):
        sd |= load_file(str(f))
    weights = {}
    for k, v in sd.items():
        if not k.endswith(".weight") or v.dim() != 2:
            continue
        name = k.removesuffix(".weight").removeprefix("model.")
        try:
            stats.for_linear(name)
        except KeyError:
            continue
        weights[name] = v.float()
    cands = [Candidate(b, g) for b in (2, 3, 4, 8) for g in (32, 128)]
    t0 = time.perf_counter()
    table = build_table(weights, stats, cands)
    t_table = time.perf_counter() - t0

    def uniform(c: Candidate) -> dict[str, float]:
        return {"bytes": sum(table[n][c][0] for n in table), "loss": sum(table[n][c][1] for n in table)}

    u = {f"{c.bits}b_g{c.group_size}": uniform(c) for c in cands}
    at3 = max_quality(table, int(u["3b_g128"]["bytes"]), resolution=1)
    at4 = min_bytes(table, u["4b_g128"]["loss"], resolution=1)
    res = {
        "linears": len(table),
        "table_build_s": round(t_table, 2),
        "uniform": u,
        "max_bytes_at_uniform_3b_g128": {
            "bytes": at3.total_bytes,
            "loss": at3.total_loss,
            "picks": {n: f"{c.bits}b_g{c.group_size}" for n, c in at3.picks.items()},
        },
        "min_bytes_at_uniform_4b_g128_loss": {
            "bytes": at4.total_bytes,
            "loss": at4.total_loss,
            "picks": {n: f"{c.bits}b_g{c.group_size}" for n, c in at4.picks.items()},
        },
    }
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "uniform"}, indent=1)[:3000])
    print(json.dumps(u, indent=1))


if __name__ == "__main__":
    main()
