"""Capture every drafter Linear's inputs while the drafter really speculates with its target.

Linears that read the same tensor share one Hessian (input group):
  fc                       <- concatenated target taps (context rows)
  layers.i.self_attn.qkv   <- block rows (q, and k/v unless kv_hessian = block+context)
  layers.i.self_attn.kv    <- block rows + context-feature rows (only with kv_hessian = block+context)
  layers.i.self_attn.o_proj, layers.i.mlp.gate_up, layers.i.mlp.down_proj
DFlash2 extras, hooked only when they are to be quantized (`extra`):
  layers.i.{attention,mlp}_conv.kernel_projection  <- the sublayer's normed input (block rows)
  candidate_selector.hidden_projection             <- the drafter's final normed rows after the anchor
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.calibration.peak import PeakProbe
from dflash_quant.errors import UsageError
from dflash_quant.models.model import DFlashDecoderLayer, DFlashDrafter, DraftCache
from dflash_quant.speculative.batch_decode import batched_speculative_generate, unbatchable
from dflash_quant.speculative.decode import SpecResult, speculative_generate
from dflash_quant.speculative.teacher import TeacherTarget, decode_detail, greedy_rows, resident_ends

KV_MODES = ("block", "block+context")


def input_group(name: str, kv_hessian: str) -> str:
    """The Hessian a Linear's weight is quantized against."""
    if name == "fc":
        return "fc"
    prefix, leaf = name.rsplit(".", 1)
    if leaf == "q_proj":
        return f"{prefix}.qkv"
    if leaf in ("k_proj", "v_proj"):
        return f"{prefix}.kv" if kv_hessian == "block+context" else f"{prefix}.qkv"
    if leaf in ("gate_proj", "up_proj"):
        return f"{prefix}.gate_up"
    return name  # o_proj, down_proj


@dataclass
class DraftCall:
    """One drafter forward's inputs, kept to replay the drafter alone (sequential GPTQ, gptq-kl), and the tokens
    the target's greedy output has at its block positions (labels [q], -1 past the output's end; None: not
    recorded)."""

    noise: torch.Tensor
    ctx: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor | None = None


def label_calls(calls: Sequence[DraftCall], prompt: Sequence[int], new_tokens: Sequence[int]) -> None:
    """Set each call's labels from the finished run: the loop's output is the target's greedy output, so every
    block position the run covered has its target token, accepted by the drafter or not."""
    seq = torch.tensor([*prompt, *new_tokens], dtype=torch.int64)
    for call in calls:
        pos = call.positions[0, -call.noise.shape[1] :].to(torch.int64)
        inside = pos < seq.numel()
        call.labels = torch.where(inside, seq[pos.clamp(max=seq.numel() - 1)], torch.full_like(pos, -1))


@dataclass
class CaptureState:
    """What capture has accumulated after `done` prompts (a checkpoint; calibration.checkpoint stores it)."""

    done: int
    hessians: dict[str, HessianAccumulator]
    lengths: list[int]
    replay: list[list[DraftCall]] | None = None


@dataclass
class CalibrationStats:
    hessians: dict[str, HessianAccumulator]
    kv_hessian: str
    prompts: int = 0
    steps: int = 0
    mean_tau: float | None = None
    replay: list[list[DraftCall]] | None = None
    resumed_prompts: int = 0  # prompts taken from a checkpoint of an interrupted run
    memory: dict | None = None  # PeakProbe.result: measured peak of the capture

    def rows(self) -> dict[str, int]:
        return {k: v.rows for k, v in self.hessians.items()}

    def for_linear(self, name: str) -> HessianAccumulator:
        return self.hessians[input_group(name, self.kv_hessian)]


