"""Measured peak memory of a calibration run.

On CUDA: torch's allocator peak (max_memory_allocated, reset when capture starts), per GPU used.
On CPU there is no allocator peak to read, so the probe adds up the tensors the run can account for: the
resident weights of both models (offloaded ones are on the meta device and count nothing), the Hessians, and
the largest target forward's outputs (hidden states, logits) together with its KV cache at that moment. It is
labelled `cpu_tracked_tensors`, not the process's RSS (which also holds Python, libraries and freed pages).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from dflash_quant.memory.calibration import predict_calibration
from dflash_quant.memory.kv import parse_shape


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4 or obj is None or isinstance(obj, (int, float, str, bool)):
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)
    elif hasattr(obj, "layers"):  # a transformers Cache: per-layer keys/values (and linear-attention states)
        for layer in obj.layers:
            for attr in ("keys", "values", "conv_states", "recurrent_states"):
                yield from _tensors(getattr(layer, attr, None), depth + 1)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors (views of one storage count once; meta counts 0)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_bytes(*models: torch.nn.Module) -> int:
    return tensor_bytes(t for m in models for t in [*m.parameters(), *m.buffers()])


class PeakProbe:
    """Attach before capture, read after: {'measured_bytes', 'measured_kind', 'measured_by_device'}."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module):
        self.target, self.drafter = target, drafter
        self.cuda = sorted(
            {t.device.index or 0 for m in (target, drafter) for t in m.parameters() if t.device.type == "cuda"}
        )
        self.activations = 0
        self._handle: Any = None

    def _hook(self, module, args, kwargs, output) -> None:
        parts = [getattr(output, "hidden_states", None), getattr(output, "logits", None)]
        cache = getattr(output, "past_key_values", None)
        self.activations = max(self.activations, tensor_bytes(_tensors(parts)) + tensor_bytes(_tensors(cache)))

    def __enter__(self) -> PeakProbe:
        for index in self.cuda:
            torch.cuda.reset_peak_memory_stats(index)
        self._handle = self.target.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def result(self, hessians: Iterable[torch.Tensor]) -> dict[str, Any]:
        if self.cuda:
            per = {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in self.cuda}
            return {
                "measured_bytes": sum(per.values()),
                "measured_kind": "cuda_max_memory_allocated",
                "measured_by_device": per,
            }
        total = model_bytes(self.target, self.drafter) + tensor_bytes(hessians) + self.activations
        return {"measured_bytes": total, "measured_kind": "cpu_tracked_tensors", "measured_by_device": None}


def _param_bytes(module: torch.nn.Module, dtype_size: int, resident: bool) -> int:
    """numel x the run's element size of the module's weights that are (resident) or are not (offloaded) loaded."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or (t.device.type == "meta") == resident:
            continue
        seen.add(id(t))
        total += t.numel() * (dtype_size if t.is_floating_point() else t.element_size())
    return total


def cublas_workspace_bytes(device: torch.device) -> int:
    """The cuBLAS workspace torch allocates on `device` (it shows in the allocator peak after the first matmul).

    CUBLAS_WORKSPACE_CONFIG (":KiB:count" pairs) when set, else torch's default: :4096:8 (32 MiB) on Hopper and
    newer, :4096:2:16:8 on older GPUs. Measured on an H200: the calibration peak exceeded the other terms by
    32.0 MiB on the reference pair (benchmarks/gpu_devmap.py)."""
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        nums = [int(v) for v in config.split(":") if v.strip().isdigit()]
        return sum(size * 1024 * count for size, count in zip(nums[::2], nums[1::2], strict=False))
    major = torch.cuda.get_device_capability(device)[0]
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 2 * 1024 + 16 * 8 * 1024


def predict_run(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    target_config: Any,
    drafter_config: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype,
    kv_hessian: str,
    compute: torch.device,
    hessian_device: torch.device,
    rows: int = 1,
    teacher_taps: int = 0,
) -> tuple[Any, int]:
    """(CalibrationPrediction, predicted bytes comparable with PeakProbe.result on this run's devices).

    Weights are counted as numel x the run's element size (what the configs imply), not read from the
    allocator; a target module offloaded by --device-map counts once, as the largest one streamed in.
    rows: prompts decoded as rows of one batch (batched capture)."""

    size = torch.empty((), dtype=dtype).element_size()
    name = str(dtype).replace("torch.", "")
    offloaded = 0
    for mod_name in getattr(target, "hf_device_map", None) or {}:
        module = target.get_submodule(mod_name) if mod_name else target
        offloaded = max(offloaded, _param_bytes(module, size, resident=False))
    pred = predict_calibration(
        parse_shape(target_config),
        _param_bytes(target, size, resident=True),
        parse_shape(drafter_config),
        _param_bytes(drafter, size, resident=True),
        max(len(p) for p in prompts),
        max_new_tokens,
        dtype=name,
        kv_hessian=kv_hessian,
        attention_scores=compute.type == "cpu",
        offloaded_weight_bytes=offloaded,
        cublas_workspace_bytes=cublas_workspace_bytes(compute),
        rows=rows,
        teacher_taps=teacher_taps,
    )
    if compute.type == "cuda":  # the GPU's share: everything but Hessians kept elsewhere
        hess_on_gpu = hessian_device.type == "cuda"
        return pred, pred.peak - (0 if hess_on_gpu else pred.terms["hessians"])
    return pred, pred.resident
