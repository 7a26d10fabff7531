"""The weights' sha256 (provenance, calibration and check cache keys) computed in a thread while the pair loads:
the same digest as hashing in line, the hashing's own error at `result()`, and a daemon thread, so Ctrl-C never
waits for a 54 GB hash to finish."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.weights import BackgroundSha256, weights_sha256


def test_the_background_digest_is_the_digest_of_the_weight_files_in_index_order(tmp_path):
    tensors = {f"w{i}": torch.full((64, 64), float(i)) for i in range(2)}
    save_file({"w0": tensors["w0"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"w1": tensors["w1"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"w0": "model-00001-of-00002.safetensors", "w1": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    digest = hashlib.sha256()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        digest.update((tmp_path / name).read_bytes())
    job = BackgroundSha256(tmp_path)
    assert job._thread.daemon
    assert job.result() == weights_sha256(tmp_path) == digest.hexdigest()
    assert job.result() == digest.hexdigest()  # asked twice: the same answer, no second hash


def test_a_failed_hash_raises_its_own_error_when_the_result_is_asked_for(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model folder without weights
    job = BackgroundSha256(tmp_path)
    with pytest.raises(DFlashQuantError):
        job.result()