@dataclass
class _Hooks:
    model: DFlashDrafter
    groups: set[str] | None  # None: every group
    kv_hessian: str
    device: torch.device
    extra: tuple[
        str, ...
    ] = ()  # DFlash2 Linears outside the backbone to collect (kernel_projection, hidden_projection)
    hessians: dict[str, HessianAccumulator] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    # batched capture: boolean [rows, c] / [rows, q] masks of the real context / block rows of the coming drafter
    # forward (batch_decode's on_draft); padding and finished rows never reach a Hessian. None: every row is real
    context_rows: torch.Tensor | None = None
    block_rows: torch.Tensor | None = None

    def rows(self, context: torch.Tensor | None, block: torch.Tensor | None) -> None:
        self.context_rows, self.block_rows = context, block

    def _real(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return x if mask is None else x[mask]

    def _acc(self, key: str, width: int) -> HessianAccumulator:
        if key not in self.hessians:
            self.hessians[key] = HessianAccumulator(width, name=key, device=self.device)
        return self.hessians[key]

    def _wanted(self, key: str) -> bool:
        return self.groups is None or key in self.groups

    def attach(self) -> _Hooks:
        m = self.model

        def add(key: str, context: bool = False):
            def hook(module, args):
                if self._wanted(key):
                    rows = self._real(args[0], self.context_rows if context else self.block_rows)
                    self._acc(key, args[0].shape[-1]).add(rows)

            return hook

        self.handles.append(m.fc.register_forward_pre_hook(add("fc", context=True)))
        for i, layer in enumerate(cast(Sequence[DFlashDecoderLayer], m.layers)):
            p = f"layers.{i}"

            def attn_hook(module, args, p=p):
                h, ctx = self._real(args[0], self.block_rows), self._real(args[1], self.context_rows)
                if self._wanted(f"{p}.self_attn.qkv"):
                    self._acc(f"{p}.self_attn.qkv", h.shape[-1]).add(h)
                if self.kv_hessian == "block+context" and self._wanted(f"{p}.self_attn.kv"):
                    acc = self._acc(f"{p}.self_attn.kv", h.shape[-1])
                    acc.add(h)
                    acc.add(ctx)

            self.handles.append(layer.self_attn.register_forward_pre_hook(attn_hook))
            self.handles.append(layer.self_attn.o_proj.register_forward_pre_hook(add(f"{p}.self_attn.o_proj")))
            self.handles.append(layer.mlp.gate_proj.register_forward_pre_hook(add(f"{p}.mlp.gate_up")))
            self.handles.append(layer.mlp.down_proj.register_forward_pre_hook(add(f"{p}.mlp.down_proj")))
        for name in self.extra:
            if name.endswith(".hidden_projection"):
                # the selector projects the rows `propose` gets: the drafter's output after the anchor row
                # (hooked on the forward so that replay, which never proposes, sees them too)
                def rows_hook(module, args, output, key=name):
                    if self._wanted(key):
                        mask = None if self.block_rows is None else self.block_rows[:, 1:]
                        self._acc(key, output.shape[-1]).add(self._real(output[:, 1:], mask))

                self.handles.append(m.register_forward_hook(rows_hook))
            elif name.endswith(".kernel_projection"):
                self.handles.append(m.get_submodule(name).register_forward_pre_hook(add(name)))
            else:
                raise UsageError(
                    f"cannot collect calibration rows for {name}; only conv and selector projections are extra"
                )
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def capture_unbatchable(drafter: torch.nn.Module, target: torch.nn.Module) -> str | None:
    """None when calibration can decode its prompts as rows of one batch (greedy, no lookup), else why not."""
    return unbatchable(drafter, target, 0.0, None)


def capture(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    kv_hessian: str = "block",
    stop_token_ids: list[int] | None = None,
    keep_replay: bool = False,
    progress: Callable[[], None] | None = None,
    extra: Sequence[str] = (),
    *,
    hessian_device: torch.device | None = None,
    resume: CaptureState | None = None,
    checkpoint: Callable[[CaptureState], object] | None = None,
    checkpoint_every: int = 0,
    measure: bool = False,
    batch: int = 1,
    teacher: bool = False,
) -> CalibrationStats:
    """Greedy speculative decoding over the prompts with hooks on the drafter's Linears (and `extra` ones).

    hessian_device: where the fp32 Hessians accumulate (default: the drafter's device); rows move there in
    chunks no larger than the Hessian. resume: a checkpoint's state; its prompts are skipped. checkpoint is
    called with the state every `checkpoint_every` prompts. Only the current prompt's taps are alive at once.
    measure: record the peak memory (calibration.peak) in stats.memory.
    batch: decode up to this many prompts as rows of one batch (batch_decode; the same steps and Hessian rows,
    padding excluded) where the pair allows it and no replay is kept; 1 = one by one.
    teacher: the target's side of the loop comes from one batched greedy decode of up to `batch` prompts
    (speculative.teacher), for any target; the drafter then runs prompt by prompt against that record.
    """
    if kv_hessian not in KV_MODES:
        raise UsageError(f"--kv-hessian must be one of {', '.join(KV_MODES)}, got {kv_hessian!r}")
    device = next(drafter.parameters()).device
    hdev = hessian_device if hessian_device is not None else device
    hooks = _Hooks(drafter, None, kv_hessian, hdev, tuple(extra))
    replay: list[list[DraftCall]] = []
    lengths: list[int] = []
    done = 0
    if resume is not None:
        hooks.hessians = {
            k: HessianAccumulator.from_state_dict(v.state_dict(), name=k, device=hdev)
            for k, v in resume.hessians.items()
        }
        lengths, done = list(resume.lengths), resume.done
        replay = list(resume.replay or [])
    hooks.attach()
    record: list[DraftCall] = []

    def keep(module, args):
        record.append(DraftCall(args[0].detach().cpu(), args[1].detach().cpu(), args[2].detach().cpu()))

    probe = PeakProbe(target, drafter) if measure else None
    rec_handle = drafter.register_forward_pre_hook(keep) if keep_replay else None
    try:
        if probe is not None:
            probe.__enter__()
        batched = batch > 1 and not keep_replay and capture_unbatchable(drafter, target) is None
        i = done
        while i < len(prompts):
            # a chunk ends at the next checkpoint, so checkpoints fall where they do one by one
            end = min(i + (batch if batched or teacher else 1), len(prompts))
            if checkpoint_every > 0:
                end = min(end, (i // checkpoint_every + 1) * checkpoint_every)
            record = []
            if teacher:
                rows = greedy_rows(
                    target, prompts[i:end], max_new_tokens, drafter.target_layer_ids, device,
                    on_token=decode_detail(progress, i, end - i),
                )  # fmt: skip
                runs: list[SpecResult] = []
                with resident_ends(target, device) as ends:  # after the record: not beside its streamed head
                    for ids, row in zip(prompts[i:end], rows, strict=True):
                        if keep_replay and runs:
                            replay.append(record)
                            record = []
                        runs.append(
                            speculative_generate(
                                drafter,
                                TeacherTarget(target, row, ends),
                                torch.tensor([ids], device=device),
                                max_new_tokens,
                                stop_token_ids=stop_token_ids,
                            )
                        )
                del rows
            elif batched:
                runs = batched_speculative_generate(
                    drafter, target, list(prompts[i:end]), max_new_tokens, stop_token_ids, on_draft=hooks.rows
                )
                hooks.rows(None, None)
            else:
                runs = [
                    speculative_generate(
                        drafter,
                        target,
                        torch.tensor([prompts[i]], device=device),
                        max_new_tokens,
                        stop_token_ids=stop_token_ids,
                    )
                ]
            for run in runs:
                lengths.extend(run.acceptance_lengths)
                if progress:
                    progress()
            if keep_replay:
                replay.append(record)
                for calls, ids, run in zip(replay[-len(runs) :], prompts[i:end], runs, strict=True):
                    label_calls(calls, ids, run.tokens)
            i = end
            if checkpoint is not None and checkpoint_every > 0 and i % checkpoint_every == 0 and i < len(prompts):
                # the Hessians are the live accumulators (no copy of a 2.6 GB fc Hessian): valid during the call
                checkpoint(CaptureState(i, hooks.hessians, list(lengths), list(replay) if keep_replay else None))
    finally:
        hooks.detach()
        if rec_handle is not None:
            rec_handle.remove()
        if probe is not None:
            probe.__exit__()
    memory = None
    if probe is not None:
        memory = probe.result(a.xtx for a in hooks.hessians.values() if a.xtx is not None)
    return CalibrationStats(
        hessians=hooks.hessians,
        kv_hessian=kv_hessian,
        prompts=len(prompts),
        steps=len(lengths),
        mean_tau=sum(lengths) / len(lengths) if lengths else None,
        replay=replay if keep_replay else None,
        resumed_prompts=done,
        memory=memory,
    )


@torch.inference_mode()
def replay_capture(
    drafter: DFlashDrafter, replay: Iterable[list[DraftCall]], groups: set[str], kv_hessian: str
) -> dict[str, HessianAccumulator]:
    """Re-run the drafter alone on recorded inputs (with its current weights) and collect the given groups."""
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    extra = tuple(sorted(g for g in groups if g.endswith((".kernel_projection", ".hidden_projection"))))
    hooks = _Hooks(drafter, set(groups), kv_hessian, device, extra).attach()
    try:
        for calls in replay:
            cache = DraftCache()
            for call in calls:
                drafter(
                    call.noise.to(device, dtype), call.ctx.to(device, dtype), call.positions.to(device), cache=cache
                )
    finally:
        hooks.detach()
    return hooks.hessians
