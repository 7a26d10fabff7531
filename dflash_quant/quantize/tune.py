"""End-to-end tuning of a GPTQ grid on the drafter's own objective (method `gptq-kl`).

GPTQ fits each Linear to its own inputs; what speculation needs is the drafter's next-token distribution at
every block position. Starting from GPTQ's grid, each group's scale gets a learned multiplier exp(a) (a = 0 at
the start) and, with `codes`, each code an offset that can move it by one step; zero points stay. The loss is
KL(bf16 drafter || quantized drafter) over the vocabulary at the block rows after the anchor (all, or those the
bf16 drafter's own drafts reach), plus optionally the cross-entropy to the target's token there, on the drafter
inputs calibration recorded while the drafter speculated with its target (the target's taps are replayed, the
target does not run). The result is still a plain grid (fp16 scales, integer codes), so every format and engine
loads it unchanged.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_quant.calibration.capture import DraftCall
from dflash_quant.errors import DFlashQuantError
from dflash_quant.models.model import (
    DFlashAttention,
    DFlashDecoderLayer,
    DFlashDrafter,
    DraftCache,
    visibility_mask,
)
from dflash_quant.quantize.grid import FP16_MAX, FP16_TINY, QuantizedWeight
from dflash_quant.quantize.kquant import KQuantWeight, column_grid, decode
from dflash_quant.quantize.settings import TUNE_CODE_STEP_MAX, TUNE_CODE_TRAVEL, TUNE_EPOCHS, TUNE_LR, TUNE_ROWS


@dataclass
class TuneReport:
    """What tuning did: the loss on the calibration replay before and after, and how far the scales moved."""

    epochs: int
    prompts: int  # calibration prompts whose recorded drafter inputs the tuning ran on
    position_decay: float  # each row's KL weighs exp(-(k-1)/decay) at block position k; 0: uniform
    lr: float
    code_travel: float | None  # None: codes were not tuned
    code_step: float | None  # each signed step: min(code_travel / steps, TUNE_CODE_STEP_MAX)
    steps: int
    seconds: float
    kl_before: float
    kl_after: float
    kept_gptq_scales: bool  # tuning did not lower the loss, so GPTQ's scales and codes were kept
    scale_change: dict[str, float] = field(default_factory=dict)  # per Linear: mean |log(new / old)|
    codes_changed: dict[str, float] = field(default_factory=dict)  # per Linear: share of codes moved one step
    norms: bool = False  # the RMSNorm weights were tuned too (one multiplier per channel)
    norm_change: dict[str, float] = field(default_factory=dict)  # per RMSNorm (norms): mean |log(new / old)|
    rows: str = "all"  # the block rows scored: all, or those the bf16 drafter's drafts reach
    target_weight: float = 0.0  # weight of the cross-entropy to the target's token in the loss

    def loss(self) -> str:
        """The tuned loss in words (kl_before / kl_after are its value per scored row)."""
        text = "KL to the bf16 drafter"
        if self.target_weight > 0:
            text += f" + {self.target_weight:g} x cross-entropy to the target's token"
        return text + (", on the rows the bf16 drafter reaches" if self.rows == "reached" else ", on every block row")

    def to_dict(self) -> dict:
        return {
            "method": "kl-scales+codes" if self.code_travel is not None else "kl-scales",
            "epochs": self.epochs,
            "prompts": self.prompts,
            "position_decay": self.position_decay,
            "lr": self.lr,
            "code_travel": self.code_travel,
            "code_step": None if self.code_step is None else round(self.code_step, 8),
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "loss": self.loss(),
            "rows": self.rows,
            "target_weight": self.target_weight,
            "kl_before": round(self.kl_before, 6),
            "kl_after": round(self.kl_after, 6),
            "kept_gptq_scales": self.kept_gptq_scales,
            "mean_abs_log_scale_change": {k: round(v, 6) for k, v in self.scale_change.items()},
            "codes_changed": {k: round(v, 6) for k, v in self.codes_changed.items()},
            **(
                {"norms": True, "mean_abs_log_norm_change": {k: round(v, 6) for k, v in self.norm_change.items()}}
                if self.norms
                else {}
            ),
        }


class _Tunable(nn.Module, ABC):
    """A Linear whose weight is rebuilt from trained grid parameters once per optimizer step: integer codes with
    an offset `v` per weight (in [-1, 1], so a code moves by at most one step; the rounding passes its gradient
    straight through) and a log multiplier `log_mult` on the grid's scales."""

    codes: torch.Tensor
    maxq: float
    log_mult: nn.Parameter

    def __init__(self, codes: torch.Tensor, maxq: float, movable: bool, bias: torch.Tensor | None):
        super().__init__()
        # plain attributes, not buffers: this module lives only while tuning runs, and mypy sees Tensors
        self.codes = codes.float()
        self.maxq = maxq
        self.offset = nn.Parameter(torch.zeros_like(self.codes)) if movable else None
        self.bias = bias
        self.step_weight: torch.Tensor | None = None  # built once per optimizer step, read by every forward

    def tuned_codes(self) -> torch.Tensor:
        if self.offset is None:
            return self.codes
        c = self.codes + self.offset
        return (c + (torch.round(c) - c).detach()).clamp(0, self.maxq)

    @abstractmethod
    def build(self, dtype: torch.dtype) -> None:
        """Set step_weight from the current parameters (once per optimizer step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step_weight is None:
            self.build(x.dtype)
        weight = cast(torch.Tensor, self.step_weight)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


class _ScaledCodes(_Tunable):
    """GPTQ v1: weight = scale[g] * exp(a[g]) * (round(code + v) - zero[g])."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, codes: bool):
        super().__init__(qw.codes.to(device), float(qw.spec.maxq), codes, bias)
        self.g_idx = qw.g_idx.long().to(device)
        self.zero = qw.zeros.to(device).float()[self.g_idx].T
        self.scales = qw.scales.to(device).float()
        self.log_mult = nn.Parameter(torch.zeros_like(self.scales))

    def tuned_scales(self) -> torch.Tensor:
        return self.scales * self.log_mult.exp()

    def build(self, dtype: torch.dtype) -> None:
        self.step_weight = (self.tuned_scales()[self.g_idx].T * (self.tuned_codes() - self.zero)).to(dtype)


