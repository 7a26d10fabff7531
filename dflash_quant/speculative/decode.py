"""The speculative decode loop (batch 1) with DFlash block drafting, and the target-only baseline.

Semantics follow the reference loop (field-notes section 2): the step's `acceptance_length` counts the
accepted drafts plus the target's bonus token (clipped at max_new_tokens and stop tokens), tau is its mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dflash_quant.models.devmap import input_device
from dflash_quant.models.model import DFlashDrafter, DraftCache
from dflash_quant.speculative.lookup import Lookup, LookupSettings, join_proposals, point_mass, two_row_step
from dflash_quant.speculative.target_cache import TargetCache, cache_kw, make_cache
from dflash_quant.speculative.teacher import TeacherTarget


@dataclass
class SpecResult:
    tokens: list[int]  # new tokens only
    acceptance_lengths: list[int]  # per step: committed tokens (accepted drafts + bonus), clipped
    accepted: list[int]  # per step: accepted drafts before clipping
    drafted: list[int]  # per step: number of drafted positions (block - 1, fewer near the end)
    target_forwards: int = 0  # prefill + verify forwards
    drafter_forwards: int = 0
    seconds: float = 0.0
    # Extra target work to roll back linear-attention state (hybrid targets): forwards that replay the
    # committed tokens of a partially accepted block, those tokens, and their time (inside `seconds`).
    replay_forwards: int = 0
    replayed_tokens: int = 0
    replay_seconds: float = 0.0
    # Lookup (dflash_quant.speculative.lookup): per step, how many of the `drafted` positions came from the drafter (the
    # rest, after them, from the lookup), and the time of the history searches (inside `seconds`).
    drafter_drafts: list[int] = field(default_factory=list)
    lookup_seconds: float = 0.0
    # Target compute of the verify forwards: per step the candidate rows verified (lookup `both`: 2 on a
    # lookup step, else 1) and, over the run, the tokens those forwards processed (rows x length).
    verify_rows: list[int] = field(default_factory=list)
    verified_tokens: int = 0
    # `both`: per step, the accepted tokens of [the drafter's row, the lookup's row] on two-row steps and on
    # steps where the lookup row began with the drafts and both went as one longer row; else []
    row_accepted: list[list[int]] = field(default_factory=list)
    # `both`: per step, the drafter's tokens at the head of row 0 on the steps with row_accepted (the rest of
    # that row is lookup tokens, when the lookup row is longer than the block), else 0
    row_drafts: list[int] = field(default_factory=list)
    # prompts decoded together as rows of one batch (batch_decode); > 1: `seconds` is this run's even share of
    # the batch's time, not a batch-1 decode time
    batch_rows: int = 1

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


@dataclass
class GreedyResult:
    tokens: list[int]
    seconds: float
    target_forwards: int
    # per new token: the target's top-1 logit and its margin over the top-2 (judges bf16 near-ties)
    top1_logits: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    logits_dtype: str = "float32"
    # False: the tokens come from target_check (one teacher-forced forward), so `seconds` is not a decode time
    timed: bool = True


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits.float() / temperature, dim=-1)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def tap_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int], device: torch.device) -> torch.Tensor:
    # hidden_states[0] is the embedding output, so decoder layer l's output is at l + 1. A split target's
    # layers live on several devices: each tap moves to the drafter's device (only the tapped layers move).
    return torch.cat([hidden_states[i + 1].to(device) for i in layer_ids], dim=-1)


def rejection_step(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling for one block: (accepted drafts, next token). Exact in distribution.

    drafts [g]; target_probs [g+1, V] (row i scores the token after draft i-1); draft_probs is the
    proposal: [g, V] over the vocabulary, or (candidate ids [g, k], their probabilities [g, k]) from
    DFlash2's selector, where every token outside a slot's candidates has probability 0.
    """
    g = drafts.shape[0]
    if isinstance(draft_probs, tuple):
        ids, cand_probs = draft_probs
        draft_probs = torch.zeros(g, target_probs.shape[-1], dtype=cand_probs.dtype, device=cand_probs.device)
        draft_probs.scatter_(1, ids, cand_probs)  # top-k ids are distinct, so scatter == scatter_add
    p = target_probs[:g].gather(-1, drafts[:, None])[:, 0]
    q = draft_probs.gather(-1, drafts[:, None])[:, 0]
    u = torch.rand(g, generator=generator, device=p.device)  # generator must live on p's device
    ok = (u * q < p).int().cumprod(0)
    accepted = int(ok.sum())
    if accepted == g:
        return accepted, int(_sample(target_probs[g], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(_sample(residual, generator))


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    on_step=None,
    lookup: LookupSettings | None = None,
) -> SpecResult:
    """Generate up to max_new_tokens with the drafter proposing blocks and the target verifying them.

    on_step(dict) is called after each verify with the step's tensors (calibration uses it).
    lookup: also propose from the request's own history (dflash_quant.speculative.lookup documents the rule per step).
    input_ids live on the drafter's device; a target split by a device_map (devmap) gets its inputs on its
    embedding's device, and its taps and picked tokens come back to the drafter's.
    """

    device = input_ids.device
    t_dev = input_device(target, device)
    block = drafter.block_size if block_size is None else block_size
    if not 2 <= block <= drafter.block_size:
        raise ValueError(f"block size {block} must be in [2, {drafter.block_size}] for this drafter")
    n = input_ids.shape[1]
    max_len = n + max_new_tokens
    stops = set(stop_token_ids or [])
    embed = target.get_input_embeddings()  # type: ignore[operator]  # nn.Module.__getattr__ types transformers' methods as Tensor | Module
    head = target.get_output_embeddings()  # type: ignore[operator]
    scale = float(getattr(drafter.config, "input_embedding_scale", 1.0) or 1.0)
    looker = Lookup(lookup, block) if lookup is not None else None

    ids = torch.full((max_len + 1,), drafter.mask_token_id, dtype=torch.long, device=device)
    ids[:n] = input_ids[0]
    # refuses (one line) a cache it cannot roll back, before any compute; a teacher keeps no state
    taught = isinstance(target, TeacherTarget)  # answered from a record: no target forward is run
    t_state: Any = target.state() if isinstance(target, TeacherTarget) else TargetCache(target)
    t_cache, kw = t_state.cache, t_state.kw
    d_cache = DraftCache()
    result = SpecResult(tokens=[], acceptance_lengths=[], accepted=[], drafted=[])

    t0 = _sync(device)
    out = target(input_ids.to(t_dev), **{kw: t_cache}, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    result.target_forwards += not taught
    last_logits = out.logits[0, -1].to(device)
    ids[n] = _sample(_probs(last_logits, temperature), generator) if temperature > 0 else last_logits.argmax()
    ctx = tap_states(out.hidden_states, drafter.target_layer_ids, device)
    start = n
    stopped = int(ids[n]) in stops

    while start + 1 < max_len and not stopped:
        size = min(block, max_len - start)
        blk = ids[start : start + size].clone()
        draft_probs: Any = None  # full distribution (v1), (ids, probs) (DFlash2 / lookup), or None at T=0
        keep, ran_drafter = size - 1, False
        look, rows, row_drafts, merged = ids[:0], None, 0, False
        if looker is not None and size > 1 and not looker.runs_drafter_always:  # `prefer`: lookup first
            look = looker.search(ids[: start + 1], min(looker.count, max_len - start - 1))
        if look.shape[0]:
            blk, draft_probs, keep = torch.cat([blk[:1], look]), point_mass(look), 0
        elif size > 1:
            positions = torch.arange(start - ctx.shape[1], start + size, device=device)[None]
            noise = embed(blk[None].to(t_dev)).to(device) * scale
            hidden = drafter(noise, ctx.to(noise.dtype), positions, cache=d_cache)[:, 1:]
            result.drafter_forwards += 1
            ran_drafter = True
            blk[1:], draft_probs = drafter.propose(hidden, blk[:1], head, temperature, generator)
            if looker is not None and looker.second_row:  # `both`: the lookup as a second row
                blk, rows, draft_probs = looker.two_rows(ids, start, blk, draft_probs, max_len, head.weight.shape[0])
                merged = rows is None and blk.shape[0] > size  # the lookup row starts with the drafts: one row
                row_drafts = size - 1 if rows is not None or merged else 0
            elif looker is not None:
                look, keep = looker.combine(ids, start, blk[1:], max_len - start - 1)
                if look.shape[0]:
                    draft_probs = join_proposals(draft_probs, keep, look, head.weight.shape[0])
                    blk = torch.cat([blk[: keep + 1], look])
        size = blk.shape[0]
        saved = t_state.save(start, size)
        batch = blk[None] if rows is None else rows
        if rows is not None:
            t_state.fork(2)
        out = target(
            batch.to(t_dev),
            position_ids=torch.arange(start, start + size, device=t_dev)[None].expand(batch.shape[0], -1),
            **{kw: t_cache},
            use_cache=True,
            output_hidden_states=size > 1,
        )
        result.target_forwards += not taught
        result.verified_tokens += batch.numel()
        result.verify_rows.append(batch.shape[0])
        if rows is None and not merged:
            result.row_accepted.append([])
        row = 0
        logits = out.logits[0]  # on the lm_head's device; only the picked tokens / probabilities move
        if rows is not None:
            row, acc, bonus, both_acc = two_row_step(rows, out.logits.to(device), draft_probs, temperature, generator)
            result.row_accepted.append(both_acc)
            t_state.pick(row)
            blk, keep = rows[row], (row_drafts if row == 0 else 0)
        elif temperature > 0:
            t_probs = _probs(logits, temperature).to(device)
            if size > 1:
                assert draft_probs is not None  # propose returns its proposal when temperature > 0
                acc, bonus = rejection_step(blk[1:], t_probs, draft_probs, generator)
            else:
                acc, bonus = 0, int(_sample(t_probs[-1], generator))
        else:
            greedy = logits.argmax(-1).to(device)
            acc = int((blk[1:] == greedy[:-1]).int().cumprod(0).sum())
            bonus = int(greedy[acc])
        if merged:  # both rows in one: each got as far as the row
            result.row_accepted.append([acc, acc])
        ids[start : start + acc + 1] = blk[: acc + 1]
        ids[start + acc + 1] = bonus
        produced = min(acc + 1, max_len - start - 1)
        new = ids[start + 1 : start + produced + 1].tolist()
        for i, tok in enumerate(new):
            if tok in stops:
                produced, stopped = i + 1, True
                break
        if on_step is not None:
            on_step({"start": start, "block": blk, "accepted": acc, "produced": produced, "ctx": ctx})
        result.accepted.append(acc)
        result.drafted.append(size - 1)
        result.drafter_drafts.append(min(keep, size - 1))
        result.row_drafts.append(row_drafts)
        result.acceptance_lengths.append(produced)
        start += produced
        t_state.commit(saved, ids, start, final=stopped or start + 1 >= max_len)
        if size > 1:  # the committed tokens' taps; a step without the drafter hands them on to the next one
            new_ctx = tap_states(out.hidden_states, drafter.target_layer_ids, device)[row : row + 1, :produced]
            ctx = new_ctx if ran_drafter else torch.cat([ctx, new_ctx], dim=1)

    end = min(start + 1, max_len)
    result.tokens = ids[n:end].tolist()
    result.replay_forwards, result.replayed_tokens = t_state.replay_forwards, t_state.replayed_tokens
    result.replay_seconds = t_state.replay_seconds
    result.lookup_seconds = looker.seconds if looker is not None else 0.0
    result.seconds = _sync(device) - t0
    return result


@torch.inference_mode()
def target_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> GreedyResult:
    """Plain greedy decoding, one token per forward: the lossless reference and the speed baseline."""
    device = input_ids.device
    stops = set(stop_token_ids or [])
    cache = make_cache(target.config, rollback=False)  # never rolled back: the model's own decode path
    kw = cache_kw(target)
    t0 = _sync(device)
    out = target(input_ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
    forwards = 1
    result = GreedyResult(
        tokens=[], seconds=0.0, target_forwards=0, logits_dtype=str(out.logits.dtype).replace("torch.", "")
    )

    def take(logits: torch.Tensor) -> None:
        top = logits.float().topk(min(2, logits.shape[-1])).values
        result.tokens.append(int(logits.argmax()))  # argmax, as the speculative loop picks (same tie rule)
        result.top1_logits.append(float(top[0]))
        result.margins.append(float(top[0] - top[-1]))

    take(out.logits[0, -1])
    tokens = result.tokens
    pos = input_ids.shape[1]
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        step = torch.tensor([[tokens[-1]]], device=device)
        out = target(step, position_ids=torch.tensor([[pos]], device=device), **{kw: cache}, use_cache=True)
        forwards += 1
        pos += 1
        take(out.logits[0, -1])
    result.seconds, result.target_forwards = _sync(device) - t0, forwards
    return result


@torch.inference_mode()
def target_check(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    candidate: list[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> GreedyResult | None:
    """The target's greedy output when `candidate` (a speculative run's tokens) is it, else None.

    One forward over prompt + candidate gives the target's argmax after every prefix (teacher forcing): the
    candidate is the greedy output iff each of its tokens is that argmax and it ends where greedy decoding
    ends (its first stop token, or max_new_tokens). Costs one prefill instead of one forward per token; the
    top-1 logits and margins come from this forward (a multi-token forward, so they may differ from
    one-token decoding in the last bits). The result is untimed (`timed=False`).
    """
    stops = set(stop_token_ids or [])
    length = len(candidate)
    first_stop = next((i for i, t in enumerate(candidate) if t in stops), None)
    ends_right = first_stop == length - 1 if first_stop is not None else length == max_new_tokens
    if not length or length > max_new_tokens or not ends_right:
        return None
    device = input_ids.device
    t0 = _sync(device)
    seq = torch.cat([input_ids, torch.tensor([candidate[:-1]], dtype=input_ids.dtype, device=device)], dim=1)
    out = target(seq, use_cache=False, logits_to_keep=length)
    logits = out.logits[0]  # row k scores the token after prompt + candidate[:k]
    if logits.argmax(-1).tolist() != candidate:  # argmax: the loop's tie rule
        return None
    top = logits.float().topk(min(2, logits.shape[-1]), dim=-1).values
    return GreedyResult(
        tokens=list(candidate),
        seconds=_sync(device) - t0,
        target_forwards=1,
        top1_logits=top[:, 0].tolist(),
        margins=(top[:, 0] - top[:, -1]).tolist(),
        logits_dtype=str(out.logits.dtype).replace("torch.", ""),
        timed=False,
    )
