"""Mixed-precision search on hand-checkable synthetic sensitivities, and the candidate error on a real GPTQ solve."""

import itertools

import pytest
import torch

from dflash_quant.errors import UsageError
from dflash_quant.quantize.mixed import (
    Candidate,
    bits_per_weight_bytes,
    candidate_errors,
    coded_bits_per_weight,
    max_quality,
    min_bytes,
    output_error,
    packed_bytes,
)

B2, B4, B8 = Candidate(2, 128), Candidate(4, 128), Candidate(8, 128)

# a: sensitive (2-bit costs a lot); b: insensitive; c: in between
OPTIONS = {
    "a": {B2: (10, 5.0), B4: (20, 1.0), B8: (40, 0.0)},
    "b": {B2: (10, 0.2), B4: (20, 0.1), B8: (40, 0.0)},
    "c": {B2: (10, 2.0), B4: (20, 0.5), B8: (40, 0.0)},
}


def brute(options, ok):
    names = list(options)
    best = None
    for combo in itertools.product(*(list(options[n]) for n in names)):
        b = sum(options[n][c][0] for n, c in zip(names, combo, strict=True))
        loss = sum(options[n][c][1] for n, c in zip(names, combo, strict=True))
        if ok(b, loss) and (best is None or (b, loss) < best[:2]):
            best = (b, loss, combo)
    return best


def test_max_quality_by_hand():
    # 60 bytes: 8-bit a costs 40 leaving 2x10 (loss 2.2); 4/4/4 costs 60 with loss 1.6; a4 b2 c4 is 50 bytes, 1.7
    ch = max_quality(OPTIONS, 60, resolution=1)
    assert ch.picks == {"a": B4, "b": B4, "c": B4}
    assert ch.total_bytes == 60 and ch.total_loss == pytest.approx(1.6)
    # 50 bytes: a at 4 bits, b at 2 bits (cheapest to give up), c at 4 bits
    ch = max_quality(OPTIONS, 50, resolution=1)
    assert ch.picks == {"a": B4, "b": B2, "c": B4}
    assert ch.total_loss == pytest.approx(1.7)


def test_min_bytes_by_hand():
    # loss <= 1.7: a4 b2 c4 (50 bytes) is the smallest; a4 b2 c2 (40) has loss 3.2
    ch = min_bytes(OPTIONS, 1.7, resolution=1)
    assert ch.picks == {"a": B4, "b": B2, "c": B4}
    assert ch.total_bytes == 50
    # zero loss forces everything to 8 bits
    assert min_bytes(OPTIONS, 0.0, resolution=1).picks == {"a": B8, "b": B8, "c": B8}


def test_search_matches_brute_force_on_random_tables():
    g = torch.Generator().manual_seed(0)
    cands = [Candidate(b, gs) for b in (2, 3, 4, 8) for gs in (32, 128)]
    for _ in range(20):
        opts = {
            f"l{i}": {
                c: (int(torch.randint(1, 50, (1,), generator=g)), float(torch.rand(1, generator=g))) for c in cands
            }
            for i in range(4)
        }
        budget = int(torch.randint(10, 200, (1,), generator=g))
        want = brute(opts, lambda b, _loss, budget=budget: b <= budget)
        if want is None:
            with pytest.raises(UsageError):
                max_quality(opts, budget, resolution=1)
            continue
        want_loss = min(
            sum(opts[n][c][1] for n, c in zip(opts, combo, strict=True))
            for combo in itertools.product(*(list(opts[n]) for n in opts))
            if sum(opts[n][c][0] for n, c in zip(opts, combo, strict=True)) <= budget
        )
        got = max_quality(opts, budget, resolution=1)
        assert got.total_bytes <= budget
        assert got.total_loss == pytest.approx(want_loss)
        cap = float(torch.rand(1, generator=g)) * 2
        want = brute(opts, lambda _b, loss, cap=cap: loss <= cap + 1e-12)
        if want is None:
            with pytest.raises(UsageError):
                min_bytes(opts, cap, resolution=1)
            continue
        got = min_bytes(opts, cap, resolution=1)
        assert got.total_bytes == want[0] and got.total_loss <= cap + 1e-9


def test_coarse_grid_never_exceeds_budget():
    ch = max_quality(OPTIONS, 59, resolution=7)
    assert ch.total_bytes <= 59


def test_refusals():
    with pytest.raises(UsageError, match="below the smallest possible drafter"):
        max_quality(OPTIONS, 29, resolution=1)
    with pytest.raises(UsageError, match="loosen --max-tau-loss"):
        min_bytes({"a": {B2: (10, 1.0)}}, 0.5)
    with pytest.raises(UsageError, match="at least one Linear"):
        max_quality({}, 10)
    with pytest.raises(UsageError, match="loss finite"):
        min_bytes({"a": {B2: (10, float("nan"))}}, 1.0)
    with pytest.raises(UsageError, match="finite number"):
        min_bytes(OPTIONS, -1.0)


def test_packed_bytes_gptq_v1():
    # 64x256 at 4 bits g128: qweight 256*4/32*64*4, qzeros 2*ceil(64*4/32)*4, scales 2*64*2, g_idx 256*4
    assert packed_bytes(64, 256, Candidate(4, 128)) == 8192 + 64 + 256 + 1024
    assert packed_bytes(64, 256, Candidate(2, 32)) < packed_bytes(64, 256, Candidate(3, 32))


def test_bits_per_weight_counts_codes_scales_and_zeros_not_g_idx():
    shapes = [(64, 256), (128, 768), (96, 128)]
    u3 = sum(packed_bytes(o, i, Candidate(3, 128)) for o, i in shapes)
    # 3 bits + an fp16 scale and a 3-bit zero per 128 weights; g_idx (4 bytes per input column) not counted
    assert coded_bits_per_weight(shapes, u3) == pytest.approx(3 + 16 / 128 + 3 / 128)
    assert u3 <= bits_per_weight_bytes(shapes, 3.25) < sum(packed_bytes(o, i, Candidate(4, 128)) for o, i in shapes)
    budget = bits_per_weight_bytes(shapes, 3.25)
    assert coded_bits_per_weight(shapes, budget) <= 3.25 < coded_bits_per_weight(shapes, budget + 1)


def test_candidate_errors_order_with_bits():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(32, 128, generator=g)
    X = torch.randn(512, 128, generator=g)
    H = X.T @ X / X.shape[0]
    errs = candidate_errors(W, H, [Candidate(b, 32) for b in (2, 3, 4, 8)])
    e = [errs[Candidate(b, 32)] for b in (2, 3, 4, 8)]
    assert e[0] > e[1] > e[2] > e[3] > 0
    assert output_error(W, W, H) == 0.0
