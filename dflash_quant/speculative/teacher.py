"""Teacher-forced speculation: the target's greedy continuation computed once, in batches, then replayed.

At temperature 0 a lossless speculative loop emits exactly the target's greedy continuation, and everything the
loop reads from the target at a committed position (the next greedy token, the tapped hidden states) depends
only on the tokens before it. So the target's part of the loop can be computed up front: one batched greedy
decode of the prompts (left-padded, one forward per new token for all rows) with hooks on the tapped layers
records, per prompt, the greedy tokens and the taps of every position. `TeacherTarget` then answers the loop's
target forwards from that record without any target compute or cache rollback: the drafter sees the inputs it
would see in the loop (up to the rounding of a one-token forward vs a block forward), accepts the same drafts,
and tau and per-position acceptance follow.

What it buys: a hybrid target (linear-attention state) or one streamed from CPU offload runs a handful of
batched forwards instead of two forwards per speculative step per prompt. What it cannot say: whether the loop
is lossless, or how fast it is (the target never verifies a block).

Left padding is exact for the targets we run: attention layers mask the pad keys, and Gated DeltaNet layers
zero the pad rows before their projections, so their conv and recurrent states stay at their zero start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dflash_quant.errors import UsageError
from dflash_quant.models.devmap import input_device, resident_copy
from dflash_quant.speculative.target_cache import cache_kw, make_cache


@dataclass
class TeacherRow:
    """One prompt's greedy record: prompt + continuation ids, and the taps of every position but the last."""

    ids: list[int]
    prompt_len: int
    taps: dict[int, torch.Tensor]  # target layer id -> [positions, hidden] (decoder layer output)

    @property
    def continuation(self) -> list[int]:
        return self.ids[self.prompt_len :]


def decoder_layers(target: torch.nn.Module) -> Sequence[torch.nn.Module]:
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UsageError(
            f"--teacher-forced: cannot find the decoder layers of {type(target).__name__} (expected model.layers); "
            "run without --teacher-forced"
        )
    return layers


