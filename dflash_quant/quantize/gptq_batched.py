"""GPTQ for many matrices at once, with exactly the textbook's arithmetic per matrix.

The textbook loop (`gptq.gptq_quantize`) is launch-bound on a GPU: about a dozen small kernels per input
column. Here every matrix of one shape (all `down_proj`s, all stacked q/k/v, ...) becomes one batch
[B, rows, cols] with its own Hessian factor, and each 128-column block is one call:

- on CUDA with Triton, one fused kernel per block (`gptq_triton.py`): every row tile keeps the block in
  registers and runs the column loop there;
- elsewhere, the same column loop in torch over the batch dimension (B x fewer launches).

Per matrix nothing changes in the order or kind of floating-point operations: damping, Cholesky factors,
act-order permutation, group parameters and the lazy block updates (`W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]`,
one matmul per matrix with the textbook's shapes) are the textbook's, and the element-wise column steps are
the same IEEE operations, so the codes, scales and zeros are identical (tests/test_gptq_batched.py on CPU,
benchmarks/bench_gptq.py on the GPU compares every code with the textbook's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import UsageError
from dflash_quant.models.gpu import gpu_room
from dflash_quant.quantize.gptq import DAMP_TRIES, Setup, set_up, split_rows
from dflash_quant.quantize.grid import QuantizedWeight, dequantize_codes, find_params, quantize_codes
from dflash_quant.quantize.spec import QuantSpec

KERNELS = ("auto", "triton", "torch")


@dataclass
class _Prepared(Setup):
    """One problem after the textbook's set-up (gptq.set_up), with its place in the caller's list."""

    index: int = -1


def _prepare(index, weight, hessian, spec, desc_act, static_groups, damp_percent, damp_tries, name, clip=False):
    """The textbook's set-up for one matrix; a QuantizedWeight (RTN fallback) when the Hessian is hopeless."""
    setup = set_up(weight, hessian, spec, desc_act, static_groups, damp_percent, damp_tries, name, clip, stacklevel=3)
    if isinstance(setup, QuantizedWeight):
        return setup
    return _Prepared(**vars(setup), index=index)


def _use_triton(kernel: str, device: torch.device) -> bool:
    if kernel == "torch" or device.type != "cuda":
        if kernel == "triton":
            raise UsageError("the Triton GPTQ kernel needs a CUDA device; use kernel='torch' or 'auto'")
        return False
    try:
        from dflash_quant.quantize import gptq_triton  # noqa: F401
    except ImportError as exc:
        if kernel == "triton":
            raise UsageError(f"the Triton GPTQ kernel is not available ({exc}); use kernel='torch' or 'auto'") from exc
        return False
    return True


