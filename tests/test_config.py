import pytest
from tiny import drafter_raw_config

from dflash_quant.errors import DFlashQuantError
from dflash_quant.models.config import default_target_layer_ids, parse_draft_config


def test_keys_inside_dflash_config():
    cfg = parse_draft_config(drafter_raw_config())
    assert cfg.mask_token_id == 2 and cfg.target_layer_ids == [0, 2] and cfg.block_size == 4


def test_keys_top_level_and_rope_parameters():
    raw = drafter_raw_config(
        mask_token_id=7,
        target_layer_ids=[1, 3],
        block_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
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
        (lambda r: r["dflash_config"].update(conv_kernel_size=4), "DFlash2 drafter but lacks conv_group_size"),
        (lambda r: r.update(architectures=["DFlash2DraftModel"]), "lacks conv_kernel_size"),
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
    assert (
        again.target_layer_ids == cfg.target_layer_ids
        and again.sliding_window == 6
        and again.block_size == cfg.block_size
    )


def _v2(**nested) -> dict:
    from tiny import dflash2_raw_config

    raw = dflash2_raw_config()
    raw["dflash_config"] = {**raw["dflash_config"], **nested}
    return raw


def test_dflash2_keys_nested_or_top_level():
    from tiny import dflash2_raw_config

    cfg = parse_draft_config(dflash2_raw_config())
    assert cfg.is_dflash2 and (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        2,
        16,
        8,
        4,
    )
    assert cfg.attention_kind(0) == (False, 16) and cfg.attention_kind(1) == (False, 16)
    raw = dflash2_raw_config()
    nested = raw["dflash_config"]
    flat = {**raw, **{k: nested[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}}
    flat["dflash_config"] = {"mask_token_id": 2, "target_layer_ids": [0, 2]}
    flat["architectures"] = ["DFlashDraftModel"]  # the keys alone make it DFlash2
    again = parse_draft_config(flat)
    assert again.is_dflash2 and again.selector_top_k == 4 and again.architectures == ["DFlash2DraftModel"]
    assert not parse_draft_config(drafter_raw_config()).is_dflash2


def test_dflash2_saves_keys_in_dflash_config_and_round_trips():
    cfg = parse_draft_config(_v2())
    saved = cfg.to_dict()
    assert saved["dflash_config"]["selector_top_k"] == 4 and saved["dflash_config"]["conv_group_size"] == 16
    again = parse_draft_config(saved)
    assert again.is_dflash2 and again.conv_kernel_size == 2 and again.is_causal is False


@pytest.mark.parametrize(
    "nested, message",
    [
        ({"conv_group_size": 24}, "not divisible by conv_group_size"),
        ({"selector_top_k": 1000}, "exceeds vocab_size"),
        ({"selector_rank": 0}, "selector_rank is 0; it must be a positive integer"),
        ({"conv_kernel_size": 2.5}, "conv_kernel_size is 2.5"),
        ({"selector_top_k": True}, "selector_top_k is True"),
    ],
)
def test_bad_dflash2_configs(nested, message):
    with pytest.raises(DFlashQuantError, match=message):
        parse_draft_config(_v2(**nested))