@torch.inference_mode()
def greedy_rows(
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    new_tokens: int,
    layer_ids: Sequence[int],
    device: torch.device,
    pad_id: int = 0,
    on_token: Callable[[int, int], None] | None = None,
) -> list[TeacherRow]:
    """Greedy-decode `new_tokens` + 1 tokens for every prompt as rows of one batch (no stop tokens: the loop may
    verify past a stop before it clips) and record the taps of `layer_ids` at every position, on `device`.
    `on_token(k, total)` after each decoded token: at 27B with the target offloaded one token is a pass over
    every streamed weight, so a batch's decode runs for minutes between prompt counts."""
    layers = decoder_layers(target)
    t_dev = input_device(target, device)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    rows = len(prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    ids, mask = ids.to(t_dev), mask.to(t_dev)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    handles = []
    for i in layer_ids:

        def hook(module, args, output, i=i):
            hidden = output[0] if isinstance(output, tuple) else output
            pieces[i].append(hidden.to(device))

        handles.append(layers[i].register_forward_hook(hook))
    cache = make_cache(target.config, rollback=False)
    kw = cache_kw(target)
    out_ids = [ids]
    try:
        out = target(ids, attention_mask=mask, position_ids=positions, **{kw: cache}, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        pos = positions[:, -1]
        if on_token is not None:
            on_token(1, new_tokens + 1)
        for k in range(new_tokens):
            step = nxt[:, None].to(t_dev)
            out_ids.append(step)
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            pos = pos + 1
            out = target(step, attention_mask=mask, position_ids=pos[:, None], **{kw: cache}, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            if on_token is not None:
                on_token(k + 2, new_tokens + 1)
        out_ids.append(nxt[:, None].to(t_dev))
    finally:
        for h in handles:
            h.remove()
    all_ids = torch.cat(out_ids, dim=1).tolist()
    taps = {i: torch.cat(pieces[i], dim=1) for i in layer_ids}  # [rows, width + new_tokens, hidden]
    result = []
    for r, n in enumerate(lengths):
        start = width - n
        result.append(
            TeacherRow(
                ids=all_ids[r][start:],
                prompt_len=n,
                taps={i: t[r, start:] for i, t in taps.items()},
            )
        )
    return result


def greedy_rows_batched(
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    new_tokens: int,
    layer_ids: Sequence[int],
    device: torch.device,
    rows: int,
    progress: Callable[[], None] | None = None,
) -> list[TeacherRow]:
    """greedy_rows over `prompts`, `rows` prompts per batch (the check's record: kept whole for both drafters)."""
    out: list[TeacherRow] = []
    for i in range(0, len(prompts), max(rows, 1)):
        chunk = prompts[i : i + max(rows, 1)]
        out += greedy_rows(
            target, chunk, new_tokens, layer_ids, device, on_token=decode_detail(progress, i, len(chunk))
        )
        for _ in chunk:
            if progress:
                progress()
    return out


def decode_detail(advance: Callable[[], None] | None, first: int, rows: int) -> Callable[[int, int], None] | None:
    """greedy_rows' on_token for a stage whose `advance` can show a detail beside its count (the CLI's stages
    can, `advance.detail(text)`); None otherwise."""
    detail = getattr(advance, "detail", None)
    if detail is None:
        return None
    where = f"prompts {first + 1}-{first + rows}" if rows > 1 else f"prompt {first + 1}"
    return lambda k, total: detail(f"target's greedy decode of {where}: token {k}/{total}")


class _Taps:
    """Stands in for a forward's hidden_states tuple: index l + 1 is decoder layer l's output."""

    def __init__(self, row: TeacherRow, start: int, end: int):
        self.row, self.start, self.end = row, start, end

    def __getitem__(self, index: int) -> torch.Tensor:
        layer = index - 1
        if layer not in self.row.taps:
            raise KeyError(f"layer {layer} was not recorded by the teacher")
        return self.row.taps[layer][self.start : self.end][None]


class _NoState:
    """The loop's TargetCache for a teacher: nothing to save, roll back or replay."""

    cache = None
    kw = "cache"
    replay_forwards = 0
    replayed_tokens = 0
    replay_seconds = 0.0

    def save(self, length: int, size: int) -> None:
        return None

    def fork(self, rows: int) -> None:
        raise UsageError("teacher-forced runs verify one row per step (no lookup)")

    def pick(self, row: int) -> None:
        return None

    def commit(self, saved: object, ids: torch.Tensor, length: int, final: bool = False) -> None:
        return None


class TeacherTarget(torch.nn.Module):
    """The target as the loop sees it at T=0, answered from one prompt's greedy record (no compute).

    A verify forward over positions [s, s + L) returns, for each, a one-hot row of the greedy token after it and
    the recorded taps there. Rows after the first rejected draft are not the target's (their prefix is not the
    greedy one), but the loop never reads them: it accepts the leading matching drafts and takes the bonus token
    from the row right after them.
    """

    def __init__(
        self, target: torch.nn.Module, row: TeacherRow, ends: tuple[torch.nn.Module, torch.nn.Module] | None = None
    ):
        super().__init__()
        self.row = row
        self.config = target.config
        # kept outside the module tree: the target's weights are not this module's parameters
        self.__dict__["_target"] = target
        self.__dict__["_ends"] = ends  # (input embedding, head) to draft with: see resident_ends
        self._vocab = int(target.get_output_embeddings().weight.shape[0])  # type: ignore[operator]

    def get_input_embeddings(self) -> torch.nn.Module:
        ends = self.__dict__["_ends"]
        return ends[0] if ends is not None else self.__dict__["_target"].get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        ends = self.__dict__["_ends"]
        return ends[1] if ends is not None else self.__dict__["_target"].get_output_embeddings()

    def state(self) -> _NoState:
        return _NoState()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> SimpleNamespace:
        length = input_ids.shape[-1]
        if input_ids.shape[0] != 1:
            raise UsageError("teacher-forced runs verify one row per step (no lookup)")
        start = 0 if position_ids is None else int(position_ids[0, 0])
        end = start + length
        if end >= len(self.row.ids):
            raise ValueError(f"teacher record ends at {len(self.row.ids) - 1}, asked for position {end}")
        keep = kwargs.get("logits_to_keep") or length
        first = end - keep
        nxt = torch.tensor(self.row.ids[first + 1 : end + 1], device=input_ids.device)
        logits = torch.zeros((1, keep, self._vocab), device=input_ids.device)
        logits[0, torch.arange(keep, device=input_ids.device), nxt] = 1.0
        return SimpleNamespace(logits=logits, hidden_states=_Taps(self.row, start, end))


@contextmanager
def resident_ends(target: torch.nn.Module, device: torch.device) -> Iterator[tuple[torch.nn.Module, torch.nn.Module]]:
    """(input embedding, head) the drafter calls on every step against a teacher: the target's own, or, for one
    that accelerate offloads, a copy held on `device` for the duration. Offloaded, a 27B target's head (2.5 GB)
    would cross PCIe on every drafter step; a teacher runs no target forward meanwhile, so the copy takes the
    place the streamed head would. Same weights, same call: the same logits."""
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()  # type: ignore[operator]
    copies = (resident_copy(embed, device), resident_copy(head, device))
    try:
        yield (copies[0] or embed, copies[1] or head)
    finally:
        del copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
