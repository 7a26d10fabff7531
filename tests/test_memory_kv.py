"""Cache and weight arithmetic with hand-computed expectations."""

import pytest

from dflash_quant.errors import DFlashQuantError
from dflash_quant.memory.kv import kv_per_token, parse_shape, recurrent_state_bytes
from dflash_quant.memory.presets import load_preset, preset_names
from dflash_quant.memory.weights import count_params, gptq_matrix_bytes, priced_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_qwen3_8b_full_attention_kv_is_144_kib_per_token():
    kv = kv_per_token(parse_shape(load_preset("qwen3-8b")))
    assert kv.full_bytes == 2 * 36 * 8 * 128 * 2 == 144 * KiB
    assert kv.sliding_bytes == 0
    assert kv.bytes_for(1000) == 1000 * 144 * KiB


def test_qwen3_32b_uses_config_head_dim_not_hidden_over_heads():
    kv = kv_per_token(parse_shape(load_preset("qwen3-32b")))
    assert kv.full_bytes == 2 * 64 * 8 * 128 * 2 == 256 * KiB  # hidden/heads would give 80


def test_five_layer_drafter_is_20_kib_per_token():
    cfg = {"hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}  # fmt: skip
    shape = parse_shape(cfg)
    assert shape.is_drafter and shape.num_taps == 5
    assert kv_per_token(shape).full_bytes == 5 * 2 * 8 * 128 * 2 == 20 * KiB
    assert kv_per_token(parse_shape(load_preset("qwen3-8b-dflash-b16"))).full_bytes == 20 * KiB


def test_fp8_kv_halves_bf16():
    assert kv_per_token(parse_shape(load_preset("qwen3-8b")), "fp8").full_bytes == 72 * KiB


def test_sliding_layers_are_capped_at_their_window():
    shape = parse_shape(load_preset("qwen3.6-27b-dflash"))  # [S,S,S,S,F], window 2048
    kv = kv_per_token(shape)
    per_layer = 2 * 8 * 128 * 2
    assert (kv.full_bytes, kv.sliding_bytes, kv.window) == (per_layer, 4 * per_layer, 2048)
    assert kv.bytes_for(1000) == 1000 * 5 * per_layer
    assert kv.bytes_for(10000) == 10000 * per_layer + 2048 * 4 * per_layer


def test_qwen35_27b_hybrid_layout_and_kv():
    shape = parse_shape(load_preset("qwen3.5-27b"))  # nested text_config
    assert (shape.n_full, shape.n_recurrent) == (16, 48)
    assert shape.layer_types[3] == "full_attention" and shape.layer_types[0] == "linear_attention"
    assert kv_per_token(shape).full_bytes == 2 * 16 * 4 * 256 * 2 == 64 * KiB


def test_qwen35_27b_state_per_request():
    shape = parse_shape(load_preset("qwen3.5-27b"))
    conv_dim = 2 * 16 * 128 + 48 * 128  # 10240
    state = 48 * 128 * 128
    # K = 15, everything bf16: 16 slots x 48 layers x (18 x conv_dim + state) x 2 bytes
    k15_bf16 = 16 * 48 * (18 * conv_dim + state) * 2
    assert recurrent_state_bytes(shape, 15, ssm_dtype="bf16") == k15_bf16 == 1_491_075_072
    assert k15_bf16 / GiB == pytest.approx(1.39, abs=0.005)
    # the config's mamba_ssm_dtype float32 applies to the recurrent state only
    k15 = recurrent_state_bytes(shape, 15)
    assert k15 == 16 * 48 * (18 * conv_dim * 2 + state * 4)
    assert k15 / GiB == pytest.approx(2.51, abs=0.01)
    assert recurrent_state_bytes(shape, 0, ssm_dtype="bf16") / MiB == pytest.approx(75, abs=0.5)
    assert recurrent_state_bytes(shape, 0) / MiB == pytest.approx(147, abs=0.5)


def test_config_without_layer_counts_is_refused():
    with pytest.raises(DFlashQuantError, match="num_hidden_layers"):
        parse_shape({"hidden_size": 4096, "num_attention_heads": 32})


def test_layer_types_length_mismatch_is_refused():
    cfg = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "layer_types": ["full_attention"]}
    with pytest.raises(DFlashQuantError, match="layer_types"):
        parse_shape(cfg)


def test_param_counts_match_published_sizes():
    assert count_params(parse_shape(load_preset("qwen3-8b"))).total_params / 1e9 == pytest.approx(8.19, abs=0.01)
    assert count_params(parse_shape(load_preset("qwen3-32b"))).total_params / 1e9 == pytest.approx(32.76, abs=0.01)
    drafter = count_params(parse_shape(load_preset("qwen3-8b-dflash-b16")))
    assert drafter.total_params / 1e9 == pytest.approx(1.05, abs=0.01)  # field notes: ~1.05 B
    big = priced_bytes(count_params(parse_shape(load_preset("qwen3.6-27b-dflash"))), "bf16")
    assert big / GiB == pytest.approx(3.22, abs=0.01)  # published safetensors size
    int4_27b = priced_bytes(count_params(parse_shape(load_preset("qwen3.5-27b"))), "int4")
    assert int4_27b / 1e9 == pytest.approx(17.8, abs=0.1)  # field notes: GPTQ int4 27B ~17.8 GB


def test_gptq_matrix_bytes_by_hand():
    # 4096 x 4096, 4 bits, group 128: qweight 4096*4096/2, qzeros 32*4096/2, scales 32*4096*2, g_idx 4096*4
    assert gptq_matrix_bytes(4096, 4096, 4, 128) == 8_388_608 + 65_536 + 262_144 + 16_384


def test_presets_name_their_sources():
    for name in preset_names():
        assert load_preset(name)["_sources"], name
