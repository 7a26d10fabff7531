"""q|k|v as one GEMM at the rows a DFlash drafter step really has (issue #16): q takes the block's 16 rows, k and v
the context's c new rows too (the target's hidden states of the tokens accepted last step, c = 1..16). One layer's
projections of Qwen3-8B-DFlash-b16 (q 4096x4096, k and v 1024x4096): int4 through our CUDA kernel as q@16 +
k|v@(16+c) (two launches) and as q|k|v@(16+c) (one, q's context rows dropped), bf16 as q@16 + k@(16+c) + v@(16+c)
and as q|k|v@(16+c). Each from a CUDA graph cycling through enough copies of the weights that nothing is served
from L2; microseconds a layer, median of the graph's replays.

python benchmarks/int4/int4_qkv_rows.py --out benchmarks/int4/results/int4_qkv_rows.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_cuda_scaling import graph_us, random_weights  # noqa: E402
from int4_load_probe import rotate_copies  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.kernels import int4_cuda  # noqa: E402

H, KV, BLOCK = 4096, 1024, 16


def run(w: int4_cuda.CudaWeights, x: torch.Tensor) -> torch.Tensor:
    return int4_cuda.matmul(x, w.qweight, w.scales, w.zeros, w.counters, w.group, w.split)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="0,1,4,8,16", help="new context rows c, comma-separated")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    n_int4 = rotate_copies((H + 2 * KV) * H // 2)
    q4 = [random_weights(H, H, gen) for _ in range(n_int4)]
    kv4 = [random_weights(2 * KV, H, gen) for _ in range(n_int4)]
    qkv4 = [random_weights(H + 2 * KV, H, gen) for _ in range(n_int4)]
    n_bf16 = rotate_copies((H + 2 * KV) * H * 2)
    qb = [torch.randn(H, H, generator=gen, device=dev).bfloat16() for _ in range(n_bf16)]
    kb = [torch.randn(KV, H, generator=gen, device=dev).bfloat16() for _ in range(n_bf16)]
    vb = [torch.randn(KV, H, generator=gen, device=dev).bfloat16() for _ in range(n_bf16)]
    qkvb = [torch.cat([q, k, v]) for q, k, v in zip(qb, kb, vb, strict=True)]
    rows = []
    for c in (int(v) for v in args.context.split(",")):
        kv_in = torch.randn(BLOCK + c, H, generator=gen, device=dev).bfloat16()
        h = kv_in[c:]
        us = {
            "int4 q + k|v": graph_us(
                [lambda q=q, kv=kv, h=h, x=kv_in: (run(q, h), run(kv, x)) for q, kv in zip(q4, kv4, strict=True)]
            ),
            "int4 q|k|v": graph_us([lambda w=w, x=kv_in, c=c: run(w, x)[c:, :H] for w in qkv4]),
            "bf16 q + k + v": graph_us(
                [
                    lambda q=q, k=k, v=v, h=h, x=kv_in: (h @ q.T, x @ k.T, x @ v.T)
                    for q, k, v in zip(qb, kb, vb, strict=True)
                ]
            ),
            "bf16 q|k|v": graph_us([lambda w=w, x=kv_in: x @ w.T for w in qkvb]),
        }
        splits = {"q": q4[0].split, "kv": kv4[0].split, "qkv": qkv4[0].split}
        rows.append({"context_rows": c, "kv_rows": BLOCK + c, "us_per_layer": us, "splits": splits})
        print(c, {k: round(v, 2) for k, v in us.items()}, flush=True)
    write_json_atomic(args.out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
