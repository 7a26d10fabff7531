"""The lookup proposer (dflash_quant.speculative.lookup) in the speculative loop: search, exactness, drafter context, reports."""

import pytest
import torch
from tiny import save_hybrid_target

from dflash_quant.errors import UsageError
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.target import load_target
from dflash_quant.speculative.decode import (
    SpecResult,
    rejection_step,
    speculative_generate,
    tap_states,
    target_generate,
)
from dflash_quant.speculative.lookup import (
    MODES,
    Lookup,
    LookupSettings,
    continuation,
    join_proposals,
    match,
    point_mass,
    two_row_step,
)
from dflash_quant.speculative.verify import CheckSettings, _split_acceptance, lookup_summary, summarize


@pytest.fixture(scope="module")
def pair(tiny_pair):
    drafter, target = tiny_pair
    return load_drafter(drafter).model, load_target(target).model


def _repeating_prompt(seed, n=7):
    ids = torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids], 1)  # the request repeats itself, so the lookup has something to find


def _brute_match(h, lo, hi):
    """The longest (lo..hi) suffix with an earlier occurrence, most recent first: a plain Python scan."""
    h = h.tolist()
    for n in range(min(hi, len(h) - 1), lo - 1, -1):
        suffix = h[len(h) - n :]
        for j in range(len(h) - 2, n - 2, -1):
            if h[j - n + 1 : j + 1] == suffix:
                return n, j
    return 0, -1


def test_vectorised_search_equals_a_plain_scan():
    gen = torch.Generator().manual_seed(0)
    found = 0
    for _ in range(300):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        h = torch.randint(0, vocab, (length,), generator=gen)
        lo = int(torch.randint(1, 4, (1,), generator=gen))
        hi = lo + int(torch.randint(0, 4, (1,), generator=gen))
        assert match(h, lo, hi) == _brute_match(h, lo, hi), (h.tolist(), lo, hi)
        found += match(h, lo, hi)[0] > 0
    assert 50 < found < 300  # both outcomes were exercised


def test_continuation_follows_the_most_recent_longest_match_and_repeats_periods():
    s = LookupSettings(min_ngram=1, max_ngram=3)
    # "7 8 9" occurred at 0..2 (followed by 4 5) and "8 9" at 6..7 (followed by 1): the 3-gram wins
    h = torch.tensor([7, 8, 9, 4, 5, 6, 8, 9, 1, 7, 8, 9])
    assert continuation(h, s, 3).tolist() == [4, 5, 6]
    # a repeating stretch keeps copying past the end of the history
    assert continuation(torch.tensor([3, 1, 2, 1, 2]), s, 5).tolist() == [1, 2, 1, 2, 1]
    assert continuation(torch.tensor([5, 6, 7]), s, 4).tolist() == []  # no earlier occurrence
    assert continuation(torch.tensor([1, 2, 3, 9, 2, 3]), LookupSettings(min_ngram=3, max_ngram=4), 2).tolist() == []


def test_both_defaults_to_a_lookup_row_longer_than_the_block():
    from dflash_quant.speculative.lookup import BOTH_TOKENS

    assert LookupSettings().tokens(8) == BOTH_TOKENS > 7 and LookupSettings().tokens(40) == 39
    assert LookupSettings("extend").tokens(8) == 7 and LookupSettings("both", max_tokens=7).tokens(8) == 7
    LookupSettings("both", max_tokens=7).check(8)
    with pytest.raises(UsageError, match="--lookup-max-tokens 6 is shorter than the drafter's block"):
        LookupSettings("both", max_tokens=6).check(8)
    LookupSettings("extend", max_tokens=2).check(8)  # other modes may propose fewer than a block


