"""Attention cost per call in the decode loop's shapes, per SDPA backend set (issue #16, GPU main job).

Decoding changes the key length at every step, so each call is a new shape. For each allowed-backend set the
same sequence of calls (bool masks, GQA, bf16) is timed twice: first pass (new shapes), second pass (same
shapes again). Host time per call, CUDA synchronised at the end of each pass; the default set is torch's own.

    python benchmarks/bench_sdpa.py --out benchmarks/results/sdpa_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SETS = {
    "torch default (all)": None,
    "no cudnn (flash, efficient, math)": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn only": [SDPBackend.CUDNN_ATTENTION],
    "efficient only": [SDPBackend.EFFICIENT_ATTENTION],
    "math only": [SDPBackend.MATH],
}
# (name, batch, heads, kv heads, head dim, query tokens): the reference pair's drafter/target, an 8B drafter
SHAPES = [
    ("reference b16 q8", 16, 4, 2, 64, 8),
    ("reference b1 q8", 1, 4, 2, 64, 8),
    ("8B-like b1 q16", 1, 32, 8, 128, 16),
]


def calls(batch, heads, kv, dim, q_len, lengths, device, gqa):
    out = []
    for length in lengths:
        q = torch.randn(batch, heads, q_len, dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, kv if gqa else heads, length, dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(batch, 1, q_len, length, device=device, dtype=torch.bool).tril(length - q_len)
        out.append((q, k, v, mask))
    return out


def run(inputs, gqa: bool) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for q, k, v, mask in inputs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / len(inputs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=120)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for shape in SHAPES:
        name, b, h, kv, d, ql = shape
        for gqa in (True, False):
            for set_name, backends in SETS.items():
                lengths = list(range(ql + 16, ql + 16 + args.calls))  # a new key length per call
                inputs = calls(b, h, kv, d, ql, lengths, device, gqa)
                row = {"shape": name, "gqa": gqa, "backends": set_name}
                try:
                    if backends is None:
                        q, k, v, m = inputs[0]
                        row["default_choice"] = int(torch._fused_sdp_choice(q, k, v, m, 0.0, False, enable_gqa=gqa))
                        row["first_us"], row["again_us"] = run(inputs, gqa), run(inputs, gqa)
                    else:
                        with sdpa_kernel(backends):
                            row["first_us"], row["again_us"] = run(inputs, gqa), run(inputs, gqa)
                except RuntimeError as exc:
                    row["error"] = str(exc).splitlines()[0][:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python benchmarks/bench_sdpa.py",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
