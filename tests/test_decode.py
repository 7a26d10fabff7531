import pytest
import torch
from tiny import save_drafter

from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.target import load_target
from dflash_quant.models.model import DFlashDrafter, DraftCache
from dflash_quant.speculative.decode import rejection_step, speculative_generate, target_generate


@pytest.fixture(scope="module")
def pair(tiny_pair):
    drafter, target = tiny_pair
    return load_drafter(drafter).model, load_target(target).model


@pytest.mark.parametrize("block", [2, 3, 4])
def test_greedy_speculative_output_equals_target_greedy(pair, block):
    drafter, target = pair
    for seed in range(2):
        ids = torch.randint(3, 120, (1, 7), generator=torch.Generator().manual_seed(seed))
        spec = speculative_generate(drafter, target, ids, 25, block_size=block)
        ref = target_generate(target, ids, 25)
        assert spec.tokens == ref.tokens
        assert len(spec.tokens) == 25
        assert sum(spec.acceptance_lengths) == 25 - 1  # the first token comes from the prefill
        assert all(1 <= a <= block for a in spec.acceptance_lengths)
        assert spec.target_forwards == len(spec.acceptance_lengths) + 1


class _Oracle(torch.nn.Module):
    """A 'drafter' that proposes the target's own greedy continuation (known in advance)."""

    def __init__(self, drafter, ref, prompt_len):
        super().__init__()
        self.config, self.ref, self.n = drafter.config, ref + [0] * 16, prompt_len
        self.block_size, self.mask_token_id, self.target_layer_ids = (
            drafter.block_size,
            drafter.mask_token_id,
            drafter.target_layer_ids,
        )

    def forward(self, noise, ctx, positions, cache=None):
        q = noise.shape[1]
        first = int(positions[0, -q]) - self.n  # index of the anchor in the continuation
        return torch.tensor(self.ref[first : first + q])[None, :, None]

    def compute_logits(self, hidden, head):
        return torch.nn.functional.one_hot(hidden[..., 0], 123).float()

    propose = DFlashDrafter.propose  # drafting from compute_logits, as the v1 drafter does


def test_drafter_that_copies_target_is_fully_accepted(pair):
    drafter, target = pair
    ids = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = target_generate(target, ids, 30).tokens
    spec = speculative_generate(_Oracle(drafter, ref, 6), target, ids, 30)
    assert spec.tokens == ref
    assert spec.acceptance_lengths[:-1] == [4] * (len(spec.acceptance_lengths) - 1)
    assert spec.accepted[:-1] == [3] * (len(spec.accepted) - 1)


def test_stop_token_ends_generation(pair):
    drafter, target = pair
    ids = torch.randint(3, 120, (1, 7), generator=torch.Generator().manual_seed(1))
    ref = target_generate(target, ids, 20).tokens
    stop = ref[5]
    spec = speculative_generate(drafter, target, ids, 20, stop_token_ids=[stop])
    assert spec.tokens == ref[: ref.index(stop) + 1]
    assert target_generate(target, ids, 20, stop_token_ids=[stop]).tokens == spec.tokens


def test_context_cache_matches_one_shot_forward(pair):
    drafter, _ = pair
    torch.manual_seed(0)
    ctx, noise = torch.randn(1, 12, 128), torch.randn(1, 4, 64)
    full = drafter(noise, ctx, torch.arange(16)[None])
    cache = DraftCache()
    drafter(torch.randn(1, 4, 64), ctx[:, :7], torch.arange(11)[None], cache=cache)
    assert cache.length == 7 and cache.keys[0].shape[2] == 7  # block rows are never cached
    two = drafter(noise, ctx[:, 7:], torch.arange(7, 16)[None], cache=cache)
    torch.testing.assert_close(two, full, atol=1e-5, rtol=0)


def test_sliding_window_cache_is_trimmed_without_changing_outputs(tmp_path):
    drafter = load_drafter(
        save_drafter(tmp_path / "swa", layer_types=["sliding_attention", "full_attention"], sliding_window=5, std=0.2)
    ).model
    torch.manual_seed(0)
    ctx, noise = torch.randn(1, 20, 128), torch.randn(1, 4, 64)
    full = drafter(noise, ctx, torch.arange(24)[None])
    cache = DraftCache()
    for lo, hi in [(0, 9), (9, 15)]:
        drafter(torch.randn(1, 4, 64), ctx[:, lo:hi], torch.arange(lo, hi + 4)[None], cache=cache)
    assert cache.keys[0].shape[2] == 4 and cache.keys[1].shape[2] == 15  # window-1 rows vs all rows
    out = drafter(noise, ctx[:, 15:], torch.arange(15, 24)[None], cache=cache)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=0)
    # The window really matters: a wide-window drafter with the same weights differs.
    assert not torch.allclose(
        full,
        load_drafter(
            save_drafter(
                tmp_path / "wide", layer_types=["sliding_attention", "full_attention"], sliding_window=64, std=0.2
            )
        ).model(noise, ctx, torch.arange(24)[None]),
        atol=1e-4,
    )


def test_rejection_sampling_preserves_target_distribution():
    """First emitted token ~ p exactly, whatever q is (chi-square on a 5-token vocabulary, fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.4]])
    n = 6000
    counts = torch.zeros(5)
    for _ in range(n):
        draft = torch.multinomial(q[0], 1, generator=gen)
        acc, nxt = rejection_step(draft, p, q, gen)
        counts[int(draft) if acc == 1 else nxt] += 1
    expected = p[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # p = 0.001 critical value, 4 degrees of freedom
    # And it is not trivially passing: the draft distribution itself is far off.
    assert float(((q[0] * n - expected) ** 2 / expected).sum()) > 1000


def test_sampling_run_is_reproducible_and_counts_add_up(pair):
    drafter, target = pair
    ids = torch.randint(3, 120, (1, 7), generator=torch.Generator().manual_seed(2))
    a = speculative_generate(drafter, target, ids, 30, temperature=0.8, generator=torch.Generator().manual_seed(3))
    b = speculative_generate(drafter, target, ids, 30, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens and len(a.tokens) == 30
    assert sum(a.acceptance_lengths) == 29
