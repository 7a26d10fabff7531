"""Sensitivity table from calibration Hessians: errors fall with bits, bytes match GPTQ v1, cache round-trip."""

import torch

from dflash_quant.calibration.capture import CalibrationStats
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.quantize.mixed import Candidate, max_quality, packed_bytes
from dflash_quant.quantize.mixed_table import build_table, load_table, save_table

CANDS = [Candidate(b, g) for b in (2, 3, 4, 8) for g in (32, 128)]


def stats_and_weights():
    g = torch.Generator().manual_seed(2)
    acc = {}
    for grp in ("layers.0.self_attn.qkv", "layers.0.self_attn.o_proj"):
        a = HessianAccumulator(128, name=grp)
        a.add(torch.randn(256, 128, generator=g))
        acc[grp] = a
    stats = CalibrationStats(hessians=acc, kv_hessian="block")
    weights = {
        "layers.0.self_attn.q_proj": torch.randn(64, 128, generator=g),
        "layers.0.self_attn.o_proj": torch.randn(128, 128, generator=g),
    }
    return stats, weights


def test_table_orders_and_bytes(tmp_path):
    stats, weights = stats_and_weights()
    table = build_table(weights, stats, CANDS)
    for name, W in weights.items():
        errs = [table[name][Candidate(b, 32)][1] for b in (2, 3, 4, 8)]
        assert errs == sorted(errs, reverse=True) and 0 < errs[-1] < errs[0] < 1
        assert table[name][Candidate(4, 128)][0] == packed_bytes(W.shape[0], W.shape[1], Candidate(4, 128))
    key = {"model": "x", "prompts": 4}
    save_table(tmp_path, table, key)
    assert load_table(tmp_path, key) == table
    assert load_table(tmp_path, {"model": "y"}) is None
    # a budget between uniform 3 and 4 bits buys a mix strictly better than uniform 3-bit g128
    u3 = sum(table[n][Candidate(3, 128)][0] for n in table)
    ch = max_quality(table, u3, resolution=1)
    assert ch.total_bytes <= u3
    assert ch.total_loss <= sum(table[n][Candidate(3, 128)][1] for n in table)
