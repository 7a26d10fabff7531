import json
import os

import pytest
import torch
from safetensors.torch import save_file
from tiny import save_drafter, save_target

from dflash_quant.errors import DFlashQuantError
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.target import load_target
from dflash_quant.models.checks import check_pair


def test_both_key_layouts_load_to_the_same_weights(tmp_path):
    plain = load_drafter(save_drafter(tmp_path / "plain"))
    prefixed = load_drafter(save_drafter(tmp_path / "prefixed", prefix="model."))
    for (k1, v1), (k2, v2) in zip(plain.model.state_dict().items(), prefixed.model.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2)
    assert plain.model.rotary_emb.inv_freq.abs().sum() > 0


def test_save_pretrained_layout_reloads(tmp_path):
    d = load_drafter(save_drafter(tmp_path / "d"))
    d.model.save_pretrained(tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 4
    again = load_drafter(tmp_path / "saved")
    assert all(
        torch.equal(a, b) for a, b in zip(d.model.state_dict().values(), again.model.state_dict().values(), strict=True)
    )


def test_pickle_only_checkpoint_is_refused(tmp_path):
    path = save_drafter(tmp_path / "d")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(DFlashQuantError, match="pickle"):
        load_drafter(path)


def test_corrupt_safetensors(tmp_path):
    path = save_drafter(tmp_path / "d")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(DFlashQuantError, match="model.safetensors is truncated or corrupt"):
        load_drafter(path)


def test_missing_weights_and_nan(tmp_path):
    path = save_drafter(tmp_path / "d")
    tensors = load_drafter(path).model.state_dict()
    tensors.pop("fc.weight")
    save_file(
        {k: v.contiguous() for k, v in tensors.items() if k != "rotary_emb.inv_freq"}, str(path / "model.safetensors")
    )
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


def test_a_missing_relative_path_is_named_as_a_path_before_the_hub(tmp_path, monkeypatch):
    # `out/run-1` is also a well-formed repo id: when `out` is a folder here, the error leads with the path
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(DFlashQuantError) as exc:
        load_drafter("out/run-1")
    assert str(exc.value).startswith("there is no directory out/run-1 here, and cannot fetch out/run-1 from the Hub")
    assert "check the path" in str(exc.value)
    with pytest.raises(DFlashQuantError) as exc:
        load_drafter("someone/not-cached-drafter")  # no folder `someone` here: a repo id, said as before
    assert str(exc.value).startswith("cannot fetch someone/not-cached-drafter") and "path" not in str(exc.value)


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


# --------------------------------------------------------------------------- confinement (issue #13)


def _shard(path, tmp_path, shard_name):
    """Split the drafter's weights into an index naming `shard_name` for half of them."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(tensors)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    save_file({k: tensors[k] for k in first}, str(path / "part-1.safetensors"))
    target = (path / shard_name) if not shard_name.startswith("/") else __import__("pathlib").Path(shard_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: tensors[k] for k in second}, str(target))
    weight_map = {k: "part-1.safetensors" for k in first} | {k: shard_name for k in second}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def test_sharded_index_loads(tmp_path):
    path = save_drafter(tmp_path / "d")
    expected = load_drafter(path).model.state_dict()
    _shard(path, tmp_path, "part-2.safetensors")
    got = load_drafter(path).model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("shard", ["../../outside/x.safetensors", "ABSOLUTE"])
def test_index_shard_outside_the_model_dir_is_not_read(tmp_path, monkeypatch, shard):
    import builtins

    import dflash_quant.io.weights as loading

    path = save_drafter(tmp_path / "m" / "d")
    if shard == "ABSOLUTE":
        shard = str(tmp_path / "outside" / "abs.safetensors")
    outside = _shard(path, tmp_path, shard)
    assert outside.is_file() and not outside.resolve().is_relative_to(path.resolve())
    opened = []
    real_open, real_safe_open = builtins.open, loading.safe_open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    monkeypatch.setattr(loading, "safe_open", lambda f, *a, **k: (opened.append(str(f)), real_safe_open(f, *a, **k))[1])
    with pytest.raises(DFlashQuantError) as info:
        load_drafter(path)
    assert "outside the model directory" in str(info.value) and "\n" not in str(info.value)
    assert not any("outside" in f for f in opened), opened
    from dflash_quant.memory.weights import weights_from_files

    with pytest.raises(DFlashQuantError, match="outside the model directory"):
        weights_from_files(path)


def test_symlink_out_of_the_model_dir_is_refused(tmp_path):
    path = save_drafter(tmp_path / "d")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (path / "model.safetensors").rename(elsewhere)
    (path / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(DFlashQuantError, match="outside the model directory.*copy the file"):
        load_drafter(path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("../elsewhere.safetensors")
    with pytest.raises(DFlashQuantError, match="outside the model directory"):
        load_drafter(path)


def test_config_symlink_out_of_the_model_dir_is_refused(tmp_path):
    path = save_drafter(tmp_path / "d")
    (path / "config.json").rename(tmp_path / "config.json")
    (path / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(DFlashQuantError, match="config.json resolves to .* outside the model directory"):
        load_drafter(path)


def test_hf_cache_snapshot_symlinks_still_load(tmp_path):
    """models--org--name/snapshots/<rev>/ files are links into ../../blobs/: the cache's own layout loads."""
    src = save_drafter(tmp_path / "src")
    expected = load_drafter(src).model.state_dict()
    repo = tmp_path / "hub" / "models--org--drafter"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    got = load_drafter(snap).model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # ...but a link leaving the cache repo folder is still refused.
    other = tmp_path / "hub" / "models--org--other"
    other.mkdir()
    (other / "w.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "w.safetensors")
    with pytest.raises(DFlashQuantError, match="outside the model directory"):
        load_drafter(snap)


def test_a_gptq_artifact_loads_in_the_asked_dtype_with_the_exact_decoded_weights(reference_artifact):
    """The loader decodes a GPTQ artifact Linear by Linear straight into the asked dtype and hands the decoded
    tensors to the model as its parameters (to keep host memory near one copy of the drafter); the values must
    stay the exact fp32 decode, rounded once to bf16, and the rotary buffers must not be left on meta."""
    from dflash_quant.export.gptq_dynamic import layer_setting
    from dflash_quant.io.gptq_v1 import unpack_gptq_v1
    from dflash_quant.io.weights import read_safetensors

    raw = json.loads((reference_artifact / "config.json").read_text())
    packed = read_safetensors(reference_artifact)
    full = load_drafter(reference_artifact, dtype=torch.float32).model.state_dict()
    half = load_drafter(reference_artifact, dtype=torch.bfloat16).model
    weights = dict(half.named_parameters())
    bases = sorted(k[: -len(".qweight")] for k in packed if k.endswith(".qweight"))
    assert bases
    for base in bases:
        parts = {s: packed[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        bits, group = layer_setting(raw["quantization_config"], base)
        exact = unpack_gptq_v1(parts, bits=bits, group_size=group)
        name = base.removeprefix("model.") + ".weight"
        assert torch.equal(full[name], exact)
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], exact.to(torch.bfloat16))
    assert all(p.device.type == "cpu" for p in half.parameters())
    assert half.rotary_emb.inv_freq.abs().sum() > 0  # rebuilt: not a meta buffer left from the empty build
