"""The parity check's run cache: exact round trip, a miss on any change of a key part, opt-out, and reuse
by a second `gptq` run (real CLI subprocesses on the shipped reference pair)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import dflash_quant
from dflash_quant.speculative.check_cache import CheckCache, cached_runs, check_key, model_identity
from dflash_quant.speculative.decode import GreedyResult, SpecResult
from dflash_quant.speculative.verify import CheckSettings

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _greedy(seed):
    return [
        GreedyResult(
            tokens=[seed, 2, 3],
            seconds=0.125 + seed,
            target_forwards=3,
            top1_logits=[1.5, 2.0 / 3, 3.0],
            margins=[0.1, 1e-7, 2.0],
            logits_dtype="bfloat16",
        )
    ]


def _spec():
    return [
        SpecResult(
            tokens=[5, 6],
            acceptance_lengths=[2],
            accepted=[1],
            drafted=[3],
            target_forwards=2,
            drafter_forwards=1,
            seconds=0.5,
            replay_forwards=1,
            replayed_tokens=2,
            replay_seconds=0.1,
        )
    ]


def _key(**over):
    settings = CheckSettings(
        **{
            **dict(max_new_tokens=16, temperature=0.0, block_size=4, seed=0, stop_token_ids=[2]),
            **over.pop("settings", {}),
        }
    )
    kw = dict(
        target="sha256:t",
        prompts=PROMPTS,
        settings=settings,
        device=torch.device("cpu"),
        dtype=torch.float32,
        drafter="d",
    )
    kw.update(over)
    return check_key(**kw)


def test_round_trip_is_exact_for_both_kinds(tmp_path):
    cache = CheckCache(tmp_path)
    cache.put("baseline", _key(drafter=None), _greedy(1))
    cache.put("spec", _key(), _spec())
    assert CheckCache(tmp_path).get("baseline", _key(drafter=None), GreedyResult) == _greedy(1)
    got = CheckCache(tmp_path).get("spec", _key(), SpecResult)
    assert got == _spec() and dataclasses.asdict(got[0])["replay_seconds"] == 0.1
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temp file


@pytest.mark.parametrize(
    "change",
    [
        dict(drafter="other drafter"),
        dict(target="sha256:other target"),
        dict(prompts=[[1, 2, 3], [4, 5, 6, 8]]),
        dict(settings=dict(max_new_tokens=17)),
        dict(settings=dict(temperature=0.7)),
        dict(settings=dict(block_size=3)),
        dict(settings=dict(seed=1)),
        dict(settings=dict(stop_token_ids=[2, 9])),
        dict(device=torch.device("cuda")),
        dict(dtype=torch.bfloat16),
    ],
)
def test_any_changed_key_part_is_a_miss(tmp_path, change):
    cache = CheckCache(tmp_path)
    calls = []
    cached_runs(cache, "spec", _key(), SpecResult, lambda: calls.append(1) or _spec())
    cached_runs(cache, "spec", _key(), SpecResult, lambda: calls.append(1) or _spec())
    assert calls == [1] and cache.events["spec"] == "hit"
    cached_runs(cache, "spec", _key(**change), SpecResult, lambda: calls.append(2) or _spec())
    assert calls == [1, 2] and cache.events["spec"] == "miss"


def test_version_is_part_of_the_key(tmp_path, monkeypatch):
    cache = CheckCache(tmp_path)
    cache.put("spec", _key(), _spec())
    monkeypatch.setattr("dflash_quant.speculative.check_cache.__version__", dflash_quant.__version__ + ".post1")
    assert cache.get("spec", _key(), SpecResult) is None


def test_torn_or_foreign_entries_are_misses_and_off_means_off(tmp_path):
    cache = CheckCache(tmp_path)
    cache.put("spec", _key(), _spec())
    (path,) = tmp_path.glob("spec-*.json")
    path.write_text(path.read_text()[:40])  # torn write by a killed process
    assert cache.get("spec", _key(), SpecResult) is None
    path.write_text(json.dumps({"key": _key(), "type": "GreedyResult", "runs": []}))
    assert cache.get("spec", _key(), SpecResult) is None
    off = CheckCache(None)
    calls = []
    cached_runs(off, "spec", _key(), SpecResult, lambda: calls.append(1) or _spec())
    cached_runs(off, "spec", _key(), SpecResult, lambda: calls.append(1) or _spec())
    assert calls == [1, 1] and off.events["spec"] == "off"


def test_model_identity_follows_the_weights(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": torch.ones(4)}, str(model / "model.safetensors"))
    first = model_identity(model)
    assert first.startswith("sha256:") and model_identity(model) == first
    save_file({"w": torch.full((4,), 2.0)}, str(model / "model.safetensors"))
    assert model_identity(model) != first


def _gptq(out, cache, *extra):
    cmd = [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "gptq",
        "--bits",
        "4",
        "--output",
        str(out),
        "--overwrite",
        "--num-prompts",
        "6",
        "--max-new-tokens",
        "16",
        "--eval-num-prompts",
        "3",
        "--eval-max-new-tokens",
        "24",
        "--check-cache",
        str(cache),
        "--no-card",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "parity.json").read_text())


@pytest.mark.slow
def test_second_gptq_reuses_the_bf16_and_target_runs(tmp_path):
    cache = tmp_path / "cache"
    first = _gptq(tmp_path / "a", cache)
    assert first["cache"] == {"target_only": "miss", "bf16_drafter": "miss"}  # no machine path in the artifact
    second = _gptq(tmp_path / "b", cache, "--bits", "8")
    assert second["cache"]["target_only"] == "hit" and second["cache"]["bf16_drafter"] == "hit"
    assert second["baseline"] == {**first["baseline"]}  # same bf16 record, timings included (marked cached)
    assert second["quantized"]["lossless"] is True
    fresh = _gptq(tmp_path / "c", cache, "--eval-max-new-tokens", "20")  # changed settings: recomputed
    assert fresh["cache"]["target_only"] == "miss" and fresh["cache"]["bf16_drafter"] == "miss"
    off = _gptq(tmp_path / "d", cache, "--no-check-cache")
    assert off["cache"] == {"target_only": "off", "bf16_drafter": "off"}
    assert off["baseline"]["tau"] == first["baseline"]["tau"]
