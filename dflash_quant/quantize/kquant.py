"""GPTQ on llama.cpp's own grids (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K, IQ4_NL): every code, sub-block scale/min and
super-block scale is exactly what that GGUF type stores, so the file is written without requantizing.

Grids (ggml block layouts; gguf-py's `gguf.quants` dequantizes them in fp32 in this order):
  Q6_K   super-block 256 = 16 x 16; w = (d*sc)*(u-32), u 6-bit, sc int8 [-128, 127], d fp16
  Q5_K   super-block 256 = 8 x 32; w = (d*sc)*q - (dmin*m), q 5-bit, sc/m 6-bit, d/dmin fp16
  Q4_K   super-block 256 = 8 x 32; w = (d*sc)*q - (dmin*m), q 4-bit, sc/m 6-bit, d/dmin fp16
  Q3_K   super-block 256 = 16 x 16; w = (d*sc)*(u-4), u 3-bit, sc signed 6-bit [-32, 31], d fp16
  Q2_K   super-block 256 = 16 x 16; w = (d*sc)*q - (dmin*m), q 2-bit, sc/m 4-bit, d/dmin fp16
  IQ4_NL block 32;                   w = d*K[u], u 4-bit index into llama.cpp's fixed 16-value codebook K
Every product above is exact in fp32 (fp16 mantissa x <= 8-bit integers), so our fp32 dequantization and
gguf-py's agree bit for bit.

The solver is GPTQ with lazy blocks of one super-block: when a super-block starts, its columns already carry
the error feedback of every earlier column, and its scales are chosen on those updated weights with the
Hessian diagonal as per-column importance (a weighted least-squares search like llama.cpp's imatrix path,
then the integer sub-block scales/mins searched +-1 around the rounded value under the same weighted error).
Then, when GPTQ reaches each sub-block (scale_search > 0, the default 2 of `gptq --gguf-scale-search`), its
integer scale/min is re-chosen within +-scale_search of that fit by the GPTQ loss of running the sub-block's
columns on each candidate: the full Hessian in the loop, not only its diagonal (chosen on the calibration
prompts: fit on one half, error measured on the other; benchmarks/kquant_scale_search.py).
Inside the super-block each column is rounded on that fixed grid and its error spread over later columns
through the Cholesky factor of H^-1. Where this differs from llama.cpp's own quantizer: (1) error feedback;
(2) the scales see the updated weights, not the original ones; (3) importance is diag(X^T X) of the drafter's
own inputs (llama.cpp without an imatrix weights by x^2 of the weights themselves); (4) the scale search
is one weighted least-squares sweep plus the in-loop search above, not llama.cpp's iterative make_q3_quants /
make_qkx2_quants.
Per-tensor mixes (Q4_K_M, Q3_K_M, ...) assign one of these grids to each tensor as llama-quantize does
(dflash_quant/quantize/kmix.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_quant.calibration.capture import input_group
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.gguf_names import gguf_name
from dflash_quant.quantize.drafter import QuantOutcome, select_linears
from dflash_quant.quantize.kmix import MIXES, tensor_types

IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class KGrid:
    name: str
    block: int  # weights per (super-)block along a row
    sub: int  # weights per sub-block (one scale each)
    levels: int  # codes per weight
    scale_max: int  # largest integer sub-block scale/min (0: the fp16 block scale itself)
    has_min: bool
    bytes_per_block: int

    @property
    def signed(self) -> bool:
        """Q3_K/Q6_K: symmetric codes u - levels/2 under signed integer sub-block scales."""
        return not self.has_min and self.name != "IQ4_NL"

    @property
    def scale_lo(self) -> int:
        return -(self.scale_max + 1) if self.signed else 0

    @property
    def code_bits(self) -> int:
        return int(math.log2(self.levels))

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes_per_block / self.block


GRIDS = {
    "Q6_K": KGrid("Q6_K", 256, 16, 64, 127, False, 210),
    "Q5_K": KGrid("Q5_K", 256, 32, 32, 63, True, 176),
    "Q4_K": KGrid("Q4_K", 256, 32, 16, 63, True, 144),
    "Q3_K": KGrid("Q3_K", 256, 16, 8, 31, False, 110),
    "Q2_K": KGrid("Q2_K", 256, 16, 4, 15, True, 84),
    "IQ4_NL": KGrid("IQ4_NL", 32, 32, 16, 0, False, 18),
}


def grid_for(name: str) -> KGrid:
    """The grid of a pure type, or the default grid of a per-tensor mix (kmix.MIXES)."""

    if name in MIXES:
        return GRIDS[MIXES[name].base]
    if name not in GRIDS:
        raise UsageError(
            f"--gguf-type {name!r} is not supported; use a pure type ({', '.join(GRIDS)}) "
            f"or a llama.cpp mix ({', '.join(MIXES)})"
        )
    return GRIDS[name]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504.0, 65504.0).half().float()


@dataclass
class KQuantWeight:
    """One Linear on a llama.cpp grid: codes [out, in] (Q3_K/Q6_K: u = q + levels/2; IQ4_NL: codebook index),
    d/dmin [out, blocks] (fp16 values in fp32), sc/m [out, sub-blocks] integers."""

    grid: KGrid
    codes: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    name: str = ""
    damp_used: float | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def steps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column (step, offset) [out, in] so that w = step * code - offset (IQ4_NL: step = d, offset 0)."""
        return column_grid(self.grid, self.d, self.dmin, self.sc, self.m)

    def dequantize(self) -> torch.Tensor:
        return decode(self.grid, self.codes, *self.steps())


