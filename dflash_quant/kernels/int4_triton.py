"""W4A16 split-K matmul in Triton for a few rows (the drafter's 8-16 token block), on GPTQ v1's own layout.

Operands (no repacking of the codes):
  qweight int32 [K/8, N]   code of input k of output n in bits 4*(k%8) of word [k//8, n] (GPTQ v1), unsigned;
  scales  fp16  [G, N]     as stored in the checkpoint;
  zeros   fp16  [G, N]     integer zero points (exact in fp16);
  groups: input k belongs to group k // group_size (act-order weights are permuted to this order at load).

Each program dequantizes [BLOCK_K, BLOCK_N] tiles as bf16((q - z) * s) computed in fp32, which is bit for bit
the bf16 weight the dequantized path holds, and multiplies them with the rows of x on the tensor cores (fp32
accumulation). With SPLIT_K > 1 several programs share one output tile: each stores its fp32 partial sum in a
workspace and counts itself in on the tile's counter; the last to arrive adds the partials in split order
and writes bf16 (one launch, no atomics on data, the same bits every run), then resets the counter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Autotuned per (rows bucket, N, K, group): split-K fills the GPU when N alone gives too few programs.
# WIDE_LOAD: read each packed word once ([BLOCK_K/8, BLOCK_N]) and spread its 8 codes with a reshape, instead
# of one (cached) load per code; SWAP_AB: multiply W x^T so that the weight tile is the MMA's wide operand.
# Which is faster depends on the shape, so they are tuned.
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "SPLIT_K": sk, "WIDE_LOAD": wide, "SWAP_AB": swap}, num_warps=4, num_stages=3)
    for bn in (32, 64, 128)
    for sk in (1, 2, 4, 8, 16)
    for wide in (False, True)
    for swap in (False, True)
]
if os.environ.get("DFLASH_INT4_TUNE") == "extended":  # benchmarks only: other warps and pipeline depths
    _CONFIGS = [
        triton.Config({"BLOCK_N": bn, "SPLIT_K": sk, "WIDE_LOAD": wide, "SWAP_AB": swap}, num_warps=w, num_stages=st)
        for bn in (64, 128)
        for sk in (4, 8, 16)
        for wide in (False, True)
        for swap in (False, True)
        for w, st in ((4, 3), (4, 4), (8, 3))
    ]
MAX_SPLIT_K = 16
MIN_BLOCK_N = 32


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: any count gives a valid plan
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(n: int, k: int, block_n: int, bk: int, sms: int) -> int:
    """The smallest power-of-two split-K that gives about two programs per SM (capped by the K blocks)."""
    tiles = triton.cdiv(n, block_n)
    most = min(MAX_SPLIT_K, max(1, k // bk))
    split = 1
    while tiles * split < 2 * sms and split * 2 <= most:
        split *= 2
    return split


def _prune(configs, named_args, **kwargs):
    """Keep the configs near the occupancy heuristic: BLOCK_N 64/128 with the split-K that fills the GPU and
    half of it, both load styles and operand orders (<= 16 per shape). Tuning all 30 compiled ~30 kernels per shape, which is what
    ate the first GPU run; a pinned config list (tests) or DFLASH_INT4_TUNE=extended is kept whole."""
    if len(configs) <= 16 or os.environ.get("DFLASH_INT4_TUNE") == "extended":
        return configs
    n, k = int(named_args["N"]), int(named_args["K"])
    sms = _sm_count(named_args["x_ptr"].device)
    keep = []
    for c in configs:
        bn, sk = c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"]
        best = split_for(n, k, bn, kwargs["BLOCK_K"], sms)
        if bn in (64, 128) and sk in (best, max(1, best // 2)):
            keep.append(c)
    return keep or configs


@triton.autotune(configs=_CONFIGS, key=["M_BUCKET", "N", "K", "GROUP"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _w4a16_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    M_BUCKET: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WIDE_LOAD: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_BUCKET)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    per_split = tl.cdiv(K, BLOCK_K * SPLIT_K)
    shift = (tl.arange(0, BLOCK_K) % 8) * 4
    acc = tl.zeros((BLOCK_N, M_BUCKET) if SWAP_AB else (M_BUCKET, BLOCK_N), dtype=tl.float32)
    for i in range(0, per_split):
        b = pid_k * per_split + i
        live = b * BLOCK_K < K  # the last split may hold fewer blocks: its extra iterations load nothing
        offs_k = b * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & live, other=0.0)
        if WIDE_LOAD:
            offs_w = b * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            words = tl.load(q_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask_n[None, :] & live, other=0)
            nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BLOCK_K/8, 8, BLOCK_N]
            bits = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))  # row 8*r + i: code i of word r
        else:
            words = tl.load(q_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask_n[None, :] & live, other=0)
            bits = (words >> shift[:, None]) & 0xF
        g = (b * BLOCK_K) // GROUP  # BLOCK_K divides GROUP: one group per tile
        scale = tl.load(s_ptr + g * N + offs_n, mask=mask_n & live, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g * N + offs_n, mask=mask_n & live, other=0.0).to(tl.float32)
        # q as the float 2^23 + q (int -> float conversions run at a quarter of the ALU rate and bounded the
        # first version); (2^23 + q) - (2^23 + z) = q - z exactly, then bf16((q - z) * s) as dequantized
        codes = (bits | 0x4B000000).to(tl.float32, bitcast=True)
        w = (codes - (zero + 8388608.0)[None, :]) * scale[None, :]
        if FP32_DOT:  # interpreter: its bf16 dot is wrong and its bf16 cast truncates, so the fp32 weight
            wd = w
            xd = x.to(tl.float32)
        else:
            wd = w.to(tl.bfloat16)
            xd = x
        if SWAP_AB:  # out^T = W x^T: the weight tile is the MMA's A operand, x (16 rows) the narrow B
            acc += tl.dot(tl.trans(wd), tl.trans(xd), input_precision="ieee" if FP32_DOT else None)
        else:
            acc += tl.dot(xd, wd, input_precision="ieee" if FP32_DOT else None)
    if SWAP_AB:
        acc = tl.trans(acc)
    tile = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + tile, acc.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M_BUCKET * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count below publishes it
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros((M_BUCKET, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + s * M_BUCKET * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, total.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """W^T [K, N] from the codes, each element bf16((q - z) * s) in fp32 as in the matmul kernel's tiles
    (fp32 out under the interpreter, whose bf16 cast truncates; the caller rounds it)."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    words = tl.load(q_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
    codes = (((words >> ((offs_k % 8) * 4)[:, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    gn = (offs_k // GROUP)[:, None] * N + offs_n[None, :]
    scale = tl.load(s_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + gn, mask=mask, other=0.0).to(tl.float32) + 8388608.0  # codes hold 2^23 + q
    w = (codes - zero) * scale
    tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_t(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The bf16 weight, transposed ([in, out]), in one pass over the codes: for inputs of many rows (the
    drafter taking in a prompt), where a bf16 GEMM is compute-bound and rebuilding the weight once is cheap."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, device=qweight.device, dtype=torch.float32 if _INTERPRET else torch.bfloat16)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 64))
    args = (qweight.contiguous(), scales.contiguous(), zeros.contiguous(), w, n, k)
    _dequant_kernel[grid](*args, GROUP=group_size, BLOCK_K=64, BLOCK_N=64)
    return w.to(torch.bfloat16)


def block_k(group_size: int) -> int:
    """The K tile: the largest of 128/64/32/16 that divides the group (one scale row per tile)."""
    for bk in (128, 64, 32, 16):
        if group_size % bk == 0:
            return bk
    raise ValueError(f"group size {group_size} is not a multiple of 16")


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace and tile counters, shared by every layer on a device: kernels on one stream
    run one after another, and each leaves its counters at zero."""
    need = MAX_SPLIT_K * bucket * n
    ws, count = _SCRATCH.get(device, (None, None))
    if ws is None or count is None or ws.numel() < need or count.numel() < triton.cdiv(n, MIN_BLOCK_N):
        size = max(need, ws.numel() if ws is not None else 0)
        tiles = max(triton.cdiv(n, MIN_BLOCK_N), count.numel() if count is not None else 0)
        ws = torch.empty(size, device=device, dtype=torch.float32)
        count = torch.zeros(tiles, device=device, dtype=torch.int32)
        _SCRATCH[device] = (ws, count)
    return ws, count


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tuned config per (rows bucket, N, K, group, device): after its first call a shape launches the JIT kernel
# directly, without the autotuner's per-call key building (host time is most of a 16-row GEMM's cost).
_TUNED: dict[tuple[int, int, int, int, torch.device], dict] = {}
# Up to 32 rows are tuned: a step's k/v see the block and the newly committed context (17..32 rows). More
# rows (the drafter's context over a prompt, once per request) run untuned: one compilation.
TUNED_ROWS = 32
PREFILL_CONFIG = {"BLOCK_N": 64, "SPLIT_K": 1, "WIDE_LOAD": False, "SWAP_AB": False, "num_warps": 4, "num_stages": 3}


def reset_tuning() -> None:
    """Forget tuned configs (tests that pin `_w4a16_kernel.configs`)."""
    _TUNED.clear()
    _w4a16_kernel.cache.clear()


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] bf16 (M <= 64) times the int4 weight [N, K] transposed -> [M, N] bf16 (tuned for M <= 32)."""
    m, k = x.shape
    n = qweight.shape[1]
    bucket = 16 if m <= 16 else triton.next_power_of_2(m)
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    ws, count = _scratch(x.device, bucket, n)
    x = x.contiguous()
    args = (x, qweight, scales, zeros, out, ws, count, m, n, k, x.stride(0))
    consts = {
        "M_BUCKET": bucket,
        "GROUP": group_size,
        "BLOCK_K": block_k(group_size),
        "FP32_DOT": _INTERPRET,
    }
    key = (bucket, n, k, group_size, x.device)
    tuned = _TUNED.get(key, PREFILL_CONFIG if bucket > TUNED_ROWS else None)
    if tuned is None:

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

        _w4a16_kernel[grid](*args, **consts)
        _TUNED[key] = _w4a16_kernel.best_config.all_kwargs()
    else:
        _w4a16_kernel.fn[(triton.cdiv(n, tuned["BLOCK_N"]), tuned["SPLIT_K"])](*args, **consts, **tuned)
    return out


def tuned_configs() -> dict[str, dict]:
    """The config each shape runs with (reported by benchmarks/gpu_int4.py)."""
    return {f"rows<={b} N={n} K={k} g{g}": cfg for (b, n, k, g, _), cfg in _TUNED.items()}
