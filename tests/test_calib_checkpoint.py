"""Where an unfinished calibration's checkpoint lives: in the calibration store's slot for its key (user cache),
never beside --output. The slot counts toward the store's cap, is evicted only when no live run holds it, and
goes once calibration finishes; Ctrl-C or SIGTERM (real CLI subprocesses) leave the output's folder as it was,
say that a rerun resumes, and the rerun resumes to the codes of a run never interrupted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_quant.calibration import checkpoint as ckpt
from dflash_quant.calibration.capture import CalibrationStats, CaptureState
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.calibration.store import CalibStore

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
WIDTH = 64  # one 64x64 fp32 Hessian: 16 KiB per entry or checkpoint


def _hessians() -> dict[str, HessianAccumulator]:
    acc = HessianAccumulator(WIDTH, device=CPU)
    acc.add(torch.ones(3, WIDTH))
    return {"fc": acc}


def _state(done: int = 2) -> CaptureState:
    return CaptureState(done, _hessians(), [3] * done)


def _stats() -> CalibrationStats:
    return CalibrationStats(hessians=_hessians(), kv_hessian="block", prompts=2, steps=2, mean_tau=1.5)


def _key(n: int) -> dict:
    return {"k": n}


def _sizes(tmp_path: Path) -> tuple[int, int]:
    """(bytes of one store entry, bytes of one checkpoint) as written."""
    probe = CalibStore(tmp_path / "probe", 10**9)
    probe.save(_stats(), _key(0))
    slot = probe.checkpoint(_key(1))
    slot.hold()
    assert slot.save(_key(1), _state())
    entry = sum(f.stat().st_size for f in probe._entry(_key(0)).iterdir())
    return entry, (slot.path / ckpt.FILE).stat().st_size


def test_checkpoint_lives_in_the_store_and_goes_once_calibration_finishes(tmp_path):
    store = CalibStore(tmp_path / "calib", 10**9)
    slot = store.checkpoint(_key(1))
    assert slot.path.parent == store.directory and slot.path.name == store._entry(_key(1)).name + ".checkpoint"
    slot.hold()
    assert slot.save({"ck": 1}, _state(4))
    slot.release(finished=False)  # interrupted: kept for the rerun
    assert ckpt.load(slot.path, {"ck": 1}, CPU).done == 4
    again = store.checkpoint(_key(1))
    again.hold()
    assert store.save(_stats(), _key(1)) == "stored"
    again.release(finished=True)
    assert sorted(p.name for p in store.directory.iterdir()) == [store._entry(_key(1)).name]


def test_the_interruption_message_reads_the_prompts_done_from_the_file_of_its_own_key(tmp_path):
    # read back, not remembered: a signal can land after the rename and before any bookkeeping
    kept = ckpt.Kept(tmp_path / ckpt.FILE, {"ck": 1}, 8)
    assert kept.done() is None  # nothing written yet
    ckpt.save(tmp_path, {"ck": 2}, _state(5))
    assert kept.done() is None  # another calibration's checkpoint is not this run's
    ckpt.save(tmp_path, {"ck": 1}, _state(3))
    assert kept.done() == 3
    (tmp_path / ckpt.FILE).write_bytes(b"torn")
    assert kept.done() is None


def test_the_cap_counts_checkpoints_and_never_evicts_a_held_one(tmp_path):
    entry, check = _sizes(tmp_path)
    store = CalibStore(tmp_path / "calib", entry + check // 2)  # one entry or one checkpoint, not both
    left = store.checkpoint(_key(1))  # an interrupted run's checkpoint, no longer held
    left.hold()
    assert left.save({"ck": 1}, _state())
    left.release(finished=False)
    assert store.save(_stats(), _key(2)) == "stored"
    assert not left.path.exists()  # counted: evicted to make room, as an entry would be

    live = store.checkpoint(_key(3))
    live.hold()
    assert live.save({"ck": 3}, _state())
    assert store.load(_key(2), False, CPU) is None  # counted when written: the older entry made room
    assert store.save(_stats(), _key(4)) == "stored"
    assert (live.path / ckpt.FILE).is_file()  # a live run's checkpoint is never evicted under it
    live.release(finished=True)
    assert not live.path.exists()

    tiny = CalibStore(tmp_path / "tiny", check // 2)
    over = tiny.checkpoint(_key(5))
    over.hold()
    assert over.save({"ck": 5}, _state()) is False  # over the cap alone: not written, calibration goes on
    over.release(finished=False)
    assert list(tiny.directory.iterdir()) == []


def test_runs_of_one_key_share_the_slot_and_the_last_one_cleans_up(tmp_path):
    store = CalibStore(tmp_path / "calib", 10**9)
    first, second = store.checkpoint(_key(1)), store.checkpoint(_key(1))
    first.hold()
    second.hold()  # shared: a concurrent run of the same command is not refused
    assert first.save({"ck": 1}, _state(2)) and second.save({"ck": 1}, _state(4))
    first.release(finished=True)  # the other run still calibrates: its checkpoint stays
    assert ckpt.load(second.path, {"ck": 1}, CPU).done == 4
    assert not list(second.path.glob(".*.tmp"))  # each checkpoint was renamed into place whole
    (second.path / "notes.txt").write_text("mine")  # not ours: survives, and so does the folder
    second.release(finished=True)
    assert sorted(p.name for p in second.path.iterdir()) == ["notes.txt"]


# --- real runs ------------------------------------------------------------------------------------------


def _gptq(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "gptq",
        "reference",
        "--device",
        "cpu",
        "--num-prompts",
        "10",
        "--max-new-tokens",
        "48",
        "--no-verify",
        "--no-card",
        "--calib-checkpoint-every",
        "2",
        "-o",
        str(out),
    ]


def _env(xdg: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(xdg)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    out = root / "out" / "a"
    subprocess.run(_gptq(out), env=_env(root / "xdg"), check=True, capture_output=True, timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_calibration_leaves_the_output_folder_as_it_was_and_the_rerun_resumes(
    tmp_path, uninterrupted, sig
):
    parent, xdg = tmp_path / "out", tmp_path / "xdg"
    old = parent / ".a.calib-checkpoint"  # an older version's hidden checkpoint: left alone
    old.mkdir(parents=True)
    (old / ckpt.FILE).write_bytes(b"from an older dflash-quant")
    before = sorted(str(p.relative_to(parent)) for p in parent.rglob("*"))
    calib = xdg / "dflash-quant" / "calib"

    proc = subprocess.Popen(_gptq(parent / "a"), env=_env(xdg), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while proc.poll() is None and not list(calib.glob(f"*.checkpoint/{ckpt.FILE}")) and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before a checkpoint was seen"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    # the message, not the "[hh:mm:ss] stage" progress lines a piped stderr gets
    lines = [ln for ln in err.decode().splitlines() if ln.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", ln)]
    assert proc.returncode == 128 + sig, lines
    assert len(lines) == 1 and "kept in the cache" in lines[0] and "rerun the same command to resume" in lines[0]
    assert sorted(str(p.relative_to(parent)) for p in parent.rglob("*")) == before
    (slot,) = calib.glob("*.checkpoint")
    assert str(slot) in lines[0] and (slot / ckpt.FILE).is_file()

    rerun = subprocess.run(_gptq(parent / "a"), env=_env(xdg), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    resumed = json.loads((parent / "a" / "provenance.json").read_text())["calibration"]
    base = json.loads((uninterrupted / "provenance.json").read_text())["calibration"]
    assert resumed["resumed_prompts"] >= 2 and resumed["resumed_prompts"] % 2 == 0 and base["resumed_prompts"] == 0
    assert resumed["rows"] == base["rows"] and resumed["steps"] == base["steps"]
    codes, expected = load_file(parent / "a" / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert codes.keys() == expected.keys() and all(torch.equal(codes[k], expected[k]) for k in codes)
    assert not slot.exists() and resumed["store"] == "stored"  # the finished entry supersedes the checkpoint
    after = sorted(str(p.relative_to(parent)) for p in parent.rglob("*") if not p.is_relative_to(parent / "a"))
    assert after == before  # the artifact, and nothing else beside it
    assert (old / ckpt.FILE).read_bytes() == b"from an older dflash-quant"
