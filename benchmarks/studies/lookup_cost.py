"""Cost of one lookup history search vs one target verify forward, at a long history (CPU unless --device).

    python benchmarks/studies/lookup_cost.py --history 32768

The target is the shipped reference target (6 layers, hidden 256) with its rope stretched to the history
length; its verify forward of one block (8 tokens) reads a KV cache of `history` tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_quant.loading.runtime import resolve_device
from dflash_quant.speculative.lookup import LookupSettings, continuation
from dflash_quant.speculative.target_cache import make_cache


def _time(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", type=int, default=32768)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block", type=int, default=8)
    args = ap.parse_args()
    dev = resolve_device(args.device)
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_quant.reference import pair_dir

    path = pair_dir("reference") / "target"
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = args.history + 64
    target = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).to(dev).eval()
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(2, config.vocab_size, (args.history,), generator=gen).to(dev)
    history[-6:] = history[1000:1006]  # a real match to find
    settings = LookupSettings("prefer", 2, 4)
    search = _time(lambda: continuation(history, settings, args.block - 1), 50)
    with torch.inference_mode():
        cache = make_cache(target.config)
        for lo in range(0, args.history, 4096):  # prefill in chunks
            target(history[lo : lo + 4096][None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        blk = history[-args.block :][None]
        pos = torch.arange(args.history, args.history + args.block, device=dev)[None]

        def verify():
            target(blk, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)
            cache.crop(-args.block)

        forward = _time(verify, 10)
    print(f"device {dev}, history {args.history} tokens, torch threads {torch.get_num_threads()}")
    print(
        f"lookup search (n-gram 2-4): {search * 1e3:.3f} ms; target verify forward ({args.block} tokens, reference "
        f"target, {args.history}-token cache): {forward * 1e3:.2f} ms; ratio {search / forward:.4f}"
    )


if __name__ == "__main__":
    main()
