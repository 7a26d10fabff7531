import pytest

from dflash_quant.config import default_target_layer_ids, parse_draft_config
from dflash_quant.errors import DFlashQuantError
from tiny import drafter_raw_config


def test_keys_inside_dflash_config():
    cfg = parse_draft_config(drafter_raw_config())
    assert cfg.mask_token_id == 2 and cfg.target_layer_ids == [0, 2] and cfg.block_size == 4


def test_keys_top_level_and_rope_parameters():
    raw = drafter_raw_config(mask_token_id=7, target_layer_ids=[1, 3], block_size=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raw.pop("dflash_config")
    raw.pop("rope_theta")
    cfg = parse_draft_config(raw)
    assert (cfg.mask_token_id, cfg.target_layer_ids, cfg.block_size) == (7, [1, 3], 16)
    assert cfg.rope_parameters["rope_theta"] == 1e6


def test_flat_rope_theta_is_kept():
    cfg = parse_draft_config(drafter_raw_config(rope_theta=5e5))
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}


def test_missing_target_layer_ids_uses_published_fallback():
    raw = drafter_raw_config(num_target_layers=36, num_hidden_layers=5, dflash_config={"mask_token_id": 2})
    cfg = parse_draft_config(raw)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16's published taps
    assert default_target_layer_ids(36, 1) == [18]


def test_missing_target_layer_ids_without_layer_count_is_an_error():
    raw = drafter_raw_config(dflash_config={"mask_token_id": 2})
    raw.pop("num_target_layers")
    with pytest.raises(DFlashQuantError, match="num_target_layers"):
        parse_draft_config(raw)


def test_sliding_layers_are_causal_with_window_unless_is_causal_given():
    raw = drafter_raw_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    cfg = parse_draft_config(raw)
    assert cfg.attention_kind(0) == (True, 6) and cfg.attention_kind(1) == (False, None)
    cfg = parse_draft_config({**raw, "is_causal": False})
    assert cfg.attention_kind(0) == (False, 6)


def test_missing_layer_types_means_full_attention():
    cfg = parse_draft_config(drafter_raw_config())
    assert all(cfg.attention_kind(i) == (False, None) for i in range(cfg.num_hidden_layers))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("dflash_config"), "mask_token_id"),
        (lambda r: (r.pop("dflash_config"), r.pop("architectures")), "not a DFlash drafter config"),
        (lambda r: r.pop("hidden_size"), "hidden_size"),
        (lambda r: r.update(block_size=1), "block_size"),
        (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
        (lambda r: r["dflash_config"].update(conv_kernel_size=4), "DFlash2"),
    ],
)
def test_bad_configs(edit, message):
    raw = drafter_raw_config()
    raw["dflash_config"] = dict(raw["dflash_config"])
    edit(raw)
    with pytest.raises(DFlashQuantError, match=message):
        parse_draft_config(raw)


def test_roundtrip_through_to_dict():
    cfg = parse_draft_config(drafter_raw_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6))
    again = parse_draft_config(cfg.to_dict())
    assert again.target_layer_ids == cfg.target_layer_ids and again.sliding_window == 6 and again.block_size == cfg.block_size
