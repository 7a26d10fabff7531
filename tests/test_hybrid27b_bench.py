"""benchmarks/hybrid27b/run.py end to end at tiny dims on CPU: the 27B benchmark's plumbing (build of the
hybrid target and DFlash2 drafter from the presets, gptq, exports, memory report, card, reuse of a build) stays
runnable between the rare GPU runs it is written for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(tmp: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "H27_WORK": str(tmp / "work"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks/hybrid27b/run.py"), "--tiny", "--device", "cpu", "--runs", "gpu"]
    cmd += [
        "--prompts",
        "4",
        "--new-tokens",
        "16",
        "--eval-new-tokens",
        "16",
        "--target-dir",
        str(tmp),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd + list(extra), capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "hybrid27b.json").read_text())


def test_tiny_hybrid_run_builds_quantizes_exports_and_reuses_its_build(tmp_path: Path) -> None:
    first = _run(tmp_path, tmp_path / "a")
    build = first["build"]
    assert build["target_params"] > 0 and build["drafter_params"] > 0 and not build.get("reused")
    row = first["runs"]["gpu"]
    s = row["summary"]
    assert s["exit"] == 0 and s["passed"] is True
    assert s["calib_cached"] is False and s["calib_peak_predicted_bytes"] > 0
    assert len(s["per_position_acceptance_int4"]) == 7  # the preset's block of 8: seven drafted positions
    assert set(s["timings"]) >= {"load_s", "calibrate_s", "quantize_s", "verify_s"}
    assert row["export_compressed-tensors"]["exit"] == 0
    assert row["export_gguf"]["exit"] == 0
    assert row["memory"]["exit"] == 0 and row["memory_report"]
    assert row["card"] is True
    host = row["gptq"]["host_peak_bytes"]
    assert host["VmRSS"] > 0
    # the models' mapped files are told apart from what the process holds (the split target's host prediction)
    # (each kind is its own maximum over polls read from two files a moment apart: allow a little skew)
    assert 0 < host["Held"] <= host["VmRSS"] * 1.05 and host["Checkpoint"] >= 0
    assert s["host_peak_held_bytes"] == host["Held"]

    # a rerun on the same machine takes the models and the calibration from the first run
    second = _run(tmp_path, tmp_path / "b", "--reuse-build")
    assert second["build"]["reused"] is True
    s2 = second["runs"]["gpu"]["summary"]
    assert s2["exit"] == 0 and s2["calib_cached"] is True
    assert s2["tau_int4"] == s["tau_int4"]