def column_grid(grid: KGrid, d, dmin, sc, m) -> tuple[torch.Tensor, torch.Tensor]:
    per_block = grid.block // grid.sub
    if grid.name == "IQ4_NL":
        step = d
        off = torch.zeros_like(d)
    else:
        step = d.repeat_interleave(per_block, dim=1) * sc.float()
        off = dmin.repeat_interleave(per_block, dim=1) * m.float()
    return step.repeat_interleave(grid.sub, dim=1), off.repeat_interleave(grid.sub, dim=1)


def decode(grid: KGrid, codes: torch.Tensor, step: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    if grid.name == "IQ4_NL":
        return step * torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    if grid.signed:
        return step * (codes.float() - grid.levels // 2)
    return step * codes.float() - off


def encode(grid: KGrid, w: torch.Tensor, step: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Nearest code on the fixed grid (elementwise; float codes)."""
    if grid.name == "IQ4_NL":
        values = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=w.device)
        return (step.unsqueeze(-1) * values - w.unsqueeze(-1)).abs().argmin(-1).float()
    safe = torch.where(step == 0, torch.ones_like(step), step)
    if grid.signed:
        half = grid.levels // 2
        q = torch.round(w / safe).clamp(-half, half - 1) + half
        return torch.where(step == 0, torch.full_like(q, half), q)
    q = torch.round((w + off) / safe).clamp(0, grid.levels - 1)
    return torch.where(step == 0, torch.zeros_like(q), q)


# ------------------------------------------------------------------------------------------ scale choice


def _wls_affine(x, w, nmax, rmin, rdelta, nstep):
    """Per sub-block (scale >= 0, min >= 0) with x ~ scale*lv - min, lv in [0, nmax], minimising sum w*err^2."""
    xmin = torch.minimum(x.amin(-1), torch.zeros_like(x[..., 0]))
    xmax = x.amax(-1)
    span = (xmax - xmin).clamp(min=1e-30)
    best_s, best_mn = span / nmax, xmin
    lv = torch.round((x - xmin.unsqueeze(-1)) / best_s.unsqueeze(-1)).clamp(0, nmax)
    best_err = (w * (best_s.unsqueeze(-1) * lv + xmin.unsqueeze(-1) - x) ** 2).sum(-1)
    sw = w.sum(-1).expand_as(xmax)
    sx = (w * x).sum(-1)
    for k in range(nstep + 1):
        iscale = (rmin + rdelta * k + nmax) / span
        lv = torch.round(iscale.unsqueeze(-1) * (x - xmin.unsqueeze(-1))).clamp(0, nmax)
        sl, sl2, slx = (w * lv).sum(-1), (w * lv * lv).sum(-1), (w * lv * x).sum(-1)
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        s = (sw * slx - sx * sl) / det
        mn = (sl2 * sx - sl * slx) / det
        pos = mn > 0
        s = torch.where(pos, slx / sl2.clamp(min=1e-30), s)
        mn = torch.where(pos, torch.zeros_like(mn), mn)
        s = s.clamp(min=0)
        err = (w * (s.unsqueeze(-1) * lv + mn.unsqueeze(-1) - x) ** 2).sum(-1)
        better = ok & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_mn = torch.where(better, mn, best_mn)
    return best_s, -best_mn


def _wls_symmetric(x, w, nmax, values=None):
    """Per sub-block signed scale s with x ~ s*lv (lv in [-nmax, nmax-1], or the codebook), weighted LS."""
    idx = x.abs().argmax(-1, keepdim=True)
    peak = torch.gather(x, -1, idx).squeeze(-1)
    peak = torch.where(peak == 0, torch.ones_like(peak), peak)
    best_s = torch.zeros_like(peak)
    best_err = (w * x * x).sum(-1)
    top = -values[0] if values is not None else nmax
    for k in range(-9, 10):  # the peak maps to the grid's end, +-22 %
        s0 = -peak / (top + top / 40 * k)
        if values is not None:
            vals = torch.tensor(values, dtype=x.dtype, device=x.device)
            lv = vals[(s0.unsqueeze(-1).unsqueeze(-1) * vals - x.unsqueeze(-1)).abs().argmin(-1)]
        else:
            lv = torch.round(x / s0.unsqueeze(-1)).clamp(-nmax, nmax - 1)
        s = (w * lv * x).sum(-1) / (w * lv * lv).sum(-1).clamp(min=1e-30)
        err = (w * (s.unsqueeze(-1) * lv - x) ** 2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
    return best_s


def _block_error(grid, x, w, d, dmin, sc, m):
    step, off = column_grid(grid, d, dmin, sc, m)
    deq = decode(grid, encode(grid, x, step, off).long(), step, off)
    return w * (deq - x) ** 2


def fit_block(grid: KGrid, x: torch.Tensor, imp: torch.Tensor):
    """Grid parameters for one (super-)block of columns x [rows, block] under per-column importance imp [block]:
    (d, dmin) [rows, 1] fp16 values and (sc, m) [rows, sub-blocks] integers."""
    rows = x.shape[0]
    nsub = grid.block // grid.sub
    xs = x.reshape(rows, nsub, grid.sub)
    ws = imp.reshape(1, nsub, grid.sub).expand_as(xs)
    if grid.name == "IQ4_NL":
        s = _wls_symmetric(xs, ws, 0, IQ4NL_VALUES).reshape(rows, 1)
        d = _fp16(s)
        zero = torch.zeros(rows, 1, dtype=torch.int16, device=x.device)
        return d, torch.zeros_like(d), zero, zero
    if grid.has_min:
        nmax = grid.levels - 1
        rmin, nstep = (-1.0, 20) if grid.name == "Q4_K" else (-0.5, 15)  # llama.cpp's make_qkx2_quants ranges
        s, mins = _wls_affine(xs, ws, nmax, rmin, 0.1, nstep)
        d = _fp16(s.amax(-1, keepdim=True) / grid.scale_max)
        dmin = _fp16(mins.amax(-1, keepdim=True) / grid.scale_max)
        sc = torch.round(s / torch.where(d == 0, torch.ones_like(d), d)).clamp(0, grid.scale_max)
        m = torch.round(mins / torch.where(dmin == 0, torch.ones_like(dmin), dmin)).clamp(0, grid.scale_max)
    else:  # Q3_K/Q6_K: signed integer sub-block scales under a signed fp16 d (the peak maps to scale_lo)
        s = _wls_symmetric(xs, ws, grid.levels // 2)
        peak = torch.gather(s, -1, s.abs().argmax(-1, keepdim=True))
        d = _fp16(peak / grid.scale_lo)
        sc = torch.round(s / torch.where(d == 0, torch.ones_like(d), d)).clamp(grid.scale_lo, grid.scale_max)
        dmin = torch.zeros_like(d)
        m = torch.zeros_like(sc)
    # integer sub-block scale/min: the best of +-1 around the rounded values under the weighted error
    lo = grid.scale_lo
    best_sc, best_m = sc.clone(), m.clone()
    best = _block_error(grid, x, imp, d, dmin, sc, m).reshape(rows, nsub, grid.sub).sum(-1)
    for dsc in (-1, 0, 1):
        for dm in (-1, 0, 1) if grid.has_min else (0,):
            if dsc == 0 and dm == 0:
                continue
            tsc = (sc + dsc).clamp(lo, grid.scale_max)
            tm = (m + dm).clamp(0, grid.scale_max)
            err = _block_error(grid, x, imp, d, dmin, tsc, tm).reshape(rows, nsub, grid.sub).sum(-1)
            better = err < best
            best = torch.where(better, err, best)
            best_sc = torch.where(better, tsc, best_sc)
            best_m = torch.where(better, tm, best_m)
    return d, dmin, best_sc.to(torch.int16), best_m.to(torch.int16)


# ------------------------------------------------------------------------------------------ solvers


def _inverse_factor(H: torch.Tensor, damp: float, tries: int = 4) -> tuple[torch.Tensor, float]:
    mean = H.diagonal().mean()
    for _ in range(tries):
        Hd = H.clone()
        Hd.diagonal().add_(damp * mean)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info) == 0 and torch.isfinite(U).all():
                return U, damp
        damp *= 10
    raise DFlashQuantError(f"Hessian is not positive definite even at damp {damp:g}; recollect calibration statistics")


def _check(weight: torch.Tensor, grid: KGrid, name: str) -> None:
    if weight.dim() != 2:
        raise DFlashQuantError(f"layer {name!r}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if weight.shape[1] % grid.block:
        raise UsageError(
            f"layer {name!r}: input width {weight.shape[1]} is not a multiple of {grid.block}, "
            f"so {grid.name} cannot hold it; pick another --gguf-type or --skip the layer"
        )
    if not torch.isfinite(weight).all():
        raise DFlashQuantError(f"layer {name!r}: weight has NaN/inf values; fix the checkpoint before quantizing")


def rtn_kquant(weight: torch.Tensor, grid: KGrid, imp: torch.Tensor | None = None, name: str = "") -> KQuantWeight:
    """Round-to-nearest on the grid, scales from the same weighted search (imp: per-column importance)."""
    _check(weight, grid, name)
    W = weight.detach().float()
    imp = torch.ones(W.shape[1]) if imp is None else imp.float()
    parts = [
        fit_block(grid, W[:, i : i + grid.block], imp[i : i + grid.block]) for i in range(0, W.shape[1], grid.block)
    ]
    d, dmin, sc, m = (torch.cat(p, dim=1) for p in zip(*parts, strict=False))
    step, off = column_grid(grid, d, dmin, sc, m)
    codes = encode(grid, W, step, off).to(torch.uint8)
    return KQuantWeight(grid, codes, d, dmin, sc, m, name=name)


def _search_in_loop(grid, X, U, d, dmin, sc, m, radius):
    """Integer scale/min of one sub-block chosen with the Hessian in the loop: for every candidate (sc + i,
    m + j), |i|, |j| <= radius, run GPTQ over the sub-block's columns X [rows, sub] (error feedback inside it
    through U, the sub-block's slice of the Cholesky factor of H^-1) and keep, per row, the candidate with the
    least GPTQ loss sum_i ((w_i - q_i) / U_ii)^2, the sub-block's share of tr(E H E^T)."""
    span = range(-radius, radius + 1)
    pairs = [(i, j) for i in span for j in (span if grid.has_min else (0,))]
    dsc = torch.tensor([p[0] for p in pairs], dtype=sc.dtype).unsqueeze(1)
    dm = torch.tensor([p[1] for p in pairs], dtype=m.dtype).unsqueeze(1)
    tsc = (sc.unsqueeze(0) + dsc).clamp(grid.scale_lo, grid.scale_max)  # [C, rows]
    tm = (m.unsqueeze(0) + dm).clamp(0, grid.scale_max)
    step = d.unsqueeze(0) * tsc.float()
    off = dmin.unsqueeze(0) * tm.float()
    Xc = X.unsqueeze(0).repeat(len(pairs), 1, 1)
    loss = torch.zeros(len(pairs), X.shape[0])
    for i in range(X.shape[1]):
        w = Xc[:, :, i]
        deq = decode(grid, encode(grid, w, step, off).long(), step, off)
        err = (w - deq) / U[i, i]
        Xc[:, :, i:] -= err.unsqueeze(2) * U[i, i:]
        loss += err * err
    best = loss.argmin(0, keepdim=True)
    return tsc.gather(0, best).squeeze(0), tm.gather(0, best).squeeze(0)


def _block_pass(grid, W1, U1, d, dmin, sc, m, scale_search):
    """GPTQ over one super-block (columns W1 [rows, block] already carrying all earlier feedback) on the given
    scales; returns (codes, d, dmin, sc, m, errors scaled by U's diagonal)."""
    W1 = W1.clone()
    sc, m = sc.clone(), m.clone()
    step, off = column_grid(grid, d, dmin, sc, m)
    codes = torch.empty(W1.shape, dtype=torch.uint8)
    Err1 = torch.zeros_like(W1)
    searched = scale_search > 0 and grid.name != "IQ4_NL"
    for i in range(grid.block):
        if searched and i % grid.sub == 0:  # the sub-block's columns now carry all earlier feedback
            j, e = i // grid.sub, i + grid.sub
            sc[:, j], m[:, j] = _search_in_loop(
                grid, W1[:, i:e], U1[i:e, i:e], d[:, 0], dmin[:, 0], sc[:, j], m[:, j], scale_search
            )
            step[:, i:e] = (d * sc[:, j : j + 1].float()).expand(-1, grid.sub)
            off[:, i:e] = (dmin * m[:, j : j + 1].float()).expand(-1, grid.sub)
        w = W1[:, i]
        q = encode(grid, w, step[:, i], off[:, i])
        deq = decode(grid, q.long(), step[:, i], off[:, i])
        codes[:, i] = q.to(torch.uint8)
        err = (w - deq) / U1[i, i]
        W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
        Err1[:, i] = err
    return codes, d, dmin, sc, m, Err1


def gptq_kquant(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: KGrid,
    *,
    damp: float = 0.01,
    name: str = "",
    scale_search: int = 0,
) -> KQuantWeight:
    """GPTQ of weight [out, in] against H [in, in] on `grid` (lazy blocks = one super-block). scale_search > 0:
    each sub-block's integer scale/min is re-chosen, within +-scale_search of the weighted fit, by the GPTQ loss
    of that sub-block when GPTQ reaches it (_search_in_loop); 0 keeps the diagonal-weighted fit alone."""
    _check(weight, grid, name)
    W = weight.detach().float().clone()
    H = hessian.detach().float().to(W.device).clone()
    if tuple(H.shape) != (W.shape[1], W.shape[1]) or not torch.isfinite(H).all():
        raise DFlashQuantError(f"layer {name!r}: Hessian {tuple(H.shape)} does not fit the weight or has NaN/inf")
    dead = H.diagonal() == 0
    H.diagonal().masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(0), 0.0)
    imp = H.diagonal().clone()
    U, damp_used = _inverse_factor(H, damp)
    rows, n = W.shape
    B = grid.block
    codes = torch.empty(rows, n, dtype=torch.uint8)
    ds, dmins, scs, ms = [], [], [], []
    for i1 in range(0, n, B):
        i2 = i1 + B
        U1 = U[i1:i2, i1:i2]
        d, dmin, sc, m = fit_block(grid, W[:, i1:i2], imp[i1:i2])
        q, d, dmin, sc, m, Err1 = _block_pass(grid, W[:, i1:i2], U1, d, dmin, sc, m, scale_search)
        codes[:, i1:i2] = q
        ds.append(d)
        dmins.append(dmin)
        scs.append(sc)
        ms.append(m)
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return KQuantWeight(
        grid,
        codes,
        torch.cat(ds, 1),
        torch.cat(dmins, 1),
        torch.cat(scs, 1),
        torch.cat(ms, 1),
        name=name,
        damp_used=damp_used,
    )


def relative_error(weight: torch.Tensor, deq: torch.Tensor, hessian: torch.Tensor) -> float:
    E = weight.float() - deq.float()
    num = ((E @ hessian) * E).sum()
    den = ((weight.float() @ hessian) * weight.float()).sum()
    return math.sqrt(max(float(num / den), 0.0)) if den > 0 else float("nan")


# ------------------------------------------------------------------------------------------ whole drafter


def quantize_drafter_kquant(model, stats, settings, gguf_type: str, progress=None, scale_search: int = 2):
    """GPTQ (or RTN) of the chosen Linears on a llama.cpp grid; weights replaced in place by their exact
    dequantized values (so the parity check measures what the GGUF holds). scale_search: gptq_kquant's in-loop
    sub-block scale/min search radius. Returns a QuantOutcome whose weights are KQuantWeights."""
    import time

    grid_for(gguf_type)
    settings = settings.normalized()
    if settings.calibrated and stats is None:
        raise UsageError("GPTQ needs calibration statistics; run calibration or use --method rtn")
    if settings.sequential or settings.desc_act:
        raise UsageError(f"--gguf-type {gguf_type} runs plain GPTQ in column order; drop --sequential/--desc-act")
    if settings.clip_search:  # the k-quant grids have their own search of each sub-block's scale
        raise UsageError(f"--clip-search is for GPTQ v1 grids; with --gguf-type {gguf_type} use --gguf-scale-search")
    chosen, kept = select_linears(model, settings)
    grids = plan_grids(model, chosen, gguf_type)
    for name in chosen:
        _check(model.get_submodule(name).weight, grids[name], name)
    outcome = QuantOutcome(weights={}, kept=kept)
    t0 = time.perf_counter()
    kv_mode = stats.kv_hessian if stats is not None else "block"
    for name in chosen:
        module = model.get_submodule(name)
        weight = module.weight.detach().float().cpu().clone()  # the module's weight is overwritten below
        acc = stats.hessians.get(input_group(name, kv_mode)) if stats is not None else None
        hessian = acc.hessian().cpu() if acc is not None else None
        grid = grids[name]
        if settings.calibrated:
            if acc is None or acc.rows < settings.min_rows:
                raise DFlashQuantError(
                    f"too few calibration rows reached {name}; raise --num-prompts or --max-new-tokens"
                )
            assert hessian is not None  # acc checked above
            qw = gptq_kquant(weight, hessian, grid, damp=settings.damp, name=name, scale_search=scale_search)
        else:
            qw = rtn_kquant(weight, grid, None if hessian is None else hessian.diagonal(), name=name)
        deq = qw.dequantize()
        with torch.no_grad():
            module.weight.copy_(deq.to(module.weight.device, module.weight.dtype))
        outcome.weights[name] = qw
        outcome.layers.append(
            {
                "name": name,
                "shape": list(weight.shape),
                "method": "gptq" if settings.calibrated else "rtn",
                "gguf_type": grid.name,
                "bits_per_weight": grid.bits_per_weight,
                "hessian_rows": acc.rows if acc is not None else None,
                "damp": qw.damp_used,
                "fallback": None,
                "rel_output_error": round(relative_error(weight, deq, hessian), 6) if hessian is not None else None,
            }
        )
        if progress:
            progress(name)
    outcome.seconds = time.perf_counter() - t0
    return outcome


def plan_grids(model, linears: list[str], gguf_type: str) -> dict[str, KGrid]:
    """Linear name -> grid: every Linear on a pure type, or llama.cpp's per-tensor choice for a mix."""

    cfg = model.config
    names = {gguf_name(f"{n}.weight"): n for n in linears}
    types = tensor_types(
        gguf_type, list(names), int(cfg.num_hidden_layers), int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    )
    return {names[t]: GRIDS[k] for t, k in types.items()}