def test_settings_are_checked():
    for bad in (
        LookupSettings(mode="nope"),
        LookupSettings(min_ngram=3, max_ngram=2),
        LookupSettings(min_ngram=0),
        LookupSettings(max_tokens=0),
    ):
        with pytest.raises(UsageError):
            bad.check()


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_equals_target_greedy_with_lookup(pair, mode):
    drafter, target = pair
    used = 0
    for seed in range(3):
        ids = _repeating_prompt(seed)
        ref = target_generate(target, ids, 40).tokens
        spec = speculative_generate(drafter, target, ids, 40, lookup=LookupSettings(mode, 1, 3))
        assert spec.tokens == ref, f"{mode} prompt {seed}"
        assert sum(spec.acceptance_lengths) == 39
        assert len(spec.drafter_drafts) == len(spec.drafted)
        used += sum(d > k for d, k in zip(spec.drafted, spec.drafter_drafts, strict=False))
        if mode == "prefer":  # a lookup step skips the drafter
            lookup_steps = sum(k == 0 and d > 0 for d, k in zip(spec.drafted, spec.drafter_drafts, strict=False))
            assert spec.drafter_forwards == len(spec.drafted) - lookup_steps - (spec.drafted[-1] == 0)
    if mode != "agree":  # a random drafter never agrees with the lookup
        assert used > 0


def test_lookup_raises_tau_where_the_target_repeats_itself(pair):
    """The tiny target's greedy output falls into loops: lookup tokens get accepted and tau rises."""
    drafter, target = pair
    plain = [speculative_generate(drafter, target, _repeating_prompt(s), 40) for s in range(3)]
    looked = [
        speculative_generate(drafter, target, _repeating_prompt(s), 40, lookup=LookupSettings("prefer", 1, 3))
        for s in range(3)
    ]
    _, by_lookup, steps = _split_acceptance(looked)
    assert steps > 0 and by_lookup[0] > 0.3
    assert sum(r.tau for r in looked) > 1.3 * sum(r.tau for r in plain)


@pytest.mark.parametrize("mode", MODES)
def test_drafter_context_stays_exact(pair, mode):
    """Every context row the drafter is fed is the target's tap of that committed token, in order, whichever
    proposal was verified (a `prefer` step hands its rows on to the next drafter forward)."""
    drafter, target = pair
    ids = _repeating_prompt(4)
    fed = []
    real = drafter.forward

    def spy(noise, ctx, positions, cache=None):
        fed.append((int(positions[0, 0]), ctx.clone()))
        return real(noise, ctx, positions, cache=cache)

    drafter.forward = spy
    try:
        spec = speculative_generate(drafter, target, ids, 30, lookup=LookupSettings(mode, 1, 3))
    finally:
        del drafter.forward
    rows = torch.cat([c for _, c in fed], dim=1)
    assert [p for p, _ in fed][0] == 0
    full = torch.cat([ids[0], torch.tensor(spec.tokens)])[None]
    taps = tap_states(target(full, output_hidden_states=True).hidden_states, drafter.target_layer_ids, "cpu")
    assert rows.shape[1] <= full.shape[1]
    torch.testing.assert_close(rows, taps[:, : rows.shape[1]], atol=1e-4, rtol=1e-4)
    starts = [p for p, _ in fed]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrid_targets_stay_lossless_with_lookup(pair, tmp_path, family):
    drafter, _ = pair
    target = load_target(save_hybrid_target(tmp_path / family, family)).model
    ids = _repeating_prompt(0)
    ref = target_generate(target, ids, 30).tokens
    for mode in MODES:
        spec = speculative_generate(drafter, target, ids, 30, lookup=LookupSettings(mode, 1, 3))
        assert spec.tokens == ref, f"{family} {mode}"
        assert spec.replay_forwards > 0


def _tally(rows, row, acc, nxt, reached, first, second):
    """Count a two-row step's first committed token, and its second one after the first tokens watched."""
    assert reached[row] == acc and max(reached) == acc
    tokens = rows[row, 1 : acc + 1].tolist() + [nxt]
    first[tokens[0]] += 1
    if len(tokens) > 1 and tokens[0] in second:
        second[tokens[0]][tokens[1]] += 1


