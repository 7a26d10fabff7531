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
  python3 benchmarks/hybrid27b/offload_probe.py --max-memory 0=14.11GiB,cpu=39.06GiB --placement-only   # CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter

import torch

from dflash_quant.loading.target import load_target
from dflash_quant.memory.presets import preset_path
from dflash_quant.models.devmap import in_memory, offload_hooks
from dflash_quant.models.placement import make_placement
from dflash_quant.speculative.teacher import greedy_rows_batched


def _host_copies(model: torch.nn.Module) -> list[torch.Tensor]:
    """The host copies accelerate streams (each once)."""
    seen: dict[int, torch.Tensor] = {}
    for _, hook in offload_hooks(model):
        for t in in_memory(hook.weights_map).values():
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                seen.setdefault(t.data_ptr(), t)
    return list(seen.values())


def meta_27b() -> torch.nn.Module:
    """The Qwen3.5-27B preset's module tree on the meta device (no weights): what accelerate places."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    tc = dict(json.loads(preset_path("qwen3.5-27b").read_text())["text_config"])
    interval = tc.pop("full_attention_interval")
    tc["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(tc["num_hidden_layers"])
    ]
    config = AutoConfig.for_model(tc.pop("model_type"), **tc)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def placement(max_memory: str) -> dict:
    """Where accelerate's own placement (what `--device-map auto` runs) puts the 27B tree under `max_memory`, and
    what it leaves in host memory: modules, tensors and bytes streamed onto the GPU for every forward. CPU only."""
    from accelerate import infer_auto_device_map

    model = meta_27b()
    limits = {(int(k) if k.isdigit() else k): v for k, v in (kv.split("=") for kv in max_memory.split(","))}
    dmap = infer_auto_device_map(
        model, max_memory=limits, no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16
    )
    host = [p for name, dev in dmap.items() if dev == "cpu" for p in model.get_submodule(name).parameters()]
    return {
        "max_memory": max_memory,
        "modules": dict(Counter(str(v) for v in dmap.values())),
        "host_tensors": len(host),
        "host_bytes": sum(p.numel() * p.element_size() for p in host),
        "disk_modules": sorted(k for k, v in dmap.items() if v == "disk"),
    }


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
    ap.add_argument(
        "--placement-only", action="store_true", help="only where the plan puts the 27B tree (meta model, on CPU)"
    )
    args = ap.parse_args()
    if args.placement_only:
        print(json.dumps(placement(args.max_memory)))
        return
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
    host = _host_copies(model)
    out["offloaded_tensors"] = len(host)
    out["offloaded_bytes"] = sum(t.numel() * t.element_size() for t in host)
    out["streamed_bytes"] = loaded.streamed  # host (of which pinned) and disk, as gptq records it
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
