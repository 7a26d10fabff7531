"""Targets split over devices through transformers/accelerate `device_map` (`--device-map`, `--max-memory`).

The map is parsed and checked against the target built on the meta device (no weights read) before
`from_pretrained` runs, so a typo in a module name or a GPU that does not exist is one `error:` line, not a
traceback after minutes of loading. Tensors crossing devices are moved where they are used: inputs to the
target's embedding device, taps and logits back to the drafter's device (see speculative/decode.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_quant.errors import UsageError
from dflash_quant.models.placement import Placement


def check_map(model: torch.nn.Module, dmap: dict[str, str | int], source: str) -> None:
    """An explicit map against the target's modules (a meta model): every key a module, every weight placed."""
    names = {n for n, _ in model.named_modules()}
    unknown = sorted(k for k in dmap if k not in names)
    if unknown:
        top = sorted(n for n in names if n and "." not in n)
        raise UsageError(
            f"--device-map names {unknown[:3]} which {source} does not have; its top-level modules are {top}"
        )

    def where(name: str) -> str | int | None:  # the most specific entry covering a tensor
        keys = [k for k in dmap if k == "" or name == k or name.startswith(k + ".")]
        return dmap[max(keys, key=len)] if keys else None

    loose = [n for n, _ in list(model.named_parameters()) + list(model.named_buffers()) if where(n) is None]
    if loose:
        raise UsageError(
            f"--device-map leaves {len(loose)} tensors of {source} unplaced (e.g. {loose[0]}); map their modules too"
        )
    from accelerate.utils import find_tied_parameters

    for group in find_tied_parameters(model):  # one tensor shared by modules (a tied lm_head): one device
        devices = {str(where(n)) for n in group}
        if len(devices) > 1:
            raise UsageError(
                f"--device-map puts the tied weights {sorted(group)} of {source} on {sorted(devices)}; "
                "map them to one device"
            )


def meta_target(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The target's module tree on the meta device: names and shapes, no weights read or allocated."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.tie_weights()  # from_config leaves a tied lm_head untied; from_pretrained ties it
    return model


def check_placement(path: Path, placement: Placement, dtype: torch.dtype, source: str) -> None:
    if isinstance(placement.device_map, dict):
        check_map(meta_target(path, dtype), placement.device_map, source)


def load_kwargs(placement: Placement) -> dict[str, Any]:
    """from_pretrained's placement arguments."""
    import logging

    # accelerate warns that offloaded weights sit on the meta device: that is what was asked for
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
    kw: dict[str, Any] = {"device_map": placement.device_map, "offload_folder": placement.offload_folder()}
    if placement.max_memory is not None:  # a copy: accelerate rewrites the sizes it is given as byte counts
        kw["max_memory"] = dict(placement.max_memory)
    return kw


def is_split(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "hf_device_map", None))


def input_device(model: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where the target's input ids go: its embedding's device (accelerate moves them if that is offloaded)."""
    weight = getattr(model.get_input_embeddings(), "weight", None)  # type: ignore[operator]
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return fallback


def device_summary(model: torch.nn.Module) -> dict[str, Any] | None:
    """Where each module of a split target landed, and its weight bytes per device (for provenance)."""
    dmap = getattr(model, "hf_device_map", None)
    if not dmap:
        return None
    per: dict[str, int] = {}
    # A tied lm_head shares the embedding's tensor: counted once. By name too, since accelerate's hooks give an
    # offloaded module new (meta) parameter objects on every forward, after which the tie is no longer one object.
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    seen: set[int] = set()
    for name, dev in dmap.items():
        module = model.get_submodule(name) if name else model
        params = [p for n, p in module.named_parameters(prefix=name) if n not in tied and id(p) not in seen]
        seen.update(id(p) for p in params)
        per[str(dev)] = per.get(str(dev), 0) + sum(p.numel() * p.element_size() for p in params)
    return {"map": {k: str(v) for k, v in dmap.items()}, "weight_bytes": per}


def offload_hooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(module, accelerate hook) for every module whose weights are streamed onto its execution device per forward."""
    found: list[tuple[torch.nn.Module, Any]] = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]) if hook is not None else []:  # SequentialHook holds several
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                found.append((module, h))
    return found