def _assert_target_marginals(first, second, p0, after):
    assert _chi2(first, p0) < 18.47  # p = 0.001, 4 degrees of freedom
    for tok, counts in second.items():
        assert counts.sum() > 500 and _chi2(counts, after[tok]) < 18.47, tok


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_point_mass_lookup_tokens_keep_the_target_distribution():
    """Lookup tokens are proposals with q = 1: the first emitted token ~ p0, and given that it is the first
    lookup token, the second ~ p1 (chi-square on a 5-token vocabulary, fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2] * 5])
    look = torch.tensor([1, 4])
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(6000):
        acc, nxt = rejection_step(look, p, point_mass(look), gen)
        first[1 if acc >= 1 else nxt] += 1
        if acc >= 1:
            second[4 if acc == 2 else nxt] += 1
    assert _chi2(first, p[0]) < 18.47  # p = 0.001, 4 degrees of freedom
    assert _chi2(second, p[1]) < 18.47
    # not trivially passing: always emitting the lookup token is far from p
    assert _chi2(torch.tensor([0.0, 6000, 0, 0, 0]) + 1e-9, p[0]) > 1000


def test_drafter_then_lookup_proposal_keeps_the_target_distribution():
    """`extend`: a sampled drafter token followed by a lookup token (join_proposals), chi-square per position."""
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2] * 5])
    q = torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.4]])
    look = torch.tensor([3])
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(8000):
        d = torch.multinomial(q[0], 1, generator=gen)
        proposal = join_proposals(q, 1, look, 5)
        drafts = torch.cat([d, look])
        acc, nxt = rejection_step(drafts, p, proposal, gen)
        first[int(d) if acc >= 1 else nxt] += 1
        if acc >= 1 and int(d) == 0:  # p's second row is the target's distribution after token 0
            second[3 if acc == 2 else nxt] += 1
    assert _chi2(first, p[0]) < 18.47
    assert second.sum() > 300 and _chi2(second, p[1]) < 18.47


def test_two_rows_at_t0_commit_the_row_that_got_further():
    """`both` at temperature 0: each row's accepted prefix is where it first differs from the target's argmax;
    the longer one is committed (the drafter's on a tie), with the target's token after it."""
    vocab = 6
    greedy = torch.tensor([[2, 3, 4, 5], [2, 1, 1, 0]])  # the target's argmax after each position, per row
    logits = torch.nn.functional.one_hot(greedy, vocab).float()
    rows = torch.tensor([[9, 2, 0, 0], [9, 2, 1, 1]])  # drafter: 1 accepted; lookup: all 3 accepted
    assert two_row_step(rows, logits, None, 0.0, None) == (1, 3, 0, [1, 3])
    rows = torch.tensor([[9, 2, 3, 4], [9, 2, 1, 1]])  # drafter: all 3, lookup: 3 too -> the drafter's row
    assert two_row_step(rows, logits, None, 0.0, None) == (0, 3, 5, [3, 3])
    rows = torch.tensor([[9, 0, 3, 4], [9, 1, 1, 1]])  # neither: the drafter's row and the target's token
    assert two_row_step(rows, logits, None, 0.0, None) == (0, 0, 2, [0, 0])


def test_two_rows_keep_the_target_distribution():
    """`both` at T>0: the drafter's sampled token is tried first, then the lookup's against the residual
    (multi-draft rejection); the first emitted token ~ p0 and the second, given the first, ~ that prefix's row
    of the target (chi-square on a 5-token vocabulary, fixed seed). The lookup proposes 3 then 1; the drafter
    often samples 3 too, so the rows share a prefix in some trials and branch in others."""
    gen = torch.Generator().manual_seed(4)
    p0 = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    after = torch.tensor(  # the target's distribution of the second token, given the first
        [
            [0.2] * 5,
            [0.1, 0.1, 0.2, 0.3, 0.3],
            [0.4, 0.3, 0.1, 0.1, 0.1],
            [0.05, 0.45, 0.2, 0.2, 0.1],
            [0.3] + [0.175] * 4,
        ]
    )
    q = torch.tensor([[0.05, 0.1, 0.15, 0.4, 0.3], [0.3, 0.1, 0.2, 0.2, 0.2]])
    look = torch.tensor([3, 1])
    first, second = torch.zeros(5), {3: torch.zeros(5), 4: torch.zeros(5)}
    for _ in range(8000):
        d = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(2)])
        rows = torch.stack([torch.cat([torch.tensor([0]), d]), torch.cat([torch.tensor([0]), look])])
        # per row: p0, then the row after its own first token, then uniform after two tokens
        probs = torch.stack([torch.stack([p0, after[int(r[1])], torch.full((5,), 0.2)]) for r in rows])
        row, acc, nxt, reached = two_row_step(rows, probs.log(), q, 1.0, gen)
        _tally(rows, row, acc, nxt, reached, first, second)
    _assert_target_marginals(first, second, p0, after)
    # not trivially passing: the lookup's first token is far more often proposed than p0 gives it
    assert _chi2(torch.tensor([0.0, 0, 0, 8000, 0]) + 1e-9, p0) > 1000


@pytest.mark.parametrize(
    ("family", "max_tokens"),
    [(None, 3), ("qwen3_5", 3), ("qwen3_next", 3), (None, 9), ("qwen3_5", 9), ("qwen3_next", 9)],
)
def test_both_verifies_two_rows_and_stays_lossless(pair, tmp_path, family, max_tokens, monkeypatch):
    """`both` verifies two rows on lookup steps (the target's cache forked, one row kept, linear-attention
    state included) and the output is still the target's greedy output. The random tiny targets do not copy,
    so the lookup here is an oracle (the target's own continuation, its last token wrong every other step) that
    makes the lookup row win, fully and partly, while the random drafter's row loses. max_tokens 3: both rows
    as long as the block (4: 3 drafts); 9: the lookup row 3x as long (row 0: 3 drafts, then 6 tail tokens)."""
    drafter, target = pair
    count = max_tokens
    if family is not None:
        target = load_target(save_hybrid_target(tmp_path / family, family)).model
    ids = _repeating_prompt(5)
    ref = target_generate(target, ids, 30).tokens
    n = ids.shape[1]

    def oracle(self, history, count=None):
        k = history.shape[0] - n  # the anchor is ref[k - 1]; the tokens after it are ref[k:]
        out = torch.tensor((ref + [0] * 64)[k : k + count])
        if k % 2:
            out[-1] = (out[-1] + 1) % 100
        return out

    monkeypatch.setattr(Lookup, "search", oracle)
    spec = speculative_generate(drafter, target, ids, 30, lookup=LookupSettings("both", 1, 3, max_tokens))
    assert spec.tokens == ref, family
    assert len(spec.verify_rows) == len(spec.drafted) and set(spec.verify_rows) <= {1, 2}
    assert spec.verified_tokens == sum(n * (d + 1) for n, d in zip(spec.verify_rows, spec.drafted, strict=True))
    two = [(d, g) for r, d, g in zip(spec.verify_rows, spec.drafted, spec.row_drafts, strict=True) if r == 2]
    assert two and all(g == min(3, d) and d <= count for d, g in two) and max(d for d, _ in two) == count
    won = [a for r, k, a in zip(spec.verify_rows, spec.drafter_drafts, spec.accepted, strict=True) if r == 2 and k == 0]
    assert len(won) >= 2 and max(won) == count and min(won) < count  # the lookup row committed, whole and in part
    for rows_, k, a, both in zip(spec.verify_rows, spec.drafter_drafts, spec.accepted, spec.row_accepted, strict=True):
        merged = rows_ == 1 and len(both) == 2  # the lookup row began with the drafts: one longer row
        assert (len(both) == 2) == (rows_ == 2) or (merged and both == [a, a])
        assert not both or both[int(k == 0)] == a >= both[int(k != 0)]
    if family is not None:
        assert spec.replay_forwards > 0


def test_two_rows_of_a_longer_lookup_row():
    """`Lookup.two_rows` with the lookup row longer than the block (block 4, 6 lookup tokens): row 0 is the
    drafts followed by the lookup continuation of (history + drafts); a lookup row that starts with the drafts
    is verified as one row; no match keeps the block alone. Row 0's proposal: the drafter's, then point masses."""
    looker = Lookup(LookupSettings("both", 2, 3, 6), 4)
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 5, 6] + [0] * 40)
    start = 12  # history ..., 5, 6: the lookup continues 7 8 9 10 11 12
    q = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(0)), -1)
    # drafts 9 10 11: the lookup of history + drafts continues 12 13 1
    blk, rows, prop = looker.two_rows(ids, start, torch.tensor([6, 9, 10, 11]), q, 40, 20)
    assert rows is not None and rows.tolist() == [[6, 9, 10, 11, 12, 13, 1], [6, 7, 8, 9, 10, 11, 12]]
    assert torch.equal(blk, rows[0]) and torch.equal(prop[:3], q)
    assert prop[3:].argmax(-1).tolist() == [12, 13, 1] and prop[3:].sum().item() == 3.0
    # drafts 4 3 17 have no match after them: row 0 is filled up with the lookup's own tokens
    _, rows, _ = looker.two_rows(ids, start, torch.tensor([6, 4, 3, 17]), None, 40, 20)
    assert rows is not None and rows[0].tolist() == [6, 4, 3, 17, 10, 11, 12]
    # drafts 7 8 9 are the lookup's first tokens: one row, the block then the rest of the lookup
    blk, rows, prop = looker.two_rows(ids, start, torch.tensor([6, 7, 8, 9]), q, 40, 20)
    assert rows is None and blk.tolist() == [6, 7, 8, 9, 10, 11, 12] and prop.shape == (6, 20)
    # the room left bounds the lookup row; no match keeps the block
    _, rows, _ = looker.two_rows(ids, start, torch.tensor([6, 4, 3, 17]), None, start + 5, 20)
    assert rows is not None and rows.shape == (2, 5)
    blk, rows, _ = looker.two_rows(torch.tensor([1, 2, 3, 4] + [0] * 9), 3, torch.tensor([4, 7, 7, 7]), None, 12, 20)
    assert rows is None and blk.tolist() == [4, 7, 7, 7]
    with pytest.raises(UsageError, match="shorter than the drafter's block"):
        Lookup(LookupSettings("both", 2, 3, 2), 4)


def test_two_rows_with_a_longer_lookup_row_keep_the_target_distribution():
    """T>0 with rows longer than the drafter's block: row 0 is one sampled drafter token then a lookup tail
    token (point mass, from join_proposals), row 1 two lookup tokens. The first emitted token ~ p0, the second
    given the first ~ that prefix's row of the target (chi-square, 5-token vocabulary, fixed seed)."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    after = torch.tensor(
        [
            [0.2] * 5,
            [0.1, 0.1, 0.2, 0.3, 0.3],
            [0.4, 0.3, 0.1, 0.1, 0.1],
            [0.05, 0.45, 0.2, 0.2, 0.1],
            [0.3] + [0.175] * 4,
        ]
    )
    q = torch.tensor([[0.05, 0.1, 0.15, 0.4, 0.3]])
    look, tail = torch.tensor([3, 1]), torch.tensor([2])
    first, second = torch.zeros(5), {1: torch.zeros(5), 3: torch.zeros(5)}
    for _ in range(8000):
        d = torch.multinomial(q[0], 1, generator=gen)
        rows = torch.stack([torch.cat([torch.tensor([0]), d, tail]), torch.cat([torch.tensor([0]), look])])
        probs = torch.stack([torch.stack([p0, after[int(r[1])], torch.full((5,), 0.2)]) for r in rows])
        row, acc, nxt, reached = two_row_step(rows, probs.log(), join_proposals(q, 1, tail, 5), 1.0, gen)
        _tally(rows, row, acc, nxt, reached, first, second)
    _assert_target_marginals(first, second, p0, after)
    # not trivially passing: the tail token 2 after 1 is proposed with q = 1 but has p = 0.2 there
    assert _chi2(torch.tensor([0.0, 0, 8000, 0, 0]) + 1e-9, after[1]) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("pair_name", ["reference", "reference-dflash2"])
def test_longer_lookup_row_is_lossless_on_the_reference_pairs(pair_name):
    """The shipped pairs at T=0 with `both` and a 16-token lookup row on reproduce prompts: the output equals
    the target's greedy output, and some steps commit more tokens than the drafter's block holds."""
    from dflash_quant.loading.runtime import encode_prompts, load_pair
    from dflash_quant.prompts import load_prompts

    drafter, target = load_pair(pair_name, None, torch.device("cpu"), torch.float32)
    cats = [p.category for p in load_prompts("builtin:calib")]
    encoded = encode_prompts(target, "builtin:calib", None, True)
    picked = [e for e, c in zip(encoded, cats, strict=True) if c == "reproduce"][:3]
    block = drafter.config.block_size
    longest = 0
    for e in picked:
        ids = torch.tensor([e])
        ref = target_generate(target.model, ids, 48).tokens
        spec = speculative_generate(drafter.model, target.model, ids, 48, lookup=LookupSettings("both", 2, 4, 16))
        assert spec.tokens == ref
        assert max(spec.drafted) <= 16
        longest = max(longest, max(spec.acceptance_lengths))
    assert longest > block


def test_sampling_with_lookup_is_reproducible_and_counts_add_up(pair):
    drafter, target = pair
    ids = _repeating_prompt(2)
    for mode in MODES:
        run = [
            speculative_generate(
                drafter,
                target,
                ids,
                30,
                temperature=0.8,
                generator=torch.Generator().manual_seed(3),
                lookup=LookupSettings(mode, 1, 3),
            )
            for _ in range(2)
        ]
        assert run[0].tokens == run[1].tokens and len(run[0].tokens) == 30
        assert sum(run[0].acceptance_lengths) == 29


def test_split_acceptance_counts_each_row_of_a_two_row_step():
    # step 1 (`both`): drafter row 1 accepted, lookup row 3 (committed); step 2: one row, 3 drafter drafts, 0
    # accepted; step 3: a lookup row of 6 that began with the 3 drafts, one row, 5 accepted; step 4: the last token
    r = SpecResult(
        tokens=list(range(12)),
        acceptance_lengths=[4, 1, 6, 1],
        accepted=[3, 0, 5, 0],
        drafted=[3, 3, 6, 0],
        drafter_drafts=[0, 3, 3, 0],
        verify_rows=[2, 1, 1, 1],
        row_accepted=[[1, 3], [], [5, 5], []],
        row_drafts=[3, 0, 3, 0],
    )
    drafter_pos, lookup_pos, steps = _split_acceptance([r])
    assert drafter_pos == [0.6667, 0.3333, 0.3333] and steps == 2
    assert lookup_pos == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # the merged row counts as the lookup's from its start


def test_split_acceptance_and_lookup_summary():
    # step 1: 3 drafter drafts, 2 accepted; step 2: 3 lookup tokens, all accepted; step 3 (extend): 3 drafter + 2
    # lookup, 4 accepted; step 4: the last token, nothing drafted
    r = SpecResult(
        tokens=list(range(14)),
        acceptance_lengths=[3, 4, 5, 1],
        accepted=[2, 3, 4, 0],
        drafted=[3, 3, 5, 0],
        drafter_drafts=[3, 0, 3, 0],
        seconds=1.0,
        lookup_seconds=0.01,
    )
    drafter_pos, lookup_pos, steps = _split_acceptance([r])
    assert drafter_pos == [1.0, 1.0, 0.5] and lookup_pos == [1.0, 0.5, 1.0] and steps == 2
    plain = SpecResult(
        tokens=list(range(14)),
        acceptance_lengths=[2] * 6 + [1],
        accepted=[1] * 6 + [0],
        drafted=[3] * 6 + [0],
        drafter_drafts=[3] * 6 + [0],
        seconds=1.0,
    )
    settings = CheckSettings(14, 0.0, 4, lookup=LookupSettings("extend", 2, 4))
    s_plain = summarize("d", [plain], None, settings, 4)
    rec = lookup_summary(s_plain, [plain], [r], None, settings, 4, ["code"])
    assert (
        rec["tau"] == 3.25 and rec["tau_without"] == round(13 / 7, 4) and rec["tau_ratio"] == round(3.25 / (13 / 7), 4)
    )
    assert rec["lookup_steps"] == 2 and rec["lookup_step_share"] == 0.5
    assert rec["by_category"]["code"]["tau"] == 3.25 and rec["by_category"]["code"]["lookup_step_share"] == 0.5
    assert (
        len(summarize("d", [r], None, settings, 4)["per_position_acceptance"]) == 5
    )  # `extend` verifies past the block


def test_verify_lookup_cli_reports_both_runs_by_category(tiny_pair, tmp_path):
    import json
    import os
    import subprocess
    import sys

    drafter, target = tiny_pair
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "w1 w2 w3 w4 w1 w2 w3 w4", "category": "reproduce"},
        {"prompt": "w9 w8 w7", "category": "chat"},
        {"prompt": "w5 w6 w5 w6 w5", "category": "reproduce"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "verify",
        str(drafter),
        "--target",
        str(target),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "24",
        "--lookup",
        "--lookup-mode",
        "extend",
        "--lookup-min-ngram",
        "1",
        "--json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)["summary"]
    lk = s["lookup"]
    assert lk["mode"] == "extend" and lk["min_ngram"] == 1 and lk["max_tokens"] == 3
    assert lk["lossless"] is True and s["lossless"] is True and lk["tau_without"] == s["tau"]
    assert lk["tau_ratio"] == pytest.approx(lk["tau"] / s["tau"], abs=1e-3)
    assert lk["lookup_steps"] > 0 and 0 < lk["lookup_step_share"] <= 1
    assert len(lk["per_position_acceptance_drafter"]) == 3 and lk["per_position_acceptance_lookup"]
    assert set(s["by_category"]) == {"reproduce", "chat"} and s["by_category"]["reproduce"]["prompts"] == 2
    assert set(lk["by_category"]) == {"reproduce", "chat"}
    from dflash_quant.artifact.reports import Check

    check = Check.from_dict(s)  # the report contract reads it back with its typed fields
    assert check.lookup.tau == lk["tau"] and check.by_category["chat"].tau == s["by_category"]["chat"]["tau"]
    bad = subprocess.run(cmd[:-5] + ["--lookup-mode", "nope"], capture_output=True, text=True, timeout=120)
    assert (
        bad.returncode == 2 and "unknown lookup mode 'nope'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    )


def test_gptq_parity_with_lookup_on_the_reference_pair(tmp_path):
    """`run_gptq` with lookup: both drafters get a lookup record beside the gate, read back by Parity."""
    from dflash_quant.artifact.reports import Parity
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq

    out = tmp_path / "int4"
    job = GptqJob(
        output=out,
        calib_num_prompts=4,
        calib_max_new_tokens=16,
        eval_prompts="builtin:heldout",
        eval_num_prompts=2,
        eval_max_new_tokens=24,
        device="cpu",
        write_card=False,
        lookup=LookupSettings(),  # the default rule, `both`
    )
    result = run_gptq(job)
    par = Parity.read(out)
    for check in (par.baseline, par.quantized):
        assert check.lookup is not None and check.lookup.lossless is True and check.lookup.mode == "both"
        assert check.lookup.tau_without == check.tau and check.by_category["code"].prompts == 2
    assert result.passed is True


def test_dflash2_drafter_with_both_on_a_hybrid_target(tmp_path):
    """A DFlash2 drafter (selector proposal: candidate ids and probabilities) with `both` on a hybrid target:
    lossless at T=0, and at T>0 reproducible with the two-row walk taking the selector's proposal."""
    from tiny import save_dflash2_drafter

    d2 = load_drafter(save_dflash2_drafter(tmp_path / "d2", std=0.2)).model
    target = load_target(save_hybrid_target(tmp_path / "t", "qwen3_5")).model
    ids = _repeating_prompt(6)
    ref = target_generate(target, ids, 24).tokens
    spec = speculative_generate(d2, target, ids, 24, lookup=LookupSettings("both", 1, 3))
    assert spec.tokens == ref and 2 in spec.verify_rows
    sampled = [
        speculative_generate(
            d2, target, ids, 24, 0.8, generator=torch.Generator().manual_seed(7), lookup=LookupSettings("both", 1, 3)
        )
        for _ in range(2)
    ]
    assert sampled[0].tokens == sampled[1].tokens and len(sampled[0].tokens) == 24
    assert 2 in sampled[0].verify_rows and sum(sampled[0].acceptance_lengths) == 23