class _KScaledCodes(_Tunable):
    """The same tuning on a llama.cpp k-quant grid: each row's super-block gets a learned multiplier on its fp16
    `d` and, for the grids with mins, on `dmin` alike, so the block scales around zero as a GPTQ v1 group does (a
    multiplier on d alone would pivot around the block's minimum); the integer sub-block scales and mins stay,
    and each code gets an offset of at most one step (IQ4_NL's codebook indices are not steps, so only its d is
    tuned). Every tuned value is stored as the GGUF stores it (fp16 d/dmin, integer codes)."""

    def __init__(self, qw: KQuantWeight, bias: torch.Tensor | None, device: torch.device, codes: bool):
        super().__init__(qw.codes.to(device), float(qw.grid.levels - 1), codes and qw.grid.name != "IQ4_NL", bias)
        self.grid = qw.grid
        self.d = qw.d.to(device).float()
        self.dmin = qw.dmin.to(device).float()
        self.sc = qw.sc.to(device)
        self.m = qw.m.to(device)
        self.log_mult = nn.Parameter(torch.zeros_like(self.d))
        self.stored_min: torch.Tensor | None = None  # set once tuning ends: dmin as the file stores it

    def tuned_scales(self) -> torch.Tensor:
        return self.d * self.log_mult.exp()

    def tuned_mins(self) -> torch.Tensor:
        if self.stored_min is not None:
            return self.stored_min
        return self.dmin * self.log_mult.exp() if self.grid.has_min else self.dmin

    def build(self, dtype: torch.dtype) -> None:
        step, off = column_grid(self.grid, self.tuned_scales(), self.tuned_mins(), self.sc, self.m)
        self.step_weight = decode(self.grid, self.tuned_codes(), step, off).to(dtype)

    def round_to_stored(self) -> None:
        """d and dmin exactly as the GGUF will hold them, fp16 each (zero blocks stay zero)."""
        if self.grid.has_min:
            self.stored_min = _fp16_signed(self.dmin * self.log_mult.exp(), self.dmin != 0)
        live = self.d != 0
        stored = _fp16_signed(self.d * self.log_mult.exp(), live)
        self.log_mult.copy_(torch.where(live, (stored / torch.where(live, self.d, 1.0)).log(), 0.0))


