"""write_json_atomic, the one way reports and benchmark results reach a user's path: a reader sees the old file or
the new one, never half of one; a symlink at the path is replaced, not written through; two writers leave one whole
file; a failure or a signal mid-write leaves the old file as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_quant.io.atomic import write_json_atomic


def test_a_symlink_at_the_path_is_replaced_and_its_target_left_alone(tmp_path):
    precious = tmp_path / "precious.json"
    precious.write_text('{"mine": true}\n')
    link = tmp_path / "result.json"
    link.symlink_to(precious)
    write_json_atomic(link, {"new": 1})
    assert not link.is_symlink() and json.loads(link.read_text()) == {"new": 1}
    assert precious.read_text() == '{"mine": true}\n'


def test_two_concurrent_writers_leave_one_whole_file_and_no_temp_files(tmp_path):
    path = tmp_path / "result.json"
    big = [list(range(2000)) for _ in range(20)]  # long enough that the writes overlap
    errors: list[BaseException] = []

    def write(tag: str) -> None:
        try:
            for _ in range(20):
                write_json_atomic(path, {"by": tag, "data": big})
        except BaseException as exc:  # noqa: BLE001  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert json.loads(path.read_text())["by"] in ("a", "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_failure_mid_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path):
    path = tmp_path / "result.json"
    write_json_atomic(path, {"old": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})  # json cannot write it
    assert json.loads(path.read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_mid_write_keeps_the_old_file(tmp_path, sig):
    """The process dies after its temp file is open and before the rename: the old file is untouched."""
    path = tmp_path / "result.json"
    write_json_atomic(path, {"old": 1})
    code = f"""
import json, os, signal
from pathlib import Path
from dflash_quant.io import atomic as files
def dumps(*a, **k):
    os.kill(os.getpid(), {int(sig)})
    raise SystemExit("not reached")
files.json.dumps = dumps
files.write_json_atomic(Path({str(path)!r}), {{"new": 1}})
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert proc.returncode == -int(sig)
    assert json.loads(path.read_text()) == {"old": 1}
    assert os.access(path, os.R_OK)
