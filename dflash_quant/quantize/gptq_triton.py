"""Triton kernel for one GPTQ column block of a batch of matrices (CUDA only; imported lazily).

GPTQ's rows are independent inside a block given the inverse factor, so each program owns `BR` rows of one
matrix, keeps the block's columns in registers and runs the whole column loop there: one launch per block
instead of about a dozen per column. To stay bit-identical to the textbook's torch code the kernel
- is compiled without FMA contraction (`enable_fp_fusion=False`): torch rounds `err * h` before subtracting;
- divides with IEEE round-to-nearest (`div_rn`) and rounds half to even (`rint`), as torch does;
- divides by the integer `maxq` the way torch does on this device: torch's CUDA division by a Python number
  multiplies by its fp32 reciprocal; `_scalar_division` probes it once per device instead of assuming.
Group parameters of groups that start inside a block are computed in the kernel from the columns as they
are then (errors applied so far); the others are computed before the block, as in the textbook.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dflash_quant.errors import DFlashQuantError
from dflash_quant.quantize.grid import FP16_MAX, FP16_TINY, find_params
from dflash_quant.quantize.spec import QuantSpec

_DIVISION: dict[tuple[str, int], frozenset[str]] = {}


@triton.jit
def _rint(x, INTERPRET: tl.constexpr):
    """Round half to even (torch.round). The interpreter lacks libdevice: there, the fp32 magic-number
    rounding, exact for |x| < 2**22 (larger values are clamped to the grid's ends anyway)."""
    if INTERPRET:
        return tl.where(tl.abs(x) < 4194304.0, (x + 12582912.0) - 12582912.0, x)
    else:
        return libdevice.rint(x)


@triton.jit
def _div_int(x, q, inv, RECIP: tl.constexpr):
    if RECIP:
        return x * inv
    else:
        return tl.div_rn(x, q)


@triton.jit
def _group_params(
    tile,
    gmask,
    MAXQ: tl.constexpr,
    inv_q,
    inv_q1,
    tiny,
    fmax,
    SYM: tl.constexpr,
    V1Z: tl.constexpr,
    RECIP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """grid.find_params over the masked columns of `tile`, per row: (scale, zero, overflowed)."""
    xmax = tl.maximum(tl.max(tl.where(gmask, tile, float("-inf")), axis=1), 0.0)
    xmin = tl.minimum(tl.min(tl.where(gmask, tile, float("inf")), axis=1), 0.0)
    if SYM:
        a = tl.maximum(xmax, -xmin)
        a = tl.where(a == 0, 1.0, a)
        raw = _div_int(2 * a, MAXQ * 1.0, inv_q, RECIP)
    else:
        flat = (xmin == 0) & (xmax == 0)
        xmin = tl.where(flat, -1.0, xmin)
        xmax = tl.where(flat, 1.0, xmax)
        raw = _div_int(xmax - xmin, MAXQ * 1.0, inv_q, RECIP)
        if V1Z:
            low = _rint(tl.div_rn(-xmin, raw), INTERPRET) < 1
            raw = tl.where(low, _div_int(xmax, MAXQ - 1.0, inv_q1, RECIP), raw)
    # fp16 scale rounded up (grid._fp16_scale)
    s16 = tl.maximum(raw, tiny).to(tl.float16)
    up = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    scale = tl.where(s16.to(tl.float32) < raw, up.to(tl.float32), s16.to(tl.float32))
    if SYM:
        zero = tl.zeros_like(scale) + ((MAXQ + 1) // 2)
    else:
        zero = _rint(tl.div_rn(-xmin, scale), INTERPRET)
        zero = tl.minimum(tl.maximum(zero, 1.0 if V1Z else 0.0), MAXQ * 1.0)
    return scale, zero, (raw > fmax).to(tl.int32)


@triton.jit
def _gptq_block(
    W,
    Hinv,
    Q,
    Err,
    S,
    Z,
    G,
    Bad,
    rows,
    cols,
    i1,
    n_groups,
    inv_q,
    inv_q1,
    tiny,
    fmax,
    ncols: tl.constexpr,
    MAXQ: tl.constexpr,
    WIDTH: tl.constexpr,
    SYM: tl.constexpr,
    V1Z: tl.constexpr,
    RECIP: tl.constexpr,
    PRE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = pid * BR + tl.arange(0, BR)
    c = tl.arange(0, BC)
    rmask = r < rows
    cmask = c < ncols
    m2 = rmask[:, None] & cmask[None, :]
    r64 = r.to(tl.int64)
    tile = tl.load(W + b * rows * cols + r64[:, None] * cols + i1 + c[None, :], mask=m2, other=0.0)
    hrow = Hinv + b * cols * cols
    s = tl.zeros([BR], tl.float32) + 1.0
    z = tl.zeros([BR], tl.float32)
    bad = tl.zeros([BR], tl.int32)
    for i in range(0, ncols):
        j = i1 + i
        if PRE:
            g = tl.load(G + b * cols + j).to(tl.int64)
            s = tl.load(S + (b * n_groups + g) * rows + r64, mask=rmask, other=1.0)
            z = tl.load(Z + (b * n_groups + g) * rows + r64, mask=rmask, other=0.0)
        else:
            if i % WIDTH == 0:
                gmask = m2 & (c[None, :] >= i) & (c[None, :] < i + WIDTH)
                s, z, over = _group_params(tile, gmask, MAXQ, inv_q, inv_q1, tiny, fmax, SYM, V1Z, RECIP, INTERPRET)
                bad = tl.maximum(bad, over)
                g = (j // WIDTH).to(tl.int64)
                tl.store(S + (b * n_groups + g) * rows + r64, s, mask=rmask)
                tl.store(Z + (b * n_groups + g) * rows + r64, z, mask=rmask)
        w = tl.max(tl.where(c[None, :] == i, tile, float("-inf")), axis=1)
        q = tl.minimum(tl.maximum(_rint(tl.div_rn(w, s), INTERPRET) + z, 0.0), MAXQ * 1.0)
        tl.store(Q + b * rows * cols + r64 * cols + j, q.to(tl.uint8), mask=rmask)
        d = tl.load(hrow + j * cols + j)
        err = tl.div_rn(w - s * (q - z), d)
        h = tl.load(hrow + j * cols + i1 + c, mask=cmask, other=0.0)
        tile = tl.where(c[None, :] >= i, tile - err[:, None] * h[None, :], tile)
        tl.store(Err + b * rows * ncols + r64 * ncols + i, err, mask=rmask)
    tl.atomic_max(Bad + b, tl.max(bad, axis=0))


def _scalar_division(device: torch.device, q: int) -> frozenset[str]:
    """Which of 'recip' (times the fp32 reciprocal) and 'div' (IEEE division) match torch's division of an
    fp32 tensor by the Python int q on this device (both for a power of two, none would be a surprise)."""
    key = (str(device), q)
    if key not in _DIVISION:
        gen = torch.Generator(device="cpu").manual_seed(q)
        t = ((torch.rand(1 << 16, generator=gen) * 4 + 1e-4) * torch.logspace(-3, 3, 1 << 16)).to(device)
        inv = (torch.ones((), dtype=torch.float32) / q).item()
        got = t / q
        modes = set()
        if torch.equal(got, t * inv):
            modes.add("recip")
        if torch.equal(got, t / torch.full_like(t, float(q))):
            modes.add("div")
        _DIVISION[key] = frozenset(modes)
    return _DIVISION[key]


def _division_mode(device: torch.device, spec: QuantSpec) -> str | None:
    modes = _scalar_division(device, spec.maxq)
    if not spec.sym and spec.v1_zeros:
        modes = modes & _scalar_division(device, spec.maxq - 1)
    return "recip" if "recip" in modes else "div" if modes else None


def supported(spec: QuantSpec, cols: int, block_size: int, precomputed: bool, device: torch.device) -> bool:
    width = spec.group_width(cols)
    if not (precomputed or width % block_size == 0 or block_size % width == 0):
        return False  # a group would start inside a block and run past it: the torch loop handles that
    return _division_mode(device, spec) is not None


def solve_blocks(W, Hinv, col_group, S, Z, spec: QuantSpec, block_size: int, precomputed: bool) -> torch.Tensor:
    """Codes (uint8 [B, rows, cols], permuted columns) for the batch; fills S/Z for dynamic groups."""
    B, rows, cols = W.shape
    width = spec.group_width(cols)
    n_groups = cols // width
    recip = _division_mode(W.device, spec) == "recip"
    in_kernel = not precomputed and width < block_size
    G = col_group.to(torch.int32).contiguous()
    Q = torch.empty(B, rows, cols, dtype=torch.uint8, device=W.device)
    bad = torch.zeros(B, dtype=torch.int32, device=W.device)
    inv_q = (torch.ones((), dtype=torch.float32) / spec.maxq).item()
    inv_q1 = (torch.ones((), dtype=torch.float32) / max(spec.maxq - 1, 1)).item()
    BR, BC = 32, triton.next_power_of_2(block_size)
    grid = (triton.cdiv(rows, BR), B)
    W = W.contiguous()
    Hinv = Hinv.contiguous()
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        if not precomputed and not in_kernel and i1 % width == 0:
            # A group starts at the block's first column: its columns as they are now (textbook's `pending`).
            g = i1 // width
            s, z = find_params(W[:, :, i1 : i1 + width].reshape(B * rows, width), spec)
            S[:, g], Z[:, g] = s.view(B, rows), z.view(B, rows)
        Err = torch.empty(B, rows, i2 - i1, device=W.device)
        _gptq_block[grid](
            W,
            Hinv,
            Q,
            Err,
            S,
            Z,
            G,
            bad,
            rows,
            cols,
            i1,
            n_groups,
            inv_q,
            inv_q1,
            FP16_TINY,
            FP16_MAX,
            ncols=i2 - i1,
            MAXQ=spec.maxq,
            WIDTH=width if in_kernel else 1,
            SYM=spec.sym,
            V1Z=spec.v1_zeros,
            RECIP=recip,
            PRE=not in_kernel,
            INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
            BR=BR,
            BC=BC,
            num_warps=4,
            enable_fp_fusion=False,
        )
        if i2 < cols:
            for b in range(B):  # one matmul per matrix, with the textbook's shapes
                W[b, :, i2:].sub_(Err[b] @ Hinv[b, i1:i2, i2:])
    if in_kernel and bool(bad.any()):
        raise DFlashQuantError(
            "a quantization scale overflows fp16 (weights above ~65504); "
            "check the weights for corruption or keep that layer unquantized"
        )
    return Q