Tuned = _ScaledCodes | _KScaledCodes


def _fp16_nearest(scale: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(scale).all() or (scale > FP16_MAX).any():
        raise DFlashQuantError("scale tuning diverged (a scale left the fp16 range); rerun with a lower --tune-lr")
    return scale.clamp(min=FP16_TINY).half().float()


def _fp16_signed(x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """fp16 values of x where live (k-quant d may be negative), zero elsewhere."""
    return torch.where(live, x.sign() * _fp16_nearest(torch.where(live, x.abs(), 1.0)), torch.zeros_like(x))


def _store_kquant(qw: KQuantWeight, tuned: _KScaledCodes) -> float:
    """Write the tuned fp16 d (and dmin) into qw; the mean |log change| of its nonzero d."""
    live = qw.d != 0
    new_d = _fp16_signed(tuned.tuned_scales().detach().to(qw.d.device), live)
    change = float((new_d[live] / qw.d[live]).log().abs().mean()) if live.any() else 0.0
    qw.d = new_d
    if tuned.stored_min is not None:
        qw.dmin = tuned.stored_min.detach().to(qw.dmin.device)
    return change


class _NormScale:
    """An RMSNorm whose weight is w0 x exp(b) during tuning (b per channel, 0 at the start): its Parameter is
    swapped for the tensor rebuilt each step, and put back as a Parameter at the end."""

    def __init__(self, module: nn.Module, requires_grad: bool):
        self.module, self.requires_grad = module, requires_grad
        self.w0 = cast(nn.Parameter, module.weight)
        self.log_mult = nn.Parameter(torch.zeros(self.w0.shape, dtype=torch.float32, device=self.w0.device))
        del module.weight

    def build(self) -> None:
        self.module.weight = (self.w0.detach().float() * self.log_mult.exp()).to(self.w0.dtype)

    def restore(self, keep_tuned: bool) -> float:
        """Put the Parameter back (tuned, or w0); returns the mean |log(new / old)| of what it now holds."""
        if keep_tuned:
            with torch.no_grad():
                new = (self.w0.float() * self.log_mult.exp()).to(self.w0.dtype)
            self.module.weight = nn.Parameter(new, requires_grad=self.requires_grad)
            return float(self.log_mult.detach().abs().mean())
        self.module.weight = self.w0
        return 0.0


def norm_modules(drafter: nn.Module) -> list[tuple[str, nn.Module]]:
    """The drafter's RMSNorms with a weight (every engine loads them as stored, in bf16 or f32)."""
    return [
        (n, m)
        for n, m in drafter.named_modules()
        if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)
    ]


def _kl(student: torch.Tensor, teacher_logp: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) summed over rows (each times its weight, if given), in fp32."""
    logq = F.log_softmax(student.float(), dim=-1)
    per_row = (teacher_logp.exp() * (teacher_logp - logq)).sum(-1)
    return per_row.sum() if row_weight is None else (per_row * row_weight).sum()


def position_weights(sizes: Sequence[int], decay: float) -> torch.Tensor:
    """One weight per scored row of packed blocks of these sizes: exp(-(k-1)/decay) for block position k (1: the
    first row after the anchor). A block's position k is accepted only when 1..k-1 were, so its error costs tau
    less the later it sits; decay 0: every row weighs 1."""
    pos = torch.cat([torch.arange(size - 1, dtype=torch.float32) for size in sizes])
    return torch.ones_like(pos) if decay <= 0 else torch.exp(-pos / decay)


def packed_labels(calls: Sequence[DraftCall]) -> torch.Tensor:
    """The target's token at each scored row of a packed prompt (rows after each anchor, as packed_rows orders
    them); -1 where the run ended before that position."""
    if any(c.labels is None for c in calls):
        raise DFlashQuantError(
            "the recorded calibration inputs carry no target tokens (recorded by an older dflash-quant); "
            "delete the --calib-cache directory or its checkpoint and calibrate again"
        )
    return torch.cat([cast(torch.Tensor, c.labels)[1 : c.noise.shape[1]] for c in calls])


def reached_rows(sizes: Sequence[int], teacher_tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1 for each scored row the bf16 drafter's own drafts reach (every earlier row of its block drafted the
    target's token), else 0: only those rows count toward its acceptance. Rows past the run's end are 0."""
    hit = (teacher_tokens == labels) & (labels >= 0)
    out = []
    start = 0
    for size in sizes:
        h = hit[start : start + size - 1].float()
        before = torch.cat([h.new_ones(1), h[:-1]]).cumprod(0)  # row k: rows 1..k-1 all hit
        out.append(before * (labels[start : start + size - 1] >= 0).float())
        start += size - 1
    return torch.cat(out) if out else hit.float()


