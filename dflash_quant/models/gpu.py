"""What this process may still allocate on a GPU: the device's free memory, or less under an allocator cap."""

from __future__ import annotations

import torch


def room(free: int, total: int, fraction: float, reserved: int) -> int:
    """Bytes left: `free`, or less where the allocator is capped at `fraction` of `total` with `reserved` held."""
    if fraction >= 1:
        return free
    return max(0, min(free, int(fraction * total) - reserved))


def gpu_room(device: torch.device) -> int:
    """room() of a CUDA device as it is now: a cap set by torch.cuda.set_per_process_memory_fraction (gptq
    --gpu-memory-limit) counts, so batches and GPTQ's solve are sized for the emulated or shared card."""
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = float(get_fraction(device)) if get_fraction is not None else 1.0
    return room(free, total, fraction, torch.cuda.memory_reserved(device))
