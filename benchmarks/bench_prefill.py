"""Time to first token with and without a DFlash drafter attached, on a Qwen3-8B-shaped pair (random weights).

Without the drafter, the first token costs one target prefill. With it, the prefill must also return the
tap layers' hidden states, and the drafter must take in the prompt as context (fc over the 5 concatenated
taps, then every layer's context K/V) before its first block: that is the extra prefill work users see.
The int4 drafter is the GPTQ artifact as `verify` runs it (dequantized to bf16), i.e. the same arithmetic;
a packed-int4 kernel would change only the drafter's share.

  python benchmarks/bench_prefill.py --device cuda --lengths 1024,8192,32768 --out prefill.json
  python benchmarks/bench_prefill.py --device cpu --small --lengths 64,128        # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_quant.models.config import parse_draft_config  # noqa: E402
from dflash_quant.models.model import DFlashDrafter, DraftCache  # noqa: E402

PRESET = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "dflash_quant", "memory", "presets", "qwen3-8b-dflash-b16.json"
)


def build(device, dtype, small):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw = json.load(open(PRESET))
    if small:
        raw.update(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            num_target_layers=6,
        )
        raw["dflash_config"] = {**raw["dflash_config"], "target_layer_ids": [0, 2, 4], "mask_token_id": 3}
    tcfg = Qwen3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=6 if small else 36,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(tcfg).to(dtype).eval()
        drafter = DFlashDrafter(parse_draft_config(raw)).to(dtype).eval()
    return target, drafter


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def ttft(target, drafter, ids, with_drafter: bool, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    out = target(ids, use_cache=True, output_hidden_states=with_drafter, logits_to_keep=1)
    first = out.logits[0, -1].argmax()
    if with_drafter:  # the drafter's first block needs the whole prompt as context
        ctx = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        n = ids.shape[1]
        block = torch.full((1, drafter.block_size), drafter.mask_token_id, device=device)
        block[0, 0] = first
        noise = target.get_input_embeddings()(block)
        positions = torch.arange(0, n + drafter.block_size, device=device)[None]
        hidden = drafter(noise, ctx, positions, cache=DraftCache())
        target.get_output_embeddings()(hidden[:, 1:]).argmax(-1)
    int(first)
    sync(device)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter = build(device, dtype, args.small)
    # int4: GPTQ-grid weights (RTN, 4-bit g128 sym) dequantized, as the parity check runs the artifact; on CUDA
    # also the same codes through our int4 kernel (`--int4-kernel triton`), which rebuilds each weight in bf16
    # for a prompt's rows (int4_linear.MAX_KERNEL_ROWS) and keeps only the codes resident
    from dflash_quant.kernels.int4_linear import Int4Codes, use_int4_codes
    from dflash_quant.quantize.rtn import rtn_quantize
    from dflash_quant.quantize.spec import QuantSpec

    int4 = DFlashDrafter(drafter.config).to(device=device, dtype=dtype).eval()
    int4.load_state_dict(drafter.state_dict())
    codes = {}
    with torch.no_grad():
        for name in int4.linear_names():
            mod = int4.get_submodule(name)
            qw = rtn_quantize(mod.weight.float(), QuantSpec(4, 128, True), name=name)
            mod.weight.copy_(qw.dequantize().to(dtype))
            if device.type == "cuda":
                codes[name] = (Int4Codes(qw.codes, qw.zeros, qw.scales, qw.g_idx.long(), 128), None)
    drafters = {"bf16_drafter": drafter, "int4_drafter": int4}
    if codes:
        kernel = DFlashDrafter(drafter.config).to(device=device, dtype=dtype).eval()
        kernel.load_state_dict(int4.state_dict())
        use_int4_codes(kernel, codes, ["triton"])
        drafters["int4_kernel_drafter"] = kernel
        del codes
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, target.config.vocab_size, (1, n), generator=g).to(device)
        for _ in range(2):  # warm-up at this length
            ttft(target, None, ids, False, device)
            for d in drafters.values():
                ttft(target, d, ids, True, device)
        times: dict[str, list[float]] = {"target_only": [], **{k: [] for k in drafters}}
        for _ in range(args.repeats):  # interleaved, so drift hits all alike
            times["target_only"].append(ttft(target, None, ids, False, device))
            for k, d in drafters.items():
                times[k].append(ttft(target, d, ids, True, device))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {
            "prompt_tokens": n,
            **{f"{k}_ttft_s": round(v, 5) for k, v in med.items()},
            **{f"{k}_prefill_tok_s": round(n / v, 1) for k, v in med.items()},
            **{f"{k.removesuffix('_drafter')}_overhead": round(med[k] / med["target_only"] - 1, 4) for k in drafters},
            "runs_s": times,
        }
        rows.append(row)
        print(
            f"{n:>6} tokens: target-only {med['target_only'] * 1e3:8.1f} ms ({n / med['target_only']:9.0f} tok/s) | "
            + " | ".join(f"+{k} {med[k] * 1e3:8.1f} ms ({med[k] / med['target_only'] - 1:+.1%})" for k in drafters),
            flush=True,
        )
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shapes": "small" if args.small else "Qwen3-8B target + Qwen3-8B-DFlash-b16 drafter",
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        json.dump(result, open(args.out, "w"), indent=2)
    return result


if __name__ == "__main__":
    main()