def _solve(batch: list[_Prepared], spec: QuantSpec, block_size: int, precomputed: bool, triton: bool):
    """The column loop for a batch of same-shape problems; returns codes [B, out, in] (permuted) and params."""
    B = len(batch)
    W = torch.stack([p.W for p in batch])
    Hinv = torch.stack([p.Hinv for p in batch])
    col_group = torch.stack([p.col_group for p in batch])
    _, rows, cols = W.shape
    width = spec.group_width(cols)
    n_groups = cols // width
    if precomputed:
        S = torch.stack([cast(torch.Tensor, p.scales) for p in batch]).contiguous()  # [B, n_groups, rows]
        Z = torch.stack([cast(torch.Tensor, p.zeros) for p in batch]).contiguous()
    else:
        S = torch.zeros(B, n_groups, rows, device=W.device)
        Z = torch.zeros(B, n_groups, rows, device=W.device)
    if triton:
        from dflash_quant.quantize import gptq_triton

        if gptq_triton.supported(spec, cols, block_size, precomputed, W.device):
            return gptq_triton.solve_blocks(W, Hinv, col_group, S, Z, spec, block_size, precomputed), S, Z
    Q = torch.empty_like(W)
    maxq = spec.maxq
    batch_ix = torch.arange(B, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if not precomputed and j % width == 0:
                g = j // width
                end = j + width
                c = W1[:, :, i : min(end, i2) - i1]
                if end > i2:
                    pending = torch.stack([W[b, :, i2:end] - Err1[b, :, :i] @ Hinv[b, i1:j, i2:end] for b in range(B)])
                    c = torch.cat([c, pending], dim=2)
                s, z = find_params(c.reshape(B * rows, -1), spec)
                S[:, g], Z[:, g] = s.view(B, rows), z.view(B, rows)
            if precomputed:
                s, z = S[batch_ix, col_group[:, j]], Z[batch_ix, col_group[:, j]]
            else:
                s, z = S[:, j // width], Z[:, j // width]
            w = W1[:, :, i]
            q = quantize_codes(w, s, z, maxq)
            Q[:, :, j] = q
            err = (w - dequantize_codes(q, s, z)) / Hinv1[:, i, i].unsqueeze(1)
            W1[:, :, i:].sub_(err.unsqueeze(2) * Hinv1[:, i, i:].unsqueeze(1))
            Err1[:, :, i] = err
        if i2 < cols:
            for b in range(B):  # one matmul per matrix, with the textbook's shapes
                W[b, :, i2:].sub_(Err1[b] @ Hinv[b, i1:i2, i2:])
    return Q, S, Z


def _batch_bytes(rows: int, cols: int) -> int:
    return 4 * (3 * rows * cols + 2 * cols * cols)  # W, codes, scratch; Hinv and its stacked copy


def _cap(device: torch.device, max_bytes: int | None) -> int:
    if max_bytes is not None:
        return max_bytes
    if device.type == "cuda":
        return gpu_room(device) // 3  # under --gpu-memory-limit: of what its cap leaves
    return 2 << 30


def gptq_quantize_many(
    problems: list[tuple[torch.Tensor, torch.Tensor | HessianAccumulator, str]],
    spec: QuantSpec,
    *,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
    block_size: int = 128,
    damp_tries: int = DAMP_TRIES,
    kernel: str = "auto",
    max_batch_bytes: int | None = None,
    clip: bool = False,
) -> list[QuantizedWeight]:
    """GPTQ of independent (weight [out, in], Hessian [in, in], name) problems; results in input order.

    Equal to `gptq_quantize` on each problem (same codes, scales, zeros, g_idx, damp, fallbacks).
    """
    static_groups = static_groups or clip  # as in gptq_quantize: searched parameters are fixed up front
    if kernel not in KERNELS:
        raise UsageError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if not damp_percent > 0:
        raise UsageError(
            f"damp_percent must be > 0 (a fraction of the mean Hessian diagonal, e.g. 0.01), got {damp_percent}"
        )
    if block_size <= 0:
        raise UsageError(f"block_size must be positive, got {block_size}")
    results: list[QuantizedWeight | None] = [None] * len(problems)
    by_shape: dict[tuple, list[int]] = {}
    for index, (weight, _, _) in enumerate(problems):
        by_shape.setdefault((tuple(weight.shape), weight.device), []).append(index)
    precomputed = spec.group_size == -1 or static_groups
    for (shape, device), indices in by_shape.items():
        triton = _use_triton(kernel, device)
        # Set up and solve a chunk at a time, so at most a chunk's copies and factors are alive at once.
        per_batch = max(1, _cap(device, max_batch_bytes) // _batch_bytes(*shape))
        for start in range(0, len(indices), per_batch):
            batch = []
            for index in indices[start : start + per_batch]:
                weight, hessian, name = problems[index]
                p = _prepare(
                    index, weight, hessian, spec, desc_act, static_groups, damp_percent, damp_tries, name, clip
                )
                if isinstance(p, QuantizedWeight):
                    results[index] = p
                else:
                    batch.append(p)
            if not batch:
                continue
            Q, S, Z = _solve(batch, spec, block_size, precomputed, triton)
            for b, p in enumerate(batch):
                in_features = shape[1]
                g_idx = torch.empty(in_features, dtype=torch.int32, device=device)
                g_idx[p.order] = p.col_group.to(torch.int32)
                codes = torch.empty(shape, dtype=torch.uint8, device=device)
                codes[:, p.order] = Q[b].to(torch.uint8)
                results[p.index] = QuantizedWeight(
                    codes=codes,
                    scales=S[b].clone(),
                    zeros=Z[b].to(torch.int32),
                    g_idx=g_idx,
                    spec=spec,
                    desc_act=desc_act,
                    static_groups=static_groups,
                    damp_used=p.damp_used,
                    fallback=None,
                    name=problems[p.index][2],
                )
            del Q, S, Z, batch
    return results  # type: ignore[return-value]


def gptq_quantize_groups(
    groups: list[tuple[list[torch.Tensor], torch.Tensor | HessianAccumulator, list[str]]], spec: QuantSpec, **kwargs
) -> list[list[QuantizedWeight]]:
    """Several shared-input groups (q/k/v, gate/up, ...) at once: per group, `gptq_quantize_shared`'s result.

    Each group's weights are stacked along the output dim (as `gptq_quantize_shared` does) into one problem;
    problems of one shape are then solved as a batch.
    """
    problems = []
    for weights, hessian, names in groups:
        stacked = weights[0] if len(weights) == 1 else torch.cat([w.detach().float() for w in weights])
        problems.append((stacked, hessian, names[0] if len(names) == 1 else "+".join(names)))
    solved = gptq_quantize_many(problems, spec, **kwargs)
    out = []
    for (weights, _, names), qw in zip(groups, solved, strict=False):
        if len(weights) == 1:
            out.append([qw])
            continue
        out.append(split_rows(qw, weights, names))
    return out
