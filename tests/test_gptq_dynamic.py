"""GPTQ `dynamic` overrides for a mix: written rules read back to exactly the picks, with vLLM's first-match rule."""

import json

import pytest

from dflash_quant.errors import UsageError
from dflash_quant.export.gptq_dynamic import (
    base_setting,
    dynamic_overrides,
    resolve,
    tie_fused,
    vllm_fused_conflicts,
)
from dflash_quant.quantize.mixed import Candidate

C4, C3, C8 = Candidate(4, 128), Candidate(3, 128), Candidate(8, 32)


def mix():
    picks = {}
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            picks[f"layers.{i}.self_attn.{p}"] = C4
        for p in ("gate_proj", "up_proj", "down_proj"):
            picks[f"layers.{i}.mlp.{p}"] = C3
    picks["layers.1.self_attn.v_proj"] = C8
    picks["layers.1.mlp.down_proj"] = C4
    return picks


def test_round_trip_through_json():
    picks = mix()
    base = base_setting(picks)
    assert base == C4  # 7 of 14 at 4 bits
    dyn = json.loads(json.dumps(dynamic_overrides(picks, base)))
    assert dyn["+:^layers\\.1\\.self_attn\\.v_proj$"] == {"bits": 8, "group_size": 32}
    assert "+:^layers\\.1\\.mlp\\.down_proj$" not in dyn  # same as the base
    for name, c in picks.items():
        assert resolve(dyn, name, base) == c
    # anchored: layers.1 rules must not catch layers.11 or a longer name
    assert resolve(dyn, "layers.11.self_attn.v_proj", base) == base
    assert resolve(dyn, "layers.1.self_attn.v_proj_extra", base) == base


def test_resolve_follows_first_match_and_skip():
    dyn = {"-:.*lm_head": {}, "+:.*proj": {"bits": 8}, ".*q_proj": {"bits": 2}}
    assert resolve(dyn, "lm_head", C4) is None
    assert resolve(dyn, "layers.0.q_proj", C4) == Candidate(8, 128)  # the earlier rule wins


def test_fused_conflicts_and_tie():
    picks = mix()
    assert vllm_fused_conflicts(picks) == ["layers.1.self_attn.qkv_proj"]
    tied = tie_fused(picks)
    assert vllm_fused_conflicts(tied) == []
    assert tied["layers.1.self_attn.q_proj"] == C8 and tied["layers.0.self_attn.q_proj"] == C4
    assert tied["layers.1.mlp.down_proj"] == C4  # not fused: unchanged


def test_empty_mix_refused():
    with pytest.raises(UsageError, match="at least one quantized Linear"):
        base_setting({})
