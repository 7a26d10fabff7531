import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_small_cpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_gptq.py"),
            "--device",
            "cpu",
            "--small",
            "--repeats",
            "1",
            "--no-gptqmodel",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dflash-quant" in proc.stdout
    res = json.loads(out.read_text())
    assert res["matrices"] == 15  # fc + 2 small layers x 7
    assert res["ours"]["gptq_s"] > 0 and res["ours"]["hessian_s"] > 0
    assert res["ours"]["fallbacks"] == []
    # GPTQ must beat round-to-nearest on correlated calibration rows
    assert res["ours"]["rel_output_error_mean"] < res["rtn"]["rel_output_error_mean"]
    assert res["gptqmodel"] == {"skipped": "skipped (--no-gptqmodel)"}
