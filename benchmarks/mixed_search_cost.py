"""Cost of the mixed-precision search (the DP only) on a drafter-sized table: 5 Qwen3-8B-shaped blocks plus fc.

Losses are random (the search's cost does not depend on them); bytes are GPTQ v1 sizes of the real shapes.
Usage: python benchmarks/mixed_search_cost.py [out.json]"""

from __future__ import annotations

import json
import sys
import time

import torch

from dflash_quant.quantize.mixed import Candidate, max_quality, min_bytes, packed_bytes

HIDDEN, INTER, KV, LAYERS = 4096, 12288, 1024, 5
SHAPES = {"fc": (HIDDEN, HIDDEN * LAYERS)}
for i in range(LAYERS):
    p = f"layers.{i}"
    SHAPES |= {
        f"{p}.self_attn.q_proj": (HIDDEN, HIDDEN),
        f"{p}.self_attn.k_proj": (KV, HIDDEN),
        f"{p}.self_attn.v_proj": (KV, HIDDEN),
        f"{p}.self_attn.o_proj": (HIDDEN, HIDDEN),
        f"{p}.mlp.gate_proj": (INTER, HIDDEN),
        f"{p}.mlp.up_proj": (INTER, HIDDEN),
        f"{p}.mlp.down_proj": (HIDDEN, INTER),
    }


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cands = [Candidate(b, gs) for b in (2, 3, 4, 8) for gs in (32, 128)]
    table = {
        n: {c: (packed_bytes(o, i, c), float(torch.rand(1, generator=g)) / c.bits**2) for c in cands}
        for n, (o, i) in SHAPES.items()
    }
    u3 = sum(packed_bytes(o, i, Candidate(3, 128)) for o, i in SHAPES.values())
    t0 = time.perf_counter()
    a = max_quality(table, u3)
    t1 = time.perf_counter()
    b = min_bytes(table, a.total_loss * 1.5)
    t2 = time.perf_counter()
    out = {
        "linears": len(SHAPES),
        "candidates": len(cands),
        "budget_bytes": u3,
        "max_quality_s": round(t1 - t0, 3),
        "min_bytes_s": round(t2 - t1, 3),
        "max_quality_bytes": a.total_bytes,
        "min_bytes_bytes": b.total_bytes,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
