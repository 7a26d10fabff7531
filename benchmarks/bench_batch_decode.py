"""Rows per batch for batched speculative decoding (batch_decode): CPU and wall time of decoding a prompt set
with each batch size against one by one (batch 1 = the sequential loop), same process, same prompts; checks
that every batch size gives the sequential loop's tokens and acceptance. Picks the defaults of --check-batch
and --calib-batch on the development (calibration) split:

    nice -n 10 python benchmarks/bench_batch_decode.py --prompts reference:calib --max-new-tokens 128 \
        --out benchmarks/results/check_batch_dev.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.runtime import encode_prompts, stop_tokens
from dflash_quant.loading.target import load_target
from dflash_quant.speculative.batch_decode import batched_speculative_generate, unbatchable
from dflash_quant.speculative.decode import speculative_generate


def _fields(r) -> tuple:
    return (r.tokens, r.accepted, r.drafted, r.acceptance_lengths, r.target_forwards, r.drafter_forwards)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="reference")
    ap.add_argument("--prompts", default="reference:calib")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="4,8,16,32,64")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/check_batch_dev.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    d, t = load_drafter(a.pair), load_target(f"{a.pair}:target")
    reason = unbatchable(d.model, t.model, 0.0, None)
    if reason is not None:
        raise SystemExit(f"error: {a.pair} decodes one by one ({reason}); pick a pair with a plain-attention target")
    stops = stop_tokens(t)
    ids = encode_prompts(t, a.prompts, a.num_prompts, True, a.max_new_tokens, "--max-new-tokens", "--num-prompts")
    speculative_generate(d.model, t.model, torch.tensor([ids[0]]), 8, stop_token_ids=stops)  # warm-up

    def timed(fn):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        return out, time.process_time() - c, time.perf_counter() - w

    seq, seq_cpu, seq_wall = timed(
        lambda: [
            speculative_generate(d.model, t.model, torch.tensor([p]), a.max_new_tokens, stop_token_ids=stops)
            for p in ids
        ]
    )
    rows = [{"batch": 1, "cpu_s": round(seq_cpu, 2), "wall_s": round(seq_wall, 2), "cpu_ratio": 1.0, "same_runs": True}]
    for b in (int(x) for x in a.batches.split(",")):

        def run(b=b):
            out = []
            for i in range(0, len(ids), b):
                out += batched_speculative_generate(d.model, t.model, ids[i : i + b], a.max_new_tokens, stops)
            return out

        got, cpu, wall = timed(run)
        same = [_fields(x) for x in got] == [_fields(x) for x in seq]
        rows.append(
            {
                "batch": b,
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "cpu_ratio": round(cpu / seq_cpu, 3),
                "wall_ratio": round(wall / seq_wall, 3),
                "same_runs": same,
            }
        )
        print(rows[-1], flush=True)
    lengths = [x for r in seq for x in r.acceptance_lengths]
    result = {
        "command": "nice -n 10 python benchmarks/bench_batch_decode.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "torch_threads": torch.get_num_threads(),
        "pair": a.pair,
        "prompts": a.prompts,
        "num_prompts": len(ids),
        "max_new_tokens": a.max_new_tokens,
        "tau": round(sum(lengths) / len(lengths), 4),
        "rows": rows,
        "fastest_batch_by_cpu": min(rows, key=lambda r: r["cpu_s"])["batch"],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tau", "fastest_batch_by_cpu")}))


if __name__ == "__main__":
    main()
