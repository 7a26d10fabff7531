"""vLLM's page pool for hybrid targets (memory/hybrid.py) against what vLLM logs and allocates."""

from dataclasses import replace

from dflash_quant.memory.budget import BudgetSettings, cache_bytes, compute_budget, resolve_drafter, resolve_target
from dflash_quant.memory.engine import padding_layers
from dflash_quant.memory.engine import vllm_group_size as group_size
from dflash_quant.memory.gpus import GiB
from dflash_quant.memory.hybrid import hybrid_layout, state_page_bytes
from dflash_quant.memory.kv import parse_shape
from dflash_quant.memory.presets import load_preset


def test_block_size_reproduces_vllms_log_for_qwen36_27b():
    # vLLM logs "Setting attention block size to 784 tokens" for Qwen3.6-27B (fp32 ssm state, bf16 KV, no
    # speculation): one 4 KiB-per-token attention page must hold one layer's 3,207,168-byte state
    t = parse_shape(load_preset("qwen3.5-27b"))  # the 3.6 target has the 3.5 shapes
    assert state_page_bytes(t, 0, None) == 3 * 10240 * 2 + 48 * 128 * 128 * 4 == 3_207_168
    lay = hybrid_layout(t, kv_dtype=None, state_dtype=None, spec_tokens=0, prefix_caching=False)
    assert lay.block_tokens == 784
    assert lay.state_page_bytes == 784 * 4096 >= 3_207_168
    assert lay.state_slots == 1
    # fp8 KV halves the attention page per token: twice the tokens per block
    lay8 = hybrid_layout(t, kv_dtype="fp8", state_dtype=None, spec_tokens=0, prefix_caching=True)
    assert lay8.block_tokens == 1568 and lay8.state_slots == 2


def test_group_padding_matches_vllms_mtp_warning():
    # a 27B hybrid target with a 1-layer MTP drafter: buckets 17 (16 + 1 full attention) and 48 (state); vLLM
    # warns "Add 3 padding layers, may waste at most 6.25% KV cache memory": groups of 17, 48 -> 51
    assert group_size([17, 48]) == 17
    assert padding_layers({("full",): 17, ("state",): 48}) == {("full",): 0, ("state",): 3}
    # DFlash: the drafter's 5 layers are their own bucket, so groups of 5: 16 -> 20, 48 -> 50
    assert group_size([16, 48, 5]) == 5
    assert group_size([30, 40]) == 40  # close buckets: one group size, the larger


def test_state_slots_follow_prefix_caching_and_k():
    t = resolve_target("qwen3.5-27b", "int4")
    d = resolve_drafter("qwen3.5-27b-dflash").as_model("bf16")
    s = BudgetSettings(gpu_name="x", gpu_bytes=24 * GiB, context=32768, spec_tokens=15)
    on, off = cache_bytes(t, d, s, 32768), cache_bytes(t, d, replace(s, prefix_caching=False), 32768)
    assert on["target_state"] * 16 == off["target_state"] * 17  # 2 + K against 1 + K pages
    lay = hybrid_layout(t.shape, kv_dtype=None, state_dtype=None, spec_tokens=15, prefix_caching=True)
    assert lay.block_tokens == 864  # K=15 widens the conv state: 3,514,368 B per layer -> 858 -> 864 tokens
    blocks = -(-32768 // 864)
    assert on["target_kv"] == blocks * 864 * 64 * 1024  # 64 KiB/token, whole 864-token blocks
    # the 3.5 drafter preset is 5 full-attention layers of its own spec: groups of 5, 16 -> 20 attention
    # layers and 48 -> 50 state layers of pages
    b = compute_budget(t, replace(d, weight_bytes=0), s)
    assert b.components["kv_group_padding"] == 4 * blocks * 864 * 4096 + 2 * 17 * lay.state_page_bytes
