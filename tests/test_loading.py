import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_quant.errors import DFlashQuantError
from dflash_quant.loading import check_pair, load_drafter, load_target
from tiny import save_drafter, save_target


def test_both_key_layouts_load_to_the_same_weights(tmp_path):
    plain = load_drafter(save_drafter(tmp_path / "plain"))
    prefixed = load_drafter(save_drafter(tmp_path / "prefixed", prefix="model."))
    for (k1, v1), (k2, v2) in zip(plain.model.state_dict().items(), prefixed.model.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert plain.model.rotary_emb.inv_freq.abs().sum() > 0


def test_save_pretrained_layout_reloads(tmp_path):
    d = load_drafter(save_drafter(tmp_path / "d"))
    d.model.save_pretrained(tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 4
    again = load_drafter(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(d.model.state_dict().values(), again.model.state_dict().values()))


def test_pickle_only_checkpoint_is_refused(tmp_path):
    path = save_drafter(tmp_path / "d")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(DFlashQuantError, match="pickle"):
        load_drafter(path)


def test_corrupt_safetensors(tmp_path):
    path = save_drafter(tmp_path / "d")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(DFlashQuantError, match="not a readable safetensors"):
        load_drafter(path)


def test_missing_weights_and_nan(tmp_path):
    path = save_drafter(tmp_path / "d")
    tensors = load_drafter(path).model.state_dict()
    tensors.pop("fc.weight")
    save_file({k: v.contiguous() for k, v in tensors.items() if k != "rotary_emb.inv_freq"}, str(path / "model.safetensors"))
    with pytest.raises(DFlashQuantError, match="missing.*fc.weight"):
        load_drafter(path)
    tensors = dict(load_drafter(save_drafter(tmp_path / "e")).model.state_dict())
    tensors["norm.weight"][0] = float("nan")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(DFlashQuantError, match="norm.weight contains NaN"):
        load_drafter(tmp_path / "e")


def test_not_a_directory_nor_repo_id(tmp_path):
    with pytest.raises(DFlashQuantError, match="neither an existing directory"):
        load_drafter(str(tmp_path / "nope" / "deeper" / "x"))


def test_offline_hub_id_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(DFlashQuantError, match="cannot fetch|not found"):
        load_drafter("someone/not-cached-drafter")


def test_target_given_as_drafter_is_refused(tiny_pair):
    drafter, target = tiny_pair
    with pytest.raises(DFlashQuantError, match="not a target"):
        load_target(drafter)
    with pytest.raises(DFlashQuantError, match="not a DFlash drafter"):
        load_drafter(target)


@pytest.mark.parametrize(
    "drafter_over, target_over, message",
    [
        ({"hidden_size": 32, "head_dim": 8}, {}, "fc takes"),
        ({"dflash_config": {"mask_token_id": 2, "target_layer_ids": [0, 7]}}, {}, r"layers \[7\]"),
        ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": [0, 2]}}, {}, "outside the target vocabulary"),
    ],
)
def test_pairing_errors(tmp_path, drafter_over, target_over, message):
    d = load_drafter(save_drafter(tmp_path / "d", **drafter_over))
    t = load_target(save_target(tmp_path / "t", **target_over))
    with pytest.raises(DFlashQuantError, match=message):
        check_pair(d.config, t.model)
