"""Markdown table of a benchmarks/hybrid27b/run.py result (the README's 27B table).

python benchmarks/hybrid27b/table.py benchmarks/results/hybrid27b_h100.json
"""

from __future__ import annotations

import json
import sys

GIB = 2**30


def gib(n: int | None) -> str:
    return "-" if not n else f"{n / GIB:.2f}"


def main() -> None:
    r = json.loads(open(sys.argv[1]).read())
    print(
        f"GPU: {r.get('gpu')}; torch {r.get('torch')}, transformers {r.get('transformers')}; commit {r.get('commit')}"
        " (a run measured again later names its own commit)"
    )
    print()
    print("| run | commit | exit | wall s | load / calibrate / quantize / verify s | calibration GPU peak GiB: measured / predicted "
          "(ratio) | GPU peak GiB (nvidia-smi) | host peak GiB (anon / RSS / held apart from the models' files; predicted) | tau bf16 -> int4 |")  # fmt: skip
    print("|---|---|---:|---:|---|---|---:|---|---|")
    for name, row in r["runs"].items():
        s = row.get("summary")
        if s is None:
            print(f"| {name} | | skipped: {row.get('skipped')} | | | | | | |")
            continue
        t = s.get("timings") or {}
        stages = " / ".join(
            f"{t[k]:.0f}" if k in t else "-" for k in ("load_s", "calibrate_s", "quantize_s", "verify_s")
        )
        ratio = s.get("calib_peak_ratio")
        calib = f"{gib(s['calib_peak_measured_bytes'])} / {gib(s['calib_peak_predicted_bytes'])} ({ratio})"
        host = f"{gib(s.get('host_peak_anon_bytes'))} / {gib(s.get('host_peak_rss_bytes'))} / {gib(s.get('host_peak_held_bytes'))}"
        fix = (row.get("budget") or {}).get("fix") or {}
        if name == "capped" and fix.get("cpu_bytes"):  # the plan's host share: offloaded layers + Hessians
            host += f"; {gib(fix['cpu_bytes'])}"
        tau = f"{s.get('tau_bf16')} -> {s.get('tau_int4')}"
        commit = (row.get("measured") or {}).get("commit", r.get("commit"))
        print(
            f"| {name} | {commit} | {s['exit']} | {s['seconds']} | {stages} | {calib} | {gib(s['gpu_peak_smi_bytes'])} | {host} | {tau} |"
        )
        exports = {
            k[len("export_") :]: v.get("exit", v.get("skipped")) for k, v in row.items() if k.startswith("export_")
        }
        if exports:
            print(
                f"|  | | exports: {exports}; memory report exit {row.get('memory', {}).get('exit')}; card {row.get('card')} | | | | | | |"
            )


if __name__ == "__main__":
    main()
