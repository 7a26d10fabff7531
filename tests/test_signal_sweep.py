"""A terminating signal right after every file-system call of the output paths: nothing is left half-done.

Each scenario first runs once to count the calls it makes (open, flock, mkdtemp, mkstemp, rename, chmod,
unlink, rmtree, ...); then, for every N, it runs again with a signal sent to this process right after call
N returns, as a user's `kill` or Ctrl-C could land. Whatever N is, the run must stop with Terminated (or
KeyboardInterrupt), leave no lock, temp dir or temp file, and leave the output either as it was or complete.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from dflash_quant.artifact.manifest import verify_manifest, write_manifest
from dflash_quant.io import atomic
from dflash_quant.io.atomic import replace_atomic, write_json_atomic

CALLS = [
    (os, "open"),
    (os, "close"),
    (os, "rename"),
    (os, "replace"),
    (os, "unlink"),
    (os, "rmdir"),
    (os, "chmod"),
    (os, "pwrite"),
    (os, "ftruncate"),
    (fcntl, "flock"),
    (tempfile, "mkdtemp"),
    (tempfile, "mkstemp"),
    (shutil, "rmtree"),
    (atomic, "rename_noreplace"),
]
SIGNALS = {"SIGTERM": (signal.SIGTERM, atomic.Terminated), "SIGINT": (signal.SIGINT, KeyboardInterrupt)}


class Injector:
    """Counts the wrapped calls made while signals_raise is active; sends `sig` after call number `at`."""

    def __init__(self, monkeypatch, sig: int, at: int | None):
        self.sig, self.at, self.count = sig, at, 0
        for module, name in CALLS:
            monkeypatch.setattr(module, name, self._wrap(getattr(module, name)))

    def _wrap(self, fn):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            if atomic._signal_depth:  # only inside the code under test, which installs the handlers
                self.count += 1
                if self.count == self.at:
                    signal.raise_signal(self.sig)  # to this thread: held while it blocks, else handled at once
            return result

        return call


def artifact(root: Path, weights: str) -> None:
    (root / "model.safetensors").write_text(weights)
    (root / "config.json").write_text("{}")
    write_manifest(root)


def publish(parent: Path, scenario: str) -> None:
    final = parent / "art"
    with atomic.atomic_dir(final, overwrite=scenario == "overwrite") as tmp:
        artifact(tmp, "new")


def prepare(parent: Path, scenario: str) -> None:
    if scenario == "overwrite":
        (parent / "art").mkdir()
        artifact(parent / "art", "old")
    elif scenario == "empty":
        (parent / "art").mkdir()


def check_publish(parent: Path, scenario: str) -> None:
    assert sorted(p.name for p in parent.iterdir() if p.name != "art") == []  # no lock, temp or old dir
    final = parent / "art"
    if not final.exists():
        assert scenario == "fresh"
        return
    names = sorted(p.name for p in final.iterdir())
    if scenario == "empty" and names == []:
        return  # the empty directory as it was
    assert names == ["config.json", "manifest.json", "model.safetensors"]
    assert verify_manifest(final) == []
    assert (final / "model.safetensors").read_text() in ({"new", "old"} if scenario == "overwrite" else {"new"})


def sweep(tmp_path, monkeypatch, sig_name, run, prepare_dir, check) -> int:
    sig, expected = SIGNALS[sig_name]
    with monkeypatch.context() as m:
        counter = Injector(m, sig, None)
        clean = tmp_path / "clean"
        clean.mkdir()
        prepare_dir(clean)
        with atomic.signals_raise():
            run(clean)
    total = counter.count
    assert total > 5  # the wrappers see the code's calls
    for at in range(1, total + 1):
        parent = tmp_path / f"at{at}"
        parent.mkdir()
        prepare_dir(parent)
        with monkeypatch.context() as m:
            Injector(m, sig, at)
            with pytest.raises(expected):
                with atomic.signals_raise():
                    run(parent)
        check(parent)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return total


@pytest.mark.parametrize("sig_name", list(SIGNALS))
@pytest.mark.parametrize("scenario", ["fresh", "empty", "overwrite"])
def test_publishing_an_artifact(tmp_path, monkeypatch, scenario, sig_name):
    sweep(
        tmp_path,
        monkeypatch,
        sig_name,
        lambda parent: publish(parent, scenario),
        lambda parent: prepare(parent, scenario),
        lambda parent: check_publish(parent, scenario),
    )


@pytest.mark.parametrize("sig_name", list(SIGNALS))
def test_replacing_a_file(tmp_path, monkeypatch, sig_name):
    def run(parent: Path) -> None:
        write_json_atomic(parent / "report.json", {"new": True})
        replace_atomic(parent / "README.md", lambda tmp: tmp.write_text("new card"))

    def prepare_dir(parent: Path) -> None:
        write_json_atomic(parent / "report.json", {"old": True})

    def check(parent: Path) -> None:
        names = sorted(p.name for p in parent.iterdir())
        assert names in (["report.json"], ["README.md", "report.json"])  # no temp file
        assert (parent / "report.json").read_text() in ('{\n  "old": true\n}\n', '{\n  "new": true\n}\n')
        if "README.md" in names:
            assert (parent / "README.md").read_text() == "new card"

    sweep(tmp_path, monkeypatch, sig_name, run, prepare_dir, check)
