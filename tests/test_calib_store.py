"""The calibration store (calibration.store): exact round trip of captured Hessians, a miss on any change of
what they depend on, damaged entries recomputed, the size cap, concurrent writers, and a second `gptq`
(real CLI subprocesses) that reuses the first one's calibration."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_drafter, save_target

from dflash_quant.calibration.capture import capture
from dflash_quant.calibration.store import CalibStore, store_key
from dflash_quant.loading.runtime import load_pair, stop_tokens

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 17, 33, 8], [40, 41, 7, 3, 90, 12]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("store_pairs")
    d1, t1 = save_drafter(root / "d1"), save_target(root / "t1")
    d2, t2 = save_drafter(root / "d2", seed=7), save_target(root / "t2", seed=5)
    load = {}
    for name, (d, t) in {"base": (d1, t1), "drafter": (d2, t1), "target": (d1, t2)}.items():
        load[name] = load_pair(str(d), str(t), CPU, torch.float32)
    drafter, target = load["base"]
    stats = capture(drafter.model, target.model, PROMPTS, 8, "block+context", stop_token_ids=stop_tokens(target))
    return load, stats


def _key(load, which="base", prompts=PROMPTS, max_new_tokens=8, kv="block+context", hdev=CPU, stops=None):
    drafter, target = load[which]
    base = {"drafter_sha256": "d", "target": "t", "max_new_tokens": max_new_tokens, "kv_hessian": kv}
    stop = stop_tokens(target) if stops is None else stops
    return store_key(base, drafter, target, prompts, stop, CPU, hdev)


def test_round_trip_is_exact_and_leaves_no_temp_folder(pairs, tmp_path):
    load, stats = pairs
    store = CalibStore(tmp_path, 10**9)
    assert store.load(_key(load), False, CPU) is None
    assert store.save(stats, _key(load)) == "stored"
    got = CalibStore(tmp_path, 10**9).load(_key(load), False, CPU)
    assert got is not None and got.hessians.keys() == stats.hessians.keys()
    for name, acc in stats.hessians.items():
        assert torch.equal(got.hessians[name].xtx, acc.xtx) and got.hessians[name].rows == acc.rows, name
    assert (got.steps, got.mean_tau, got.kv_hessian) == (stats.steps, stats.mean_tau, stats.kv_hessian)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert store.load(_key(load), True, CPU) is None  # sequential GPTQ needs replay inputs this entry lacks


@pytest.mark.parametrize(
    "change",
    [
        {"which": "drafter"},  # other drafter weights
        {"which": "target"},  # other target weights
        {"prompts": [PROMPTS[0], PROMPTS[1][:-1]]},  # other prompt ids
        {"max_new_tokens": 16},  # settings
        {"kv": "block"},
        {"stops": [99]},
        {"hdev": torch.device("meta")},  # Hessians accumulated elsewhere (another reduction order)
    ],
    ids=["drafter", "target", "prompts", "max_new_tokens", "kv_hessian", "stop_tokens", "hessian_device"],
)
def test_any_changed_input_is_a_miss(pairs, tmp_path, change):
    load, stats = pairs
    store = CalibStore(tmp_path, 10**9)
    store.save(stats, _key(load))
    assert store.load(_key(load), False, CPU) is not None
    assert _key(load, **change) != _key(load)
    assert store.load(_key(load, **change), False, CPU) is None


def test_version_is_part_of_the_key(pairs, tmp_path, monkeypatch):
    load, stats = pairs
    store = CalibStore(tmp_path, 10**9)
    store.save(stats, _key(load))
    import dflash_quant

    monkeypatch.setattr(dflash_quant, "__version__", dflash_quant.__version__ + ".post1")
    assert store.load(_key(load), False, CPU) is None


@pytest.mark.parametrize("damage", ["truncated_hessians", "garbage_meta", "missing_hessians", "nan_hessian"])
def test_damaged_entry_is_a_miss_and_is_replaced(pairs, tmp_path, damage):
    load, stats = pairs
    store = CalibStore(tmp_path, 10**9)
    store.save(stats, _key(load))
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    h = entry / "hessians.safetensors"
    if damage == "truncated_hessians":
        h.write_bytes(h.read_bytes()[: h.stat().st_size // 2])
    elif damage == "garbage_meta":
        (entry / "calibration.json").write_text("{not json")
    elif damage == "missing_hessians":
        h.unlink()
    else:
        from safetensors.torch import save_file

        flat = load_file(str(h))
        first = next(k for k in flat if k.endswith(".xtx"))
        flat[first][0, 0] = float("nan")
        save_file(flat, str(h))
    assert store.load(_key(load), False, CPU) is None  # recompute, not crash
    assert not entry.exists()  # the damaged entry is gone
    assert store.save(stats, _key(load)) == "stored" and store.load(_key(load), False, CPU) is not None


def test_cap_evicts_least_recently_used_and_refuses_an_entry_over_it(pairs, tmp_path):
    load, stats = pairs
    one = CalibStore(tmp_path / "probe", 10**9)
    one.save(stats, _key(load))
    size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*") if f.is_file())
    store = CalibStore(tmp_path / "s", int(size * 2.5))  # room for two entries
    keys = [_key(load, max_new_tokens=n) for n in (1, 2, 3)]
    store.save(stats, keys[0])
    store.save(stats, keys[1])
    os.utime(store._entry(keys[1]), (1, 1))  # keys[1] used long ago, keys[0] just now
    assert store.load(keys[0], False, CPU) is not None
    assert store.save(stats, keys[2]) == "stored"
    assert store.load(keys[1], False, CPU) is None  # the least recently used went
    assert store.load(keys[0], False, CPU) is not None and store.load(keys[2], False, CPU) is not None
    small = CalibStore(tmp_path / "small", size // 4)
    reason = small.save(stats, keys[0])
    assert reason.startswith("not stored:") and "--calib-cache-max-gb" in reason
    assert small.load(keys[0], False, CPU) is None and not (tmp_path / "small").exists()


def test_concurrent_writers_of_one_key_leave_one_whole_entry(pairs, tmp_path):
    load, stats = pairs
    key = _key(load)
    outcomes: list[str] = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(CalibStore(tmp_path, 10**9).save(stats, key))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == ["stored"] * 4
    assert len([p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    got = CalibStore(tmp_path, 10**9).load(key, False, CPU)
    assert got is not None and all(torch.equal(got.hessians[k].xtx, a.xtx) for k, a in stats.hessians.items())


def _gptq(pair, out, xdg, *extra, stdout: list[str] | None = None):
    drafter, target = pair
    cmd = [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "gptq",
        str(drafter),
        "--target",
        str(target),
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--group-size",
        "32",
        "--no-verify",
        "--no-card",
        "--output",
        str(out),
        *extra,
    ]
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    return json.loads((out / "provenance.json").read_text())["calibration"]


@pytest.mark.slow
def test_second_gptq_reuses_the_calibration_with_the_same_codes(tmp_path):
    pair = save_drafter(tmp_path / "drafter", std=0.2), save_target(tmp_path / "target")
    xdg = tmp_path / "xdg"
    tables: list[str] = []
    first = _gptq(pair, tmp_path / "a", xdg, stdout=tables)
    assert first["cached"] is False and first["store"] == "stored"
    assert len(list((xdg / "dflash-quant" / "calib").iterdir())) == 1
    again = _gptq(pair, tmp_path / "b", xdg, stdout=tables)  # same recipe: same Hessians, so the same codes
    assert again["cached"] is True and again["store"] == "hit" and again["rows"] == first["rows"]
    # the summary says so (its "calibration time 0.0 s" alone would read as a skipped stage)
    assert "reused from the calibration store" not in tables[0] and "reused from the calibration store" in tables[1]
    codes_a, codes_b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert codes_a.keys() == codes_b.keys() and all(torch.equal(codes_a[k], codes_b[k]) for k in codes_a)
    other = _gptq(pair, tmp_path / "c", xdg, "--bits", "8")  # other settings: the same calibration
    assert other["store"] == "hit"
    off = _gptq(pair, tmp_path / "d", xdg, "--no-calib-cache")
    assert off["cached"] is False and "store" not in off and off["rows"] == first["rows"]
    fresh = _gptq(pair, tmp_path / "e", xdg, "--max-new-tokens", "12")  # other calibration settings: recomputed
    assert fresh["cached"] is False and fresh["store"] == "stored"


def test_eviction_never_touches_what_the_store_did_not_write(pairs, tmp_path):
    """A user's folder, or a symlink to one, inside the store survives a save that must evict."""
    load, stats = pairs
    probe = CalibStore(tmp_path / "probe", 10**9)
    probe.save(stats, _key(load))
    size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*") if f.is_file())
    store = CalibStore(tmp_path / "s", int(size * 1.5))  # room for one entry: the second save evicts
    store.save(stats, _key(load, max_new_tokens=1))
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "s" / "a-folder").mkdir()
    (tmp_path / "s" / "a-folder" / "data.bin").write_bytes(b"x" * 10)
    os.symlink(mine, tmp_path / "s" / "a-link")
    os.utime(tmp_path / "s" / "a-folder", (1, 1))  # older than the entry: first in line if it were counted
    assert store.save(stats, _key(load, max_new_tokens=2)) == "stored"
    assert store.load(_key(load, max_new_tokens=1), False, CPU) is None  # our old entry was evicted
    assert (tmp_path / "s" / "a-folder" / "data.bin").read_bytes() == b"x" * 10
    assert (tmp_path / "s" / "a-link").is_symlink() and (mine / "notes.txt").read_text() == "keep"