def replay_rows(drafter: DFlashDrafter, calls: Sequence[DraftCall]) -> list[torch.Tensor]:
    """The drafter's post-norm block rows after the anchor, one tensor per recorded forward of one prompt, as the
    decode loop computed them: one forward per call, the context K/V cached between calls."""
    p = next(drafter.parameters())
    cache = DraftCache()
    out = []
    for call in calls:
        h = drafter(
            call.noise.to(p.device, p.dtype), call.ctx.to(p.device, p.dtype), call.positions.to(p.device), cache=cache
        )
        out.append(h[:, 1:])
    return out


@dataclass
class Packed:
    """A prompt's recorded forwards as one forward: every context row, then every block padded to the block size."""

    noise: torch.Tensor  # [1, calls*B, H]
    ctx: torch.Tensor  # [1, C, taps*H]
    position_ids: torch.Tensor  # [1, C + calls*B]
    masks: dict[tuple[bool, int | None], torch.Tensor]  # per attention kind: bool [1, 1, calls*B, C + calls*B]
    sizes: list[int]  # real rows of each block
    block: int


def pack(drafter: DFlashDrafter, calls: Sequence[DraftCall]) -> Packed:
    """Block k sees the context rows of calls <= k (what the cache held) and its own real rows; on top, each
    attention kind's own positional rule (causal, sliding window) as the decode loop applies it. Padding rows
    sit after a block's real rows, are never visible and never scored (the DFlash2 convolutions are causal)."""
    p = next(drafter.parameters())
    block = drafter.block_size
    sizes = [c.noise.shape[1] for c in calls]
    if max(sizes) > block:
        raise DFlashQuantError(f"a recorded block has {max(sizes)} rows, more than the drafter's block size {block}")
    ctx_n = [c.ctx.shape[1] for c in calls]
    noise = torch.zeros(1, len(calls) * block, calls[0].noise.shape[-1], dtype=p.dtype, device=p.device)
    q_pos = torch.empty(len(calls) * block, dtype=torch.long, device=p.device)
    for k, (c, size) in enumerate(zip(calls, sizes, strict=True)):
        noise[0, k * block : k * block + size] = c.noise[0].to(p.device, p.dtype)
        blk = c.positions[0, ctx_n[k] :].to(p.device)
        q_pos[k * block : (k + 1) * block] = blk[0] + torch.arange(block, device=p.device)
    ctx = torch.cat([c.ctx.to(p.device, p.dtype) for c in calls], dim=1)
    c_pos = torch.cat([c.positions[0, : ctx_n[k]].to(p.device) for k, c in enumerate(calls)])
    call_of_ctx = torch.repeat_interleave(
        torch.arange(len(calls), device=p.device), torch.tensor(ctx_n, device=p.device)
    )
    q_call = torch.arange(len(calls), device=p.device).repeat_interleave(block)
    q_row = torch.arange(block, device=p.device).repeat(len(calls))
    real = q_row < torch.tensor(sizes, device=p.device)[q_call]
    base = torch.cat(
        [call_of_ctx[None, :] <= q_call[:, None], (q_call[:, None] == q_call[None, :]) & real[None, :]], dim=1
    )
    k_pos = torch.cat([c_pos, q_pos])
    attns = [cast(DFlashAttention, layer.self_attn) for layer in cast(Sequence[DFlashDecoderLayer], drafter.layers)]
    kinds = {(a.is_causal, a.sliding_window) for a in attns}
    masks = {}
    for causal, window in kinds:
        rule = visibility_mask(q_pos, k_pos, causal, window)
        masks[(causal, window)] = (base if rule is None else base & rule)[None, None]
    return Packed(noise, ctx, k_pos[None], masks, sizes, block)


