from dflash_quant.verify import parity


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
