"""`make quickstart` (first run, empty caches) and a second `gptq` with other settings (--bits 8, warm
caches): an old commit against this tree, alternated in one run: CPU time (user + sys) and wall time of
the CLI subprocess. CPU time is the fair measure on a shared box (other jobs stretch the wall time, not
the work done).

    nice -n 10 python benchmarks/bench_quickstart.py --old e5248dc --repeats 1 \
        --out benchmarks/results/quickstart_speed.json

The old commit is checked out with `git worktree add --detach` into a temp dir; both run with the same
Python (this venv), each with its own code first on PYTHONPATH and its own empty cache directories.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_job(tree: Path, work: Path, label: str, args: list[str]) -> tuple[float, float, dict]:
    """(wall s, CPU s of the subprocess: user + sys, parity.json). On a shared box the wall time depends on
    the other jobs' load; the CPU time is the work done."""
    out = work / f"out-{label}"
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(work / "xdg")}
    cmd = [sys.executable, "-m", "dflash_quant.cli.app", "gptq", *args, "--output", str(out), "--overwrite"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    parity = json.loads((out / "parity.json").read_text())
    calibration = json.loads((out / "provenance.json").read_text()).get("calibration") or {}
    parity["_reuse"] = {  # what this run took from an earlier one (the old version has no calibration store)
        "calibration": calibration.get("store", "cached" if calibration.get("cached") else "computed"),
        "check": parity.get("cache", "none"),
    }
    return seconds, cpu, parity


def summary(xs: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(xs), 2),
        "min_s": round(min(xs), 2),
        "max_s": round(max(xs), 2),
        "runs": [round(x, 2) for x in xs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="e5248dc", help="commit of the version to compare against")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--new-first", action="store_true", help="start with the new tree (then alternate)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quickstart_speed.json")
    a = ap.parse_args()
    old_commit = subprocess.run(
        ["git", "rev-parse", a.old], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    new_commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="bench-quickstart-"))
    old_tree = tmp / "old"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(old_tree), old_commit], cwd=ROOT, check=True, capture_output=True
    )
    times: dict[str, list[float]] = {k: [] for k in ("old_first", "new_first", "old_second", "new_second")}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    taus: dict[str, list] = {k: [] for k in times}
    reuse: dict[str, list] = {k: [] for k in times}
    try:
        for rep in range(a.repeats):
            order = (
                [("old", old_tree), ("new", ROOT)]
                if (rep + a.new_first) % 2 == 0
                else [("new", ROOT), ("old", old_tree)]
            )
            works = {name: tmp / f"{name}-{rep}" for name, _ in order}
            for stage, args in (("first", ["--bits", "4"]), ("second", ["--bits", "8"])):
                for name, tree in order:
                    s, c, parity = run_job(tree, works[name], f"{stage}", args)
                    times[f"{name}_{stage}"].append(s)
                    cpu[f"{name}_{stage}"].append(c)
                    taus[f"{name}_{stage}"].append(
                        [parity["baseline"]["tau"], parity["quantized"]["tau"], parity["lossless"], parity["passed"]]
                    )
                    reuse[f"{name}_{stage}"].append(parity["_reuse"])
                    print(f"rep {rep} {name} {stage}: {s:.1f} s wall, {c:.1f} s CPU", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "command": "nice -n 10 python benchmarks/bench_quickstart.py " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "order": "new first, then alternating" if a.new_first else "old first, then alternating",
        "old_commit": old_commit,
        "new_commit": new_commit,
        "jobs": {
            "first": "gptq --bits 4 (make quickstart), empty check cache",
            "second": "gptq --bits 8, caches of the first (check cache; calibration store where the version has one)",
        },
        "times": {k: summary(v) for k, v in times.items()},
        "cpu_times": {k: summary(v) for k, v in cpu.items()},
        "tau_bf16_tau_quant_lossless_passed": taus,
        "reused_from_earlier_runs": reuse,
        "ratio_first_new_over_old": round(med["new_first"] / med["old_first"], 3),
        "ratio_second_new_over_old_first": round(med["new_second"] / med["old_first"], 3),
        "ratio_second_new_over_old_second": round(med["new_second"] / med["old_second"], 3),
        "cpu_ratio_first_new_over_old": round(mcpu["new_first"] / mcpu["old_first"], 3),
        "cpu_ratio_second_new_over_old_first": round(mcpu["new_second"] / mcpu["old_first"], 3),
        "cpu_ratio_second_new_over_old_second": round(mcpu["new_second"] / mcpu["old_second"], 3),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k}))


if __name__ == "__main__":
    main()
