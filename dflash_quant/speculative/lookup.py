"""Lookup proposals: continue the request's own history where its latest tokens occurred before.

The proposer finds the most recent earlier occurrence of the longest suffix (between `min_ngram` and
`max_ngram` tokens) of the committed tokens (prompt + generated) and proposes the tokens that followed it.
The search is a handful of vector ops over the whole history on its device (one per n-gram length, never a
Python loop over positions) and one host sync to read the match back.

Which proposal a step verifies (`mode`), decided before the verify forward:

- `prefer`: a match verifies the lookup tokens and the drafter does not run that step; no match, the
  drafter's block. Cheapest, but a spurious match replaces a good drafter block.
- `agree`: the drafter always runs; a match is verified instead of the drafter's block only when the lookup's
  first token equals the drafter's first draft (the drafter vouches for the path the lookup continues).
- `extend`: the drafter always runs and its whole block is verified, followed by the lookup continuation of
  (history + the drafted tokens): both proposals in one forward, one after the other.
- `both` (default): the drafter always runs; on a match the target verifies the drafter's block and the lookup
  continuation as two rows of one batched forward and the step commits the row that got further. The lookup
  row has max_tokens tokens (default BOTH_TOKENS, at least block - 1: on text that reproduces its history a
  match often continues far past the block); when it is longer than the block, the drafter's row is filled up
  with the lookup continuation of (history + its drafts) (`Lookup.two_rows`). Per step it never commits fewer
  tokens than the drafter's block alone would, by design; it costs a second row in the verify forward on
  lookup steps (`verified_tokens` counts it).

Why this stays exact. At temperature 0 every mode verifies one token sequence and commits its longest prefix
that equals the target's argmax, plus the target's token: the output is the target's greedy output whatever
was proposed. At temperature > 0 a lookup token is a proposal with a point-mass distribution (q = 1 on it),
so rejection sampling accepts it with probability p(token) and otherwise resamples from p with that token
removed; the choice of proposal depends only on the history and the drafter's own sample, never on the
target's randomness, so the output distribution is p's (tests/test_lookup.py's chi-square tests). `both` at
T=0 commits the longer accepted row, whose tokens are the target's greedy tokens either way; at T>0 it walks
the two rows as a tree (`two_row_step`): where they offer different tokens, the drafter's is tried first
(accepted with p/q), then the lookup's against the residual p' = norm(max(p - q, 0)) (accepted with p'(t)),
then the bonus is drawn from what is left. That is multi-draft (recursive) rejection sampling, exact in
distribution because neither proposal depends on the target's randomness. The
drafter's context stays exact: the taps of the committed tokens come from the verify forward whichever
proposal it verified, and a step where the drafter does not run hands them on to the next drafter forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dflash_quant.errors import UsageError

MODES = ("prefer", "agree", "extend", "both")
DEFAULT_MODE = "both"
# `both`'s lookup row by default (at least the drafter's block - 1): chosen on the development split
# (benchmarks/lookup_modes.py, README "Lookup-augmented drafting")
BOTH_TOKENS = 24


@dataclass(frozen=True)
class LookupSettings:
    mode: str = DEFAULT_MODE
    min_ngram: int = 2
    max_ngram: int = 4
    max_tokens: int | None = None  # lookup tokens per step; default: `tokens`

    def check(self, block: int | None = None) -> None:
        """Refuse bad settings; `block` (the drafter's block size, when known) bounds `both`'s row length."""

        if self.mode not in MODES:
            raise UsageError(f"unknown lookup mode {self.mode!r}; use one of {', '.join(MODES)}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(
                f"lookup n-gram lengths must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"lookup max tokens must be at least 1, got {self.max_tokens}")
        if self.mode == "both" and self.max_tokens is not None and block is not None and self.max_tokens < block - 1:
            raise UsageError(
                f"--lookup-max-tokens {self.max_tokens} is shorter than the drafter's block ({block - 1} drafts); "
                f"lookup mode `both` verifies the lookup as a second row at least that long: use "
                f">= {block - 1}, leave it unset, or use another mode"
            )

    def tokens(self, block: int) -> int:
        """Lookup tokens per step at most: max_tokens, else `both`: BOTH_TOKENS (at least block - 1), other
        modes: the drafter's block - 1."""
        if self.max_tokens is not None:
            return self.max_tokens
        return max(BOTH_TOKENS, block - 1) if self.mode == "both" else block - 1

    def label(self) -> str:
        return f"{self.mode}, n-gram {self.min_ngram}-{self.max_ngram}"


def match(history: torch.Tensor, min_ngram: int, max_ngram: int) -> tuple[int, int]:
    """(n, j): the longest suffix of `history` (n in [min_ngram, max_ngram] tokens) that also ends at an earlier
    position j, the most recent such j; (0, -1) when there is none. history: 1-D token ids on any device."""
    length = history.shape[0]
    top = min(max_ngram, length - 1)
    if top < min_ngram:
        return 0, -1
    ends = torch.arange(length - 1, device=history.device)  # an occurrence ending at j is followed by history[j + 1]
    run = torch.ones(length - 1, dtype=torch.bool, device=history.device)
    n = torch.zeros(length - 1, dtype=torch.long, device=history.device)
    for k in range(top):  # bounded by max_ngram; each op covers the whole history
        prev = ends - k
        run &= (prev >= 0) & (history[prev.clamp_min(0)] == history[length - 1 - k])
        n += run
    best = torch.argmax(n * length + ends)  # longest, then most recent
    got, at = torch.stack([n[best], best]).tolist()
    return (got, at) if got >= min_ngram else (0, -1)


def continuation(history: torch.Tensor, settings: LookupSettings, count: int) -> torch.Tensor:
    """`count` tokens that followed the best earlier occurrence of the history's suffix (none without a match)."""
    n, at = match(history, settings.min_ngram, settings.max_ngram)
    if n == 0 or count < 1:
        return history[:0]
    # A match close to the end is a repeating stretch: keep copying what the copy itself proposes (period
    # length - 1 - at), so "a b a b" proposes "a b a ..." rather than the one token left after the match.
    period = history.shape[0] - 1 - at
    return history[at + 1 + torch.arange(count, device=history.device) % period]


def point_mass(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup tokens' proposal in the (candidate ids, probabilities) form rejection_step takes."""
    return tokens[:, None], torch.ones(tokens.shape[0], 1, device=tokens.device)


class Lookup:
    """The per-request proposer the decode loop calls, with the time its searches took."""

    def __init__(self, settings: LookupSettings, block: int):
        settings.check(block)
        self.settings = settings
        self.count = settings.tokens(block)
        self.seconds = 0.0

    @property
    def runs_drafter_always(self) -> bool:
        return self.settings.mode != "prefer"

    @property
    def second_row(self) -> bool:
        return self.settings.mode == "both"

    def search(self, history: torch.Tensor, count: int | None = None) -> torch.Tensor:
        t0 = time.perf_counter()  # the search ends in a host read (tolist), so this times the device work too
        out = continuation(history, self.settings, self.count if count is None else count)
        self.seconds += time.perf_counter() - t0
        return out

    def two_rows(
        self, ids: torch.Tensor, start: int, blk: torch.Tensor, draft_probs, max_len: int, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """`both`, after the drafter ran: (row to verify alone, or row 0; the two rows [2, S] or None; row 0's
        proposal). blk is the anchor and the drafter's g tokens; ids[: start + 1] the committed history.

        The lookup row has max(g, max_tokens) tokens (within the room left). A longer lookup row needs row 0 as
        long (one batched forward): its drafts are followed by the lookup continuation of (history + drafts),
        point-mass proposals like any lookup token, so whatever fills it the step stays exact. A lookup row that
        starts with the drafter's g tokens needs no second row: the block and the rest of the lookup, one row.
        """
        g = blk.shape[0] - 1
        history = ids[: start + 1]
        look = self.search(history, min(max(self.count, g), max_len - start - 1))
        if not look.shape[0]:
            return blk, None, draft_probs
        if torch.equal(look[:g], blk[1:]):
            return torch.cat([blk, look[g:]]), None, join_proposals(draft_probs, g, look[g:], vocab)
        extra = look.shape[0] - g
        tail = self.search(torch.cat([history, blk[1:]]), extra) if extra else look[:0]
        if tail.shape[0] < extra:  # no match after the drafts: any tokens fill the row (the lookup's, say)
            tail = look[g:]
        row0 = torch.cat([blk, tail])
        return row0, torch.stack([row0, torch.cat([blk[:1], look])]), join_proposals(draft_probs, g, tail, vocab)

    def combine(self, ids: torch.Tensor, start: int, drafts: torch.Tensor, room: int) -> tuple[torch.Tensor, int]:
        """After the drafter ran: (lookup tokens to verify, how many drafts to keep before them).

        ids[: start + 1] is the committed history (the anchor last); `room` bounds the tokens after the anchor.
        Keeping 0 drafts verifies the lookup instead of the block; an empty result keeps the block alone.
        """
        if self.settings.mode == "extend":
            history = torch.cat([ids[: start + 1], drafts])
            look = self.search(history, min(self.count, room - drafts.shape[0]))
            return look, drafts.shape[0]
        look = self.search(ids[: start + 1], min(self.count, room))
        if look.shape[0] and bool(look[0] == drafts[0]):  # `agree`: the drafter vouches for the path
            return look, 0
        return look[:0], drafts.shape[0]


def join_proposals(draft_probs, keep: int, look: torch.Tensor, vocab: int):
    """The proposal of `keep` drafter tokens followed by the lookup tokens, as dense [keep + m, V] rows.

    draft_probs is the drafter's (None at temperature 0, [g, V], or DFlash2's (ids [g, k], probs [g, k]))."""
    if draft_probs is None:
        return None
    rows = torch.zeros(keep + look.shape[0], vocab, device=look.device)
    if isinstance(draft_probs, tuple):
        cand, probs = draft_probs
        rows[:keep].scatter_(1, cand[:keep], probs[:keep].float())
    else:
        rows[:keep] = draft_probs[:keep].float()
    rows[keep:].scatter_(1, look[:, None], 1.0)
    return rows


def two_row_step(
    rows: torch.Tensor,
    logits: torch.Tensor,
    draft_q: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int, int, list[int]]:
    """`both`: (row to commit, accepted tokens of that row, next token, accepted tokens of each row) after one
    batched verify; a row's own count is how far its tokens matched what the step accepted.

    rows [2, S]: the anchor and the drafter's block (row 0), the anchor and the lookup continuation (row 1);
    logits [2, S, V]; draft_q [S - 1, V]: the drafter's proposal (None at temperature 0).
    """
    g = rows.shape[1] - 1
    if temperature == 0:
        greedy = logits.argmax(-1)
        acc = (rows[:, 1:] == greedy[:, :-1]).int().cumprod(1).sum(1).tolist()
        row = 0 if acc[0] >= acc[1] else 1  # a tie keeps the drafter's row
        return row, acc[row], int(greedy[row, acc[row]]), acc
    assert draft_q is not None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    alive = [True, True]  # which rows still agree with the tokens accepted so far
    reached = [0, 0]
    i = 0
    while i < g and any(alive):
        row = 0 if alive[0] else 1
        p = probs[row, i]
        chosen = None
        for r in (0, 1):
            if not alive[r]:
                continue
            tok = int(rows[r, i + 1])
            q = draft_q[i] if r == 0 else None
            q_tok = float(q[tok]) if q is not None else 1.0
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u * q_tok < float(p[tok]):
                chosen = tok
                break
            if q is not None:
                residual = (p - q).clamp_min(0)
            else:  # a point mass: the residual is p without the token
                residual = p.clone()
                residual[tok] = 0
            total = residual.sum()
            p = residual / total if total > 0 else p
        if chosen is None:
            return row, i, int(torch.multinomial(p, 1, generator=generator)), reached
        alive = [alive[r] and int(rows[r, i + 1]) == chosen for r in (0, 1)]
        i += 1
        reached = [i if alive[r] else reached[r] for r in (0, 1)]
    row = 0 if alive[0] else 1
    return row, i, int(torch.multinomial(probs[row, i], 1, generator=generator)), reached
