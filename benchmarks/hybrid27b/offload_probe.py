"""How fast does the capped run's offloaded target decode? Loads the target run.py built (/dev/shm/h27-target)
through dflash-quant's loader under a --max-memory plan, prints where accelerate put each module and the hooks
it streams with, then times the batched greedy decode that teacher-forced calibration and the check start with
(one call of 1 token as warm-up, then N tokens: the prefill plus N-1 one-token forwards of all rows).

  python3 benchmarks/hybrid27b/offload_probe.py --max-memory 0=14.11GiB,cpu=39.06GiB --new-tokens 4
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from dflash_quant.loading.target import load_target
from dflash_quant.models.placement import make_placement
from dflash_quant.speculative.teacher import greedy_rows_batched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="/dev/shm/h27-target")
    ap.add_argument("--max-memory", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    t0 = time.perf_counter()
    loaded = load_target(args.target, "cuda", torch.bfloat16, placement=make_placement("auto", args.max_memory))
    model = loaded.model
    print(f"load {time.perf_counter() - t0:.1f} s; map {Counter(str(v) for v in model.hf_device_map.values())}")
    hooks = [m._hf_hook for m in model.modules() if hasattr(m, "_hf_hook")]
    print("hooks", Counter((type(h).__name__, getattr(h, "offload", None)) for h in hooks))
    print(f"gpu allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(96)] for i in range(args.rows)]
    for n in (1, args.new_tokens):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        greedy_rows_batched(model, prompts, n, [1, 15, 31], torch.device("cuda"), args.rows)
        torch.cuda.synchronize()
        print(f"greedy {args.rows} rows x {n} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"gpu peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