def in_memory(store: Any) -> dict:
    """The host-memory tensors behind a hook's weights_map (a PrefixedDataset over accelerate's loader, whose
    state_dict holds the CPU-offloaded weights; what it lacks is read from the offload folder's files)."""
    loader = getattr(store, "dataset", store)
    held = getattr(loader, "state_dict", loader)
    return held if isinstance(held, dict) else {}


def pin_offloaded(model: torch.nn.Module) -> int:
    """Page-lock the CPU copies accelerate streams onto the GPU for every forward of an offloaded module.

    accelerate keeps an offloaded module's weights as ordinary (pageable) CPU tensors and copies them to the
    execution device before each forward; from pageable memory the driver stages every copy through a bounce
    buffer, at about half the bandwidth of a copy from page-locked memory. A hybrid 27B target under a 24 GB
    cap streams ~41 GB per forward, so the copy rate bounds the forward's speed. Returns the bytes pinned (0 when
    nothing is offloaded to CPU or there is no CUDA).
    """
    if not torch.cuda.is_available():
        return 0
    pinned = 0
    seen: set[int] = set()
    for _, hook in offload_hooks(model):
        device = getattr(hook, "execution_device", None)
        if device is None or torch.device(device).type != "cuda":
            continue
        store = in_memory(hook.weights_map)
        if id(store) in seen:
            continue
        seen.add(id(store))
        for name, tensor in list(store.items()):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not tensor.is_pinned():
                store[name] = tensor.pin_memory()
                pinned += tensor.numel() * tensor.element_size()
    return pinned


def streamed_bytes(model: torch.nn.Module) -> dict[str, int] | None:
    """Weight bytes accelerate copies onto the execution device for every forward of the target, by where it
    reads them: `host` (of which `pinned`: page-locked) and `disk`; None when nothing is streamed. At the 27B
    scale under a 24 GB plan this is tens of GB per token: the floor under a split target's decode."""
    host = pinned = disk = 0
    for module, hook in offload_hooks(model):
        prefix = getattr(hook.weights_map, "prefix", "")
        held = in_memory(hook.weights_map)
        for name, param in module.named_parameters(recurse=bool(getattr(hook, "place_submodules", False))):
            size = param.numel() * param.element_size()
            copy = held.get(prefix + name)
            if isinstance(copy, torch.Tensor):
                host += size
                pinned += size if copy.is_pinned() else 0
            else:
                disk += size
    if host + disk == 0:
        return None
    return {"host": host, "pinned": pinned, "disk": disk}


def resident_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
    """A copy on `device`, without accelerate's hook, of a Linear or Embedding that accelerate offloads (its
    weights streamed onto the execution device on every call); None when the module is not offloaded or of
    another kind. The copy computes what the module computes (the same weights, the same functional call)."""
    hook = getattr(module, "_hf_hook", None)
    store = getattr(hook, "weights_map", None)
    if hook is None or not getattr(hook, "offload", False) or store is None:
        return None
    if type(module) is torch.nn.Linear:  # exact types: a subclass may compute more than its weights
        copy: torch.nn.Module = torch.nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
    elif type(module) is torch.nn.Embedding:
        copy = torch.nn.Embedding(
            module.num_embeddings, module.embedding_dim, module.padding_idx, module.max_norm, module.norm_type,
            module.scale_grad_by_freq, module.sparse, device="meta",
        )  # fmt: skip
    else:
        return None
    try:  # (a tied head keeps its weight under the embedding's name: not ours to copy, it streams as before)
        tensors = {name: store[name].to(device) for name, _ in copy.named_parameters()}
    except KeyError:
        return None
    copy.load_state_dict(tensors, assign=True)
    return copy.requires_grad_(False)