def packed_rows(drafter: DFlashDrafter, packed: Packed) -> torch.Tensor:
    """replay_rows of one prompt in one forward, its calls' rows concatenated: [rows, H]."""
    extra = {"conv_block": packed.block} if drafter.config.is_dflash2 else {}
    h = drafter(packed.noise, packed.ctx, packed.position_ids, attention_mask=packed.masks, **extra)[0]
    return torch.cat([h[k * packed.block + 1 : k * packed.block + size] for k, size in enumerate(packed.sizes)])


@torch.no_grad()
def teacher_rows(drafter: DFlashDrafter, replay: Sequence[Sequence[DraftCall]]) -> list[torch.Tensor]:
    """The bf16 drafter's output rows on each prompt's replay, [rows, H], recorded before quantization (CPU)."""
    return [packed_rows(drafter, pack(drafter, calls)).cpu() for calls in replay]


def tune_scales(
    drafter: DFlashDrafter,
    weights: Mapping[str, QuantizedWeight | KQuantWeight],
    replay: Sequence[Sequence[DraftCall]],
    teacher: list[torch.Tensor],
    head: nn.Module,
    *,
    epochs: int = TUNE_EPOCHS,
    lr: float = TUNE_LR,
    codes: bool = True,
    code_travel: float = TUNE_CODE_TRAVEL,
    anchors: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    anchor_weight: float = 0.0,
    position_decay: float = 0.0,
    norms: bool = False,
    rows: str = "all",
    target_weight: float = 0.0,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> TuneReport:
    """Tune `weights` (GPTQ's, for the Linears already holding their dequantized values) in place: each
    QuantizedWeight gets fp16 scales (and, with `codes`, codes moved by at most one step) that lower the drafter's
    KL to its bf16 self, and its module the new dequantized weight. Never worse on the replay: if the tuned loss
    is not lower, GPTQ's scales and codes stay.

    anchors: per Linear (its bf16 weight W, its calibration Hessian H); with anchor_weight > 0 the loss adds
    anchor_weight x the mean over Linears of tr(E H E^T) / tr(W H W^T), E = tuned weight - W: GPTQ's own
    objective, which sums every calibration row, holds the few-prompt KL from overfitting.

    position_decay > 0 weighs each block row's KL by exp(-(k-1)/position_decay), k its block position: the loss
    (and the guard) then reads the rows as acceptance does, early positions first.

    norms: the drafter's RMSNorm weights are tuned too (one multiplier per channel, Adam at `lr`); they are not
    quantized, so every format carries the tuned values as it carries the bf16 ones.

    rows "reached": only the rows the bf16 drafter's own drafts reach (every earlier row of the block drafted the
    target's token) are scored, the rows its acceptance reads. target_weight > 0 adds that weight x the
    cross-entropy of the quantized drafter to the target's token on the scored rows (needs the target tokens
    calibration records beside each call)."""
    if rows not in TUNE_ROWS:
        raise DFlashQuantError(f"tuning rows must be one of {', '.join(TUNE_ROWS)}, got {rows!r}")
    if not replay or len(replay) != len(teacher):
        raise DFlashQuantError("scale tuning needs the drafter inputs recorded during calibration (replay)")
    p = next(drafter.parameters())
    device, dtype = p.device, p.dtype
    t0 = time.perf_counter()
    frozen = [(q, q.requires_grad) for q in drafter.parameters()]
    head_frozen = [(q, q.requires_grad) for q in head.parameters()]
    swapped: dict[str, tuple[nn.Module, str, nn.Linear, Tuned]] = {}
    scaled_norms: dict[str, _NormScale] = {}
    keep = True
    try:
        for q, _ in frozen + head_frozen:
            q.requires_grad_(False)
        for name, qw in weights.items():
            module = cast(nn.Linear, drafter.get_submodule(name))
            parent_name, _, leaf = name.rpartition(".")
            parent = drafter.get_submodule(parent_name) if parent_name else drafter
            tuned: Tuned = (
                _KScaledCodes(qw, module.bias, device, codes)
                if isinstance(qw, KQuantWeight)
                else _ScaledCodes(qw, module.bias, device, codes)
            )
            setattr(parent, leaf, tuned)
            swapped[name] = (parent, leaf, module, tuned)
        if norms:
            flags = {id(q): flag for q, flag in frozen}
            scaled_norms = {n: _NormScale(m, flags[id(m.weight)]) for n, m in norm_modules(drafter)}
        # the code offsets take signed steps, not Adam's
        params = [t.log_mult for *_, t in swapped.values()] + [s.log_mult for s in scaled_norms.values()]
        opt = torch.optim.Adam(params, lr=lr)
        packs = [pack(drafter, calls) for calls in replay]  # one forward per prompt instead of one per call
        row_w = [position_weights(pk.sizes, position_decay).to(device) for pk in packs]  # all 1 at decay 0
        labels: list[torch.Tensor] = []
        if rows == "reached" or target_weight > 0:
            labels = [packed_labels(calls).to(device) for calls in replay]
        if rows == "reached":
            with torch.no_grad():
                for i, pk in enumerate(packs):
                    t_tok = drafter.compute_logits(teacher[i].to(device, dtype), head).argmax(-1)
                    row_w[i] = row_w[i] * reached_rows(pk.sizes, t_tok, labels[i])
        w_sum = [float(w.sum()) for w in row_w]  # once, not a device sync per step

        anchored = []
        if anchor_weight > 0 and anchors:
            for name, (w, h) in anchors.items():
                if name in swapped and h is not None:
                    # clones: calibration built them in inference mode, which autograd refuses to save
                    w, h = w.to(device, torch.float32).clone(), h.to(device, torch.float32).clone()
                    norm = float(((w @ h) * w).sum())
                    anchored.append((swapped[name][3], w, h, norm if norm > 0 else 1.0))

        def anchor_of() -> torch.Tensor:
            terms = []
            for t, w, h, norm in anchored:
                e = cast(torch.Tensor, t.step_weight).float() - w
                terms.append(((e @ h) * e).sum() / norm)
            return torch.stack(terms).mean()

        def loss_of(i: int) -> torch.Tensor:
            for *_, t in swapped.values():
                t.build(dtype)  # one weight per step, shared by every row of the prompt (and its backward)
            for s in scaled_norms.values():
                s.build()
            student = packed_rows(drafter, packs[i])
            with torch.no_grad():
                t_logp = F.log_softmax(drafter.compute_logits(teacher[i].to(device, dtype), head).float(), dim=-1)
            logits = drafter.compute_logits(student, head)
            loss = _kl(logits, t_logp, row_w[i])
            if target_weight > 0:
                known = labels[i] >= 0
                ce = F.cross_entropy(logits[known].float(), labels[i][known], reduction="none")
                loss = loss + target_weight * (ce * row_w[i][known]).sum()
            return loss

        def mean_kl() -> float:
            with torch.no_grad():
                return sum(float(loss_of(i)) for i in range(len(replay))) / max(sum(w_sum), 1e-12)

        before = mean_kl()
        code_step = min(TUNE_CODE_STEP_MAX, code_travel / max(1, epochs * len(replay)))
        gen = torch.Generator().manual_seed(seed)
        steps = 0
        with torch.enable_grad():
            for _ in range(epochs):
                for i in torch.randperm(len(replay), generator=gen).tolist():
                    opt.zero_grad(set_to_none=True)
                    loss = loss_of(i) / max(w_sum[i], 1e-12)
                    if anchored:
                        loss = loss + anchor_weight * anchor_of()
                    loss.backward()
                    opt.step()
                    with torch.no_grad():
                        for *_, t in swapped.values():
                            t.step_weight = None
                            if t.offset is not None and t.offset.grad is not None:
                                # signed gradient (AutoRound): every offset moves by the same step, so a code
                                # flips only after many steps agree on its direction
                                t.offset.sub_(code_step * t.offset.grad.sign()).clamp_(-1.0, 1.0)
                                t.offset.grad = None
                    steps += 1
                    if progress:
                        progress()
        # what the checkpoint will hold: fp16 scales
        with torch.no_grad():
            for *_, t in swapped.values():
                if isinstance(t, _KScaledCodes):
                    t.round_to_stored()
                else:
                    t.log_mult.copy_((_fp16_nearest(t.tuned_scales()) / t.scales).log())
        after = mean_kl()
        keep = not after < before
        change: dict[str, float] = {}
        flipped: dict[str, float] = {}
        for name, (_, _, module, tuned) in swapped.items():
            qw = weights[name]
            if not keep:
                if isinstance(qw, KQuantWeight):
                    assert isinstance(tuned, _KScaledCodes)
                    change[name] = _store_kquant(qw, tuned)
                else:
                    new = _fp16_nearest(tuned.tuned_scales().detach()).to(qw.scales.device)
                    change[name] = float((new / qw.scales).log().abs().mean())
                    qw.scales = new
                new_codes = tuned.tuned_codes().detach().to(qw.codes.device, qw.codes.dtype)
                flipped[name] = float((new_codes != qw.codes).float().mean())
                qw.codes = new_codes
            with torch.no_grad():
                module.weight.copy_(qw.dequantize().to(module.weight.device, module.weight.dtype))
    finally:
        norm_change = {n: s.restore(keep_tuned=not keep) for n, s in scaled_norms.items()}
        for parent, leaf, module, _ in swapped.values():
            setattr(parent, leaf, module)
        for q, flag in frozen + head_frozen:
            q.requires_grad_(flag)
    return TuneReport(
        epochs=epochs,
        prompts=len(replay),
        position_decay=position_decay,
        lr=lr,
        code_travel=code_travel if codes else None,
        code_step=code_step if codes else None,
        steps=steps,
        seconds=time.perf_counter() - t0,
        kl_before=before,
        kl_after=after if not keep else before,
        kept_gptq_scales=keep,
        scale_change=change,
        codes_changed=flipped,
        norms=norms,
        norm_change=norm_change,
        rows=rows,
        target_weight=target_weight,
    )
