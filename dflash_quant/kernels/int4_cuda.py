"""Our CUDA int4 kernel (int4_cuda.cu): the codes pre-shuffled once at load so that each lane's one 16-byte piece
is its B operand for eight tensor-core MMAs. Built on first use by torch's extension builder (nvcc and ninja,
cached under TORCH_EXTENSIONS_DIR); where it cannot be built, `build_problem` says why and `auto` moves on.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("int4_cuda.cu")
MAX_ROWS = 32  # rows per launch (two 16-row MMA tiles); more run in launches of 32, past 64 through a bf16 GEMM
PREFILL_ROWS = 64
WARPS = 8  # as in the .cu: warps per block
CHUNK = 128  # inputs per packed tile


def _lane_index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(output row in the tile, input column in the chunk) of nibble s of word i of lane l: [32, 4, 8] each."""
    lane, word, nib = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(8), indexing="ij")
    row = lane // 4
    col = 16 * (2 * word + (nib & 3) // 2) + 2 * (lane % 4) + 8 * (nib & 1) + nib // 4
    return row.to(device), col.to(device)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> int32 [N * K / 8]: for tile (n // 8, k // 128) the 16 bytes of each of the 32
    lanes, lane l's word i holding in nibble s the code of output 8 * tile + l // 4 at input
    16 * (2i + (s & 3) // 2) + 2 * (l % 4) + 8 * (s & 1) + s // 4 of the tile (the MMA B-fragment order). In
    memory: pair of tiles, chunk, tile of the pair, lane, word (a warp's pair streams contiguously)."""
    n, k = codes.shape
    if n % 16 or k % CHUNK:
        raise ValueError(f"the CUDA int4 layout needs out % 16 == 0 and in % 128 == 0 (got {n}x{k})")
    tiles = codes.to(torch.int64).view(n // 8, 8, k // CHUNK, CHUNK).permute(0, 2, 1, 3)  # [NT, KT, 8, 128]
    row, col = _lane_index(codes.device)
    words = torch.zeros(n // 8, k // CHUNK, 32, 4, dtype=torch.int64, device=codes.device)
    for s in range(8):
        words |= tiles[:, :, row[..., s], col[..., s]] << (4 * s)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as int32
    pairs = words.view(n // 16, 2, k // CHUNK, 32, 4).permute(0, 2, 1, 3, 4)  # [NT/2, KT, 2, 32, 4]
    return pairs.to(torch.int32).reshape(-1)


def lane_words(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The packed words as [tile, chunk, lane, word] (uint32 values in int64)."""
    pairs = packed.to(torch.int64).view(n // 16, k // CHUNK, 2, 32, 4) & 0xFFFFFFFF
    return pairs.permute(0, 2, 1, 3, 4).reshape(n // 8, k // CHUNK, 32, 4)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack` (tests)."""
    words = lane_words(packed, n, k)
    row, col = _lane_index(packed.device)
    tiles = torch.zeros(n // 8, k // CHUNK, 8, CHUNK, dtype=torch.int64, device=packed.device)
    for s in range(8):
        tiles[:, :, row[..., s], col[..., s]] = (words >> (4 * s)) & 0xF
    return tiles.permute(0, 2, 1, 3).reshape(n, k).to(torch.uint8)


def shape_problem(out_f: int, in_f: int, group: int) -> str | None:
    """Why the kernel's layout cannot hold this Linear (None: it can)."""
    if out_f % 16 or in_f % CHUNK:
        return f"the CUDA kernel needs in % 128 == 0 and out % 16 == 0 (got {out_f}x{in_f})"
    if not (group in (32, 64) or group % CHUNK == 0) or in_f % group:
        return f"the CUDA kernel needs a group of 32, 64 or a multiple of 128 that divides the input (got {group})"
    return None


def toolchain_problem() -> str | None:
    """Why torch's extension builder cannot compile the kernel here (None: nvcc and ninja are there)."""
    from torch.utils import cpp_extension

    # the builder runs $PYTORCH_NVCC, else CUDA_HOME/bin/nvcc (CUDA_HOME: the env variable or where nvcc is found)
    home = cpp_extension.CUDA_HOME
    if not os.environ.get("PYTORCH_NVCC") and (home is None or not Path(home, "bin", "nvcc").exists()):
        return "nvcc (the CUDA toolkit) was not found; set CUDA_HOME to build the CUDA kernel"
    if not cpp_extension.is_ninja_available():
        return "ninja was not found (pip install ninja) to build the CUDA kernel"
    return None


@functools.cache
def build_problem(device: torch.device) -> str | None:
    """Why the kernel cannot be built or run on `device` (None: it is built and loaded)."""
    if device.type != "cuda":
        return "int4 kernels need CUDA"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "the CUDA kernel needs compute capability 8.0 or newer (bf16 tensor-core MMA)"
    problem = toolchain_problem()
    if problem:
        return problem
    try:
        module()
    except Exception as exc:  # noqa: BLE001  # a failed build is a reason to pass over this kernel
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return f"the CUDA kernel did not build: {first[:200]}"
    return None


def build(source: Path, prefix: str = "dflash_quant_int4") -> Any:
    """An extension compiled from `source` (this module's kernel, or another version of it for the benchmarks), named
    by its content so that each version is built once and then loaded from torch's extension cache."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return load(
        name=f"{prefix}_{digest}", sources=[str(source)], extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], verbose=False
    )


@functools.cache
def module() -> Any:
    """The compiled kernel."""
    return build(SOURCE)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_SPLIT = 8  # the last block adds up to 8 splits' partials in one round of loads (16 took two: slower on the H200)


def config(n: int, k: int, group: int, device: torch.device, variant: int = 0, per_sm: int | None = None) -> int:
    """Split-K for an [n, k] weight at 16 rows: as many blocks as fit on the GPU at once, in one wave, each
    with at least 4 of the 128-wide chunks (fewer, and the partials' traffic and the pipeline's fill dominate),
    and at most MAX_SPLIT of them along K. per_sm: blocks an SM in place of the kernel's occupancy (benchmarks)."""
    outputs, fit = _kernel_shape(group, device, variant)
    per_sm = fit if per_sm is None else per_sm
    columns = -(-n // outputs)
    return max(1, min(per_sm * _sm_count(device) // columns, (k // CHUNK) // 4, MAX_SPLIT))


@functools.cache
def _kernel_shape(group: int, device: torch.device, variant: int) -> tuple[int, int]:
    """(outputs per block, blocks per SM) at 16 rows: one occupancy query per group and device, not per Linear."""
    with torch.cuda.device(device):
        outputs, per_sm = module().kernel_shape(group, 16, variant)
    return int(outputs), int(per_sm)


class CudaWeights:
    """One Linear in the kernel's layout: packed codes, fp16 scales [G, N], uint8 zeros [G, N], its split-K, and
    the split-K counters (one per block column; every launch leaves them at zero, so launches of one Linear must
    not overlap: one stream, as the drafter runs)."""

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int):
        self.out_features, self.in_features = int(codes.shape[0]), int(codes.shape[1])
        self.group = group
        self.qweight = pack(codes)
        self.scales = scales.to(torch.float16).contiguous()
        self.zeros = zeros.to(torch.uint8).contiguous()
        self.split = config(self.out_features, self.in_features, group, codes.device)
        # one counter per block column (of 16 * WARPS outputs or more: enough for every variant of the kernel)
        columns = -(-self.out_features // (16 * WARPS))
        self.counters = torch.zeros(columns, dtype=torch.int32, device=codes.device)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros, "counters": self.counters}


def matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    counters: torch.Tensor,
    group: int,
    split: int,
    variant: int = 0,
) -> torch.Tensor:
    """x [M, K] bf16 times the int4 weight [N, K] transposed -> [M, N] bf16 (variant: a development
    configuration of the kernel, benchmarks/gpu_int4.py; 0 is the shipped one)."""
    ext = module()
    rows = x.shape[0]
    if rows > PREFILL_ROWS:  # a prompt's worth of rows: compute-bound, so rebuild the bf16 weight once
        return x @ ext.w4_dequant(qweight, scales, zeros, group).T
    x = x.contiguous()
    if x.data_ptr() % 16:  # the kernel reads x in 16-byte pieces
        x = x.clone()
    if rows <= MAX_ROWS:
        return ext.w4a16_mm(x, qweight, scales, zeros, counters, group, split, variant)
    parts = [
        ext.w4a16_mm(x[i : i + MAX_ROWS], qweight, scales, zeros, counters, group, split, variant)
        for i in range(0, rows, MAX_ROWS)
    ]
    return torch.cat(parts)
