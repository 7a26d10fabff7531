from dflash_quant.speculative.verify import parity


def _check(tau, lossless, accept=(0.8, 0.5)):
    return {"tau": tau, "lossless": lossless, "per_position_acceptance": list(accept)}


def test_tau_ratio_tolerance():
    assert parity(_check(4.0, True), _check(3.9, True), 0.03, greedy=True)["passed"]
    bad = parity(_check(4.0, True), _check(3.8, True), 0.03, greedy=True)
    assert not bad["passed"] and "tau ratio 0.9500" in bad["reasons"][0]
    assert bad["per_position_ratio"] == [1.0, 1.0]


def test_lossless_is_gated_only_in_exact_runs():
    fp32 = parity(_check(4.0, True), _check(4.0, False), 0.03, greedy=True, exact=True)
    assert not fp32["passed"] and fp32["lossless_gated"]
    bf16 = parity(_check(4.0, False), _check(4.0, False), 0.03, greedy=True, exact=False)
    assert bf16["passed"] and not bf16["lossless_gated"] and "not gated" in bf16["notes"][0]
    sampled = parity(_check(4.0, None), _check(4.0, None), 0.03, greedy=False)
    assert sampled["passed"] and not sampled["lossless_gated"]


# --- bf16 near-ties: reported as "lossless up to numerics", a clear-margin divergence still fails ---

from dflash_quant.speculative.decode import GreedyResult, SpecResult  # noqa: E402
from dflash_quant.speculative.verify import CheckSettings, divergences, near_tie_margin, summarize  # noqa: E402


def _spec(tokens):
    return SpecResult(
        tokens=tokens, acceptance_lengths=[1] * len(tokens), accepted=[0] * len(tokens), drafted=[3] * len(tokens)
    )


def _base(tokens, margins, dtype="bfloat16", top1=20.0):
    return GreedyResult(
        tokens=tokens,
        seconds=1.0,
        target_forwards=len(tokens),
        top1_logits=[top1] * len(tokens),
        margins=margins,
        logits_dtype=dtype,
    )


def test_near_tie_margin_is_ulps_of_the_top1_logit():
    assert near_tie_margin(20.0, "bfloat16") == 8 * 2.0 ** (4 - 7)  # 20 in [16, 32): ulp 0.125
    assert near_tie_margin(-3.0, "bfloat16") == 8 * 2.0 ** (1 - 7)
    assert near_tie_margin(20.0, "float32") == 8 * 2.0 ** (4 - 23)


def test_divergences_report_first_position_and_target_margin():
    runs = [_spec([5, 6, 7, 8]), _spec([5, 9, 9, 9]), _spec([1, 2])]
    base = [_base([5, 6, 7, 8], [3, 3, 3, 3]), _base([5, 6, 7, 8], [3, 0.25, 3, 3]), _base([1, 3], [2, 2.5])]
    rate, found = divergences(runs, base)
    assert rate == (4 + 1 + 1) / 10
    assert [(d["prompt_index"], d["position"]) for d in found] == [(1, 1), (2, 1)]
    assert found[0]["target_margin"] == 0.25 and found[0]["near_tie"] is True
    assert found[1]["target_margin"] == 2.5 and found[1]["near_tie"] is False


def _summary(runs, base):
    return summarize("d", runs, base, CheckSettings(max_new_tokens=4), block=4)


def test_bf16_near_tie_divergence_is_a_note_and_clear_margin_fails():
    base = [_base([5, 6, 7, 8], [3, 0.25, 3, 3])]
    ok = _summary([_spec([5, 6, 7, 8])], base)
    tie = _summary([_spec([5, 9, 9, 9])], base)
    assert ok["lossless_status"] == "exact" and tie["lossless_status"] == "near-ties" and tie["lossless"] is False
    verdict = parity(ok, tie, tolerance=1.0, greedy=True, exact=False)
    assert verdict["passed"] and "lossless up to bfloat16 numerics" in verdict["notes"][0]
    clear = _summary([_spec([5, 6, 9, 9])], base)  # diverges at position 2, margin 3.0 > 1.0
    assert clear["lossless_status"] == "diverged"
    verdict = parity(ok, clear, tolerance=1.0, greedy=True, exact=False)
    assert not verdict["passed"] and "clear margin" in verdict["reasons"][0]
    # fp32 runs gate on any difference, near-tie or not
    assert not parity(ok, tie, tolerance=1.0, greedy=True, exact=True)["passed"]


def test_target_generate_records_margins(tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_quant.speculative.decode import target_generate

    target = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    run = target_generate(target, torch.tensor([[3, 4, 5]]), 6)
    assert len(run.margins) == len(run.tokens) == len(run.top1_logits) == 6
    with torch.no_grad():
        logits = target(torch.tensor([[3, 4, 5]])).logits[0, -1]
    top = logits.topk(2).values
    assert abs(run.margins[0] - float(top[0] - top[1])) < 1e-5 and run.logits_dtype == "float32"
