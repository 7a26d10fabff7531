"""Budget model: arithmetic identities, monotonicity, bad inputs."""

import pytest

from dflash_quant.errors import UsageError
from dflash_quant.memory.budget import (
    BudgetSettings,
    compare_drafters,
    compute_budget,
    resolve_drafter,
    resolve_target,
)
from dflash_quant.memory.gpus import GiB, parse_bytes, resolve_gpu
from dflash_quant.memory.kv import recurrent_state_bytes


def _settings(**kw):
    base = dict(gpu_name="rtx4090", gpu_bytes=24 * GiB, context=8192, spec_tokens=15)
    return BudgetSettings(**{**base, **kw})


def test_parse_bytes_units():
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("24GB") == 24_000_000_000
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1024") == 1024
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_gpu_names_and_sizes():
    assert resolve_gpu("rtx4090").total_bytes == 24 * GiB
    assert resolve_gpu("RTX_3090").total_bytes == 24 * GiB
    assert resolve_gpu("24GiB").total_bytes == 24 * GiB
    with pytest.raises(UsageError, match="unknown GPU"):
        resolve_gpu("rtx9090")


def test_budget_identities_and_drafter_comparison():
    t = resolve_target("qwen3.5-27b", "int4")
    d = resolve_drafter("qwen3.6-27b-dflash")
    out = compare_drafters(t, d, _settings(max_num_seqs=8, gpu_memory_utilization=0.95, state_dtype="bf16"))
    bf16, int4 = out["bf16"], out["int4"]
    for b in (bf16, int4):
        assert b.required_bytes == sum(b.components.values())
        assert b.headroom_bytes == b.usable_bytes - b.required_bytes
        assert b.fits == (b.headroom_bytes >= 0)
        # K=15, bf16: 1.39 GiB of raw state (16 slots x 48 layers x 1,941,504 B) as vLLM lays it out: pages padded
        # to 480-token attention blocks (1,966,080 B), 17 slots with prefix caching (align mode; memory/hybrid.py)
        assert recurrent_state_bytes(t.shape, 15, ssm_dtype="bf16") == 16 * 48 * 1_941_504 == 1_491_075_072
        assert b.components["target_state"] == 17 * 48 * 1_966_080
        assert b.components["kv_group_padding"] == 0  # the 3.6 drafter's 4 sliding + 1 full: groups of 1
    assert int4.headroom_bytes - bf16.headroom_bytes == d.bf16_bytes - d.quantized_bytes
    assert int4.fits and not bf16.fits
    assert int4.max_context is not None and int4.max_context >= 8192


def test_max_context_is_the_largest_that_fits():
    t = resolve_target("qwen3-8b", "int4")
    d = resolve_drafter("qwen3-8b-dflash-b16").as_model("quantized")
    small = dict(gpu_bytes=12 * GiB)  # small enough that memory, not max_position_embeddings, limits
    b = compute_budget(t, d, _settings(context=4096, **small))
    assert b.fits and b.max_context > 4096 and b.max_context_limited_by == "memory"
    at = compute_budget(t, d, _settings(context=b.max_context, **small))
    # context is rounded up to the 16-token block, so the exact maximum may sit inside the last block
    above = compute_budget(t, d, _settings(context=b.max_context + 16, **small))
    assert at.fits and not above.fits
    c = compute_budget(t, d, _settings(context=4096, concurrency=b.max_concurrency, **small))
    c2 = compute_budget(t, d, _settings(context=4096, concurrency=b.max_concurrency + 1, **small))
    assert c.fits and not c2.fits


def test_reference_engine_dequantized_drafter_costs_bf16():
    t = resolve_target("qwen3-8b", "bf16")
    d = resolve_drafter("qwen3-8b-dflash-b16")
    out = compare_drafters(t, d, _settings(engine="reference", gpu_bytes=141 * GiB))
    assert out["bf16"].components["drafter_weights"] == out["int4"].components["drafter_weights"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(context=-1), "context"),
        (dict(concurrency=0), "concurrency"),
        (dict(spec_tokens=-2), "spec-tokens"),
        (dict(gpu_memory_utilization=1.5), "utilization"),
        (dict(engine="reference", concurrency=2), "one request"),
        (dict(engine="tgi"), "engine"),
    ],
)
def test_bad_settings(kw, match):
    t = resolve_target("qwen3-8b", "int4")
    d = resolve_drafter("qwen3-8b-dflash-b16").as_model("bf16")
    with pytest.raises(UsageError, match=match):
        compute_budget(t, d, _settings(**kw))


def test_target_and_drafter_roles_are_checked():
    with pytest.raises(UsageError, match="drafter"):
        resolve_target("qwen3-8b-dflash-b16")
    with pytest.raises(UsageError, match="not a DFlash drafter"):
        resolve_drafter("qwen3-8b")
