"""How fast does the capped run's offloaded target decode, and where does the time go? Loads the target run.py
built (/dev/shm/h27-target) through dflash-quant's loader under a --max-memory plan, prints where accelerate put
each module, the hooks it streams with and the bytes pinned, then times the batched greedy decode that
teacher-forced calibration and the check start with (1 token as warm-up, then N tokens: the prefill plus N-1
one-token forwards of all rows), twice:

  as loaded   accelerate's AlignDevicesHook streams each offloaded block; its pre_forward moves every tensor with
              set_module_tensor_to_device(..., clear_cache=True), i.e. one torch.cuda.empty_cache() (a device
              sync and the release of the cached blocks the next copy must cudaMalloc again) per tensor per forward;
              the probe counts those calls
  no flush    the same hooks with that per-tensor cache flush turned off (in this process only)

Side by side on one card, the ratio says whether the flush, rather than the PCIe copy, is the forward's wall.
The copy alone is timed too: every offloaded tensor, host to device, once (the forward's floor).

  python3 benchmarks/hybrid27b/offload_probe.py --max-memory 0=14.11GiB,cpu=39.06GiB --new-tokens 4
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter

import torch

from dflash_quant.loading.target import load_target
from dflash_quant.models.placement import make_placement
from dflash_quant.speculative.teacher import greedy_rows_batched


def _offloaded(model: torch.nn.Module) -> list[torch.Tensor]:
    """The host copies accelerate streams (each once)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
            store = getattr(h, "weights_map", None) if getattr(h, "offload", False) else None
            store = getattr(getattr(store, "dataset", None), "state_dict", store)
            if isinstance(store, dict):
                for t in store.values():
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        seen.setdefault(t.data_ptr(), t)
    return list(seen.values())


def _copy_seconds(tensors: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in tensors:
        t.to("cuda", non_blocking=t.is_pinned())
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="/dev/shm/h27-target")
    ap.add_argument("--max-memory", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    out: dict = {"max_memory": args.max_memory, "rows": args.rows, "new_tokens": args.new_tokens}
    t0 = time.perf_counter()
    loaded = load_target(args.target, "cuda", torch.bfloat16, placement=make_placement("auto", args.max_memory))
    model = loaded.model
    out["load_s"] = round(time.perf_counter() - t0, 1)
    out["map"] = dict(Counter(str(v) for v in model.hf_device_map.values()))
    hooks = [m._hf_hook for m in model.modules() if hasattr(m, "_hf_hook")]
    out["hooks"] = {
        f"{k[0]} offload={k[1]}": n
        for k, n in Counter((type(h).__name__, getattr(h, "offload", None)) for h in hooks).items()
    }
    host = _offloaded(model)
    out["offloaded_tensors"] = len(host)
    out["offloaded_bytes"] = sum(t.numel() * t.element_size() for t in host)
    out["pinned_bytes"] = sum(t.numel() * t.element_size() for t in host if t.is_pinned())
    out["gpu_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    out["copy_once_s"] = round(_copy_seconds(host), 2)
    out["copy_gb_per_s"] = round(out["offloaded_bytes"] / 1e9 / out["copy_once_s"], 1)
    print(json.dumps(out), flush=True)

    flushes = {"n": 0}
    empty = torch.cuda.empty_cache

    def counted() -> None:
        flushes["n"] += 1
        empty()

    torch.cuda.empty_cache = counted  # type: ignore[assignment]
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(96)] for i in range(args.rows)]
    import accelerate.hooks as ah

    original = ah.set_module_tensor_to_device
    for mode in ("as_loaded", "no_flush"):
        if mode == "no_flush":
            ah.set_module_tensor_to_device = functools.partial(original, clear_cache=False)
        for n in (1, args.new_tokens):
            flushes["n"] = 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            greedy_rows_batched(model, prompts, n, [1, 15, 31], torch.device("cuda"), args.rows)
            torch.cuda.synchronize()
            out[f"{mode}_{n}_tokens_s"] = round(time.perf_counter() - t0, 2)
            out[f"{mode}_{n}_tokens_flushes"] = flushes["n"]
            print(f"{mode}: {args.rows} rows x {n} tokens {out[f'{mode}_{n}_tokens_s']} s, "
                  f"{flushes['n']} cache flushes", flush=True)  # fmt: skip
    ah.set_module_tensor_to_device = original
    out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    n = args.new_tokens
    out["per_forward_s"] = {m: round(out[f"{m}_{n}_tokens_s"] / n, 2) for m in ("as_loaded", "no_flush")}
    out["flush_speedup"] = round(out[f"as_loaded_{n}_tokens_s"] / out[f"no_flush_{n}_tokens_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
