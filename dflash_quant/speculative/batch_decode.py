"""Greedy speculative decoding of several prompts as the rows of one batch (the check's fast path).

Each row follows the sequential loop (decode.speculative_generate) step for step: the same drafts, the same
accepted counts, the same tokens; only the forwards are shared. The job is made of tiny forwards dominated by
per-call overhead, so one forward over B rows costs little more than one over a single row.

Rows accept different numbers of tokens, so their caches grow apart. Both caches (the target's K/V and the
drafter's context K/V) keep one common length and a position per slot: a slot whose token was rejected (or
that pads a shorter row) gets the position INVALID, and every forward passes an explicit boolean mask built
from the slots' positions (a key is visible iff its position is valid and the attention rule - causal, window -
allows it). A row that finishes leaves the batch. Rejected slots are not compacted: at these sizes the extra
masked keys cost less than gathering the caches every step.

Scope: temperature 0, no lookup, our drafters (DFlash, DFlash2), a target on one device whose cache is plain
full-attention K/V and whose attention takes a boolean 4D mask (sdpa or eager). `unbatchable` names the reason
anything else falls back to the sequential loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_quant.models.model import DFlashDrafter, DraftCache
from dflash_quant.models.model2 import DFlash2Drafter
from dflash_quant.speculative.decode import SpecResult, tap_states
from dflash_quant.speculative.target_cache import cache_kw, make_cache

INVALID = 1 << 40  # position of a slot no query may see (rejected draft, padding)


def unbatchable(drafter: torch.nn.Module, target: torch.nn.Module, temperature: float, lookup: object) -> str | None:
    """None when batched_speculative_generate reproduces the sequential loop for this pair, else why not."""
    from transformers import cache_utils as cu

    if temperature > 0:
        return "temperature > 0 (sampling is per row and seeded in sequence)"
    if lookup is not None:
        return "lookup drafting"
    if not isinstance(drafter, DFlashDrafter):
        return f"drafter {type(drafter).__name__} is not a DFlash/DFlash2 drafter"
    devices = {p.device for p in target.parameters()} | {p.device for p in drafter.parameters()}
    if len(devices) != 1:
        return "target and drafter are not on one device"
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"target attention {impl!r} does not take a boolean 4D mask"
    cache = make_cache(target.config, rollback=False)
    if not cache.layers or any(type(layer) is not cu.DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        return f"target cache layers {kinds} are not all plain attention K/V"
    return None


class _SlotCache(DraftCache):
    """The drafter's context K/V of all rows: no window trimming (a row's window is applied by the mask)."""

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None) -> None:
        self.keys[layer], self.values[layer], self.positions[layer] = k, v, pos

    def select(self, rows: torch.Tensor) -> None:
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.index_select(0, rows)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, q, k] mask from per-row positions (as model.visibility_mask, per row; INVALID keys hidden)."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = (k != INVALID).expand(-1, q.shape[1], -1)
    if is_causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & ((q - k) < window)
        if not is_causal:
            visible = visible & ((k - q) < window)
    return visible[:, None]


def _select_target(cache, rows: torch.Tensor) -> None:
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


@torch.inference_mode()
def batched_speculative_generate(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    block_size: int | None = None,
    on_draft: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> list[SpecResult]:
    """speculative_generate at temperature 0 for every prompt, decoded as rows of one batch.

    Each result's tokens and per-step lists are the sequential loop's; its `seconds` is the batch's time
    split evenly over its rows and `batch_rows` says how many rows shared it. Call `unbatchable` first.
    on_draft(context_rows, block_rows) is called before each drafter forward with boolean [rows, c] and
    [rows, q] masks of the real rows of its context and block inputs (calibration keeps only those).
    Each cache is compacted (rejected slots dropped) once it outgrows the longest prompt + max_new_tokens,
    so it never holds more slots than the sequential loop's longest run plus one block.
    """
    device = next(drafter.parameters()).device
    block = drafter.block_size if block_size is None else block_size
    if not 2 <= block <= drafter.block_size:
        raise ValueError(f"block size {block} must be in [2, {drafter.block_size}] for this drafter")
    stops = set(stop_token_ids or [])
    embed = target.get_input_embeddings()  # type: ignore[operator]  # transformers' methods via nn.Module.__getattr__
    head = target.get_output_embeddings()  # type: ignore[operator]
    scale = float(getattr(drafter.config, "input_embedding_scale", 1.0) or 1.0)
    kinds = sorted({drafter.config.attention_kind(i) for i in range(len(drafter.layers))}, key=str)
    kw = cache_kw(target)
    rows_total = len(prompts)
    results = [SpecResult(tokens=[], acceptance_lengths=[], accepted=[], drafted=[]) for _ in prompts]
    if not prompts:
        return results
    lens = [len(p) for p in prompts]
    width = max(lens)
    max_lens = [n + max_new_tokens for n in lens]
    ids = torch.full((rows_total, width + max_new_tokens + 1), drafter.mask_token_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : lens[b]] = torch.tensor(p, dtype=torch.long)

    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Prefill, left-padded: row b's prompt fills the last lens[b] slots at positions 0..lens[b]-1. A padding
    # query looks at position 0 (a real key of its row) so that no row of the softmax is empty.
    pad = [width - n for n in lens]
    tokens = torch.zeros(rows_total, width, dtype=torch.long)
    slot_pos = torch.full((rows_total, width), INVALID, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, pad[b] :] = torch.tensor(p, dtype=torch.long)
        slot_pos[b, pad[b] :] = torch.arange(lens[b])
    rope_pos = slot_pos.where(slot_pos != INVALID, torch.zeros_like(slot_pos))
    t_cache = make_cache(target.config, rollback=False)
    mask = _visible(rope_pos, slot_pos, True, None)
    out = target(
        tokens.to(device),
        attention_mask=mask.to(device),
        position_ids=rope_pos.to(device),
        **{kw: t_cache},
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    first = out.logits[:, -1].argmax(-1).cpu()
    ctx = tap_states(out.hidden_states, drafter.target_layer_ids, device)  # [B, width, taps*H]
    ctx_pos = slot_pos.clone()
    starts = list(lens)
    active: list[int] = []  # result index of each batch row
    for b in range(rows_total):
        ids[b, lens[b]] = first[b]
        results[b].target_forwards += 1
        if lens[b] + 1 < max_lens[b] and int(first[b]) not in stops:
            active.append(b)
    keep = torch.tensor(active, dtype=torch.long)
    if len(active) < rows_total:
        _select_target(t_cache, keep.to(device))
        ctx, ctx_pos, slot_pos = ctx.index_select(0, keep.to(device)), ctx_pos[keep], slot_pos[keep]
    d_cache = _SlotCache()
    d_pos = torch.zeros(len(active), 0, dtype=torch.long)  # positions of the drafter's cached context slots
    limit = max(lens) + max_new_tokens

    while active:
        rows = len(active)
        start = torch.tensor([starts[b] for b in active], dtype=torch.long)
        size = torch.tensor([min(block, max_lens[b] - starts[b]) for b in active], dtype=torch.long)
        width = int(size.max())
        j = torch.arange(width)
        real = j[None] < size[:, None]  # [rows, width]
        block_pos = start[:, None] + j[None]
        blk = torch.full((rows, width), drafter.mask_token_id, dtype=torch.long)  # [anchor, MASK, ...]
        blk[:, 0] = ids[torch.tensor(active), start]
        # A padding query is given its row's anchor position in the masks: it sees at least the anchor.
        q_pos = block_pos.where(real, start[:, None].expand(-1, width))

        # Drafter: new context rows (RoPE position 0 for padding), then the block.
        ctx_rope = ctx_pos.where(ctx_pos != INVALID, torch.zeros_like(ctx_pos))
        positions = torch.cat([ctx_rope, block_pos], dim=1).to(device)
        keys = torch.cat([d_pos, ctx_pos, block_pos.where(real, torch.full_like(block_pos, INVALID))], dim=1)
        masks = {(c, w): _visible(q_pos, keys, c, w).to(device) for c, w in kinds}
        noise = embed(blk.to(device)) * scale
        if on_draft is not None:
            on_draft((ctx_pos != INVALID).to(device), real.to(device))
        hidden = drafter(noise, ctx.to(noise.dtype), positions, cache=d_cache, attention_mask=masks)[:, 1:]
        d_pos = torch.cat([d_pos, ctx_pos], dim=1)
        logits = drafter.compute_logits(hidden, head)
        if isinstance(drafter, DFlash2Drafter):
            drafts = drafter.candidate_selector.select(hidden, logits, blk[:, 0].to(device), 0.0)[0]
        else:
            drafts = logits.argmax(-1)
        blk[:, 1:] = drafts.cpu()

        # Target verify over the blocks; the new slots' positions (INVALID for padding) join the cache's.
        new_pos = block_pos.where(real, torch.full_like(block_pos, INVALID))
        all_pos = torch.cat([slot_pos, new_pos], dim=1)
        out = target(
            blk.to(device),
            attention_mask=_visible(q_pos, all_pos, True, None).to(device),
            position_ids=block_pos.to(device),
            **{kw: t_cache},
            use_cache=True,
            output_hidden_states=True,
        )
        greedy = out.logits.argmax(-1).cpu()  # [rows, width]
        match = (blk[:, 1:] == greedy[:, :-1]) & real[:, 1:]
        acc = match.int().cumprod(1).sum(1)
        bonus = greedy.gather(1, acc[:, None])[:, 0]
        produced_all = []
        finished = []
        acc_l, bonus_l, size_l = acc.tolist(), bonus.tolist(), size.tolist()
        for i, b in enumerate(active):
            s, a, n_size = starts[b], acc_l[i], size_l[i]
            ids[b, s : s + a + 1] = blk[i, : a + 1]
            ids[b, s + a + 1] = bonus_l[i]
            produced = min(a + 1, max_lens[b] - s - 1)
            stopped = False
            for k, tok in enumerate(ids[b, s + 1 : s + produced + 1].tolist()):
                if tok in stops:
                    produced, stopped = k + 1, True
                    break
            r = results[b]
            r.target_forwards += 1
            r.drafter_forwards += 1
            r.verified_tokens += n_size
            r.verify_rows.append(1)
            r.row_accepted.append([])
            r.accepted.append(a)
            r.drafted.append(n_size - 1)
            r.drafter_drafts.append(n_size - 1)
            r.row_drafts.append(0)
            r.acceptance_lengths.append(produced)
            starts[b] = s + produced
            produced_all.append(produced)
            if stopped or starts[b] + 1 >= max_lens[b]:
                finished.append(i)
        committed = j[None] < torch.tensor(produced_all)[:, None]
        slot_pos = torch.cat([slot_pos, new_pos.where(committed, torch.full_like(new_pos, INVALID))], dim=1)
        ctx = tap_states(out.hidden_states, drafter.target_layer_ids, device)
        ctx_pos = block_pos.where(committed, torch.full_like(block_pos, INVALID))
        if finished:
            left = [i for i in range(rows) if i not in set(finished)]
            active = [active[i] for i in left]
            if not active:
                break
            keep = torch.tensor(left, dtype=torch.long)
            _select_target(t_cache, keep.to(device))
            d_cache.select(keep.to(device))
            ctx, ctx_pos, slot_pos, d_pos = (
                ctx.index_select(0, keep.to(device)),
                ctx_pos[keep],
                slot_pos[keep],
                d_pos[keep],
            )
        if slot_pos.shape[1] > limit:
            slot_pos = _compact(slot_pos, _target_tensors(t_cache))
        if d_pos.shape[1] + ctx_pos.shape[1] > limit:
            d_pos = _compact(d_pos, _draft_tensors(d_cache))

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    for b, r in enumerate(results):
        r.tokens = ids[b, lens[b] : min(starts[b] + 1, max_lens[b])].tolist()
        r.seconds = seconds / rows_total
        r.batch_rows = rows_total
    return results


def _target_tensors(cache) -> list[tuple[Any, Any]]:
    return [(layer, name) for layer in cache.layers if layer.is_initialized for name in ("keys", "values")]


def _draft_tensors(cache: _SlotCache) -> list[tuple[Any, Any]]:
    return [(store, layer) for store in (cache.keys, cache.values) for layer in store]


def _compact(slot_pos: torch.Tensor, tensors: list[tuple[Any, Any]]) -> torch.Tensor:
    """Keep each row's valid slots (in order), dropping slots invalid in every row at the end.

    tensors: (owner, key) of the [rows, heads, slots, dim] caches to gather (attributes or dict entries)."""
    valid = slot_pos != INVALID
    keep = int(valid.sum(1).max())
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :keep]  # valid slots first
    for owner, key in tensors:
        t = owner[key] if isinstance(owner, dict) else getattr(owner, key)
        index = order.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
        packed = t.gather(2, index)
        if isinstance(owner, dict):
            owner[key] = packed
        else:
            setattr(owner, key, packed)
    return slot_pos.gather(1, order)
