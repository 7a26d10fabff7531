"""Mixed precision under a bits-per-weight budget, gptq-kl against plain GPTQ, on held-out prompts.

Each run is one `dflash-quant gptq` subprocess on the pair's 128 calibration prompts + the first 512 of
`benchmarks/prompts/*_calib_extra.jsonl` (640), checked on the 256 extra held-out prompts x 128 tokens
(`benchmarks/prompts/*_heldout_extra.jsonl`), every run of a pair sharing one --calib-cache (gptq-kl records the
drafter's inputs in the loop; plain GPTQ calibrates in one batch, keyed apart). A run whose JSON is already in
--work is read, not rerun, so a study cut short resumes. Rows keep tau, per-position acceptance, per-prompt
tokens/steps, the pick's bits per weight and wall time; the table gives each gptq-kl row minus the plain GPTQ row
of the same budget with a 95 % paired bootstrap interval over prompts.

    python benchmarks/studies/bpw_mix.py --pairs reference,reference-dflash2 \
        --runs "gptq-kl:bpw=3.25,gptq:bpw=3.25,gptq-kl:bpw=2.5,gptq:bpw=2.5,gptq:bits=2:group=64" \
        --work /tmp/bpw --out benchmarks/results/bpw_mix.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

from kl_tuning import paired_interval, parity_fields, split_prompts  # noqa: E402

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402

SHORT = {"reference": "ref", "reference-dflash2": "d2"}
N_EXTRA = 512


def command(pair: str, spec: str, work: Path) -> tuple[str, list[str]]:
    """`gptq-kl:bpw=3.25` -> (tag, argv): a mix within 3.25 bits per weight; `gptq:bits=2:group=64` a uniform grid;
    `...:rows=reached:target=1:tf=yes` adds --tune-rows reached --tune-target 1 --teacher-forced."""
    method, *opts = spec.split(":")
    o = dict(x.split("=", 1) for x in opts)
    tag = spec.replace(":", "-").replace("=", "")
    short = SHORT[pair]
    calib = work / f"{short}_calib640.jsonl"
    if not calib.exists():
        lines, _ = split_prompts(pair, "extra", N_EXTRA)
        calib.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable, "-m", "dflash_quant.cli.app", "gptq", pair, "--method", method,
        "--calib-prompts", str(calib), "--num-prompts", "640",
        "--eval-prompts", str(ROOT / f"benchmarks/prompts/{short}_heldout_extra.jsonl"), "--eval-max-new-tokens", "128",
        "--calib-cache", str(work / f"cache-{short}"), "-o", str(work / f"out-{short}-{tag}"), "--overwrite",
        "--json", "--tolerance", "0.5", "--no-card",
    ]  # fmt: skip
    if "bpw" in o:
        cmd += ["--max-bits-per-weight", o["bpw"]]
    else:
        cmd += ["--bits", o["bits"], "--group-size", o.get("group", "128")]
        cmd += ["--desc-act", "--static-groups", "--clip-search"] if o.get("act") == "clip" else []
    for k, v in o.items():  # tf=yes: --teacher-forced; rows=reached, target=1, ...: --tune-rows reached, ...
        if k == "tf":
            cmd += ["--teacher-forced"] if v == "yes" else []
        elif k == "sym":
            cmd += ["--sym" if v == "yes" else "--asym"]
        elif k not in ("bpw", "bits", "group", "act"):
            cmd += [f"--tune-{k.replace('_', '-')}", v]
    return tag, cmd


def row_of(pair: str, spec: str, res: dict, wall: float | None) -> dict:
    par, rep = res["parity"], res["quant_report"]
    weights = sum(layer["shape"][0] * layer["shape"][1] for layer in rep["layers"])
    g_idx = sum(layer["shape"][1] * 4 for layer in rep["layers"])
    return {
        "pair": pair,
        "run": spec,
        "method": spec.split(":")[0],
        **parity_fields(par),
        "quantized_bytes": rep["quantized_bytes"],
        "bits_per_weight": round((rep["quantized_bytes"] - g_idx) * 8 / weights, 4),
        "settings": sorted({f"{layer['bits']}/{layer['group_size']}" for layer in rep["layers"]}),
        "tuning_s": (rep.get("tuning") or {}).get("seconds"),
        "timings": res["timings"],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="reference,reference-dflash2")
    ap.add_argument("--runs", default="gptq-kl:bpw=3.25,gptq:bpw=3.25,gptq-kl:bpw=2.5,gptq:bpw=2.5")
    ap.add_argument("--work", required=True, help="outputs, caches and each run's JSON (kept: reruns read them)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rows = []
    for pair in args.pairs.split(","):
        for spec in args.runs.split(","):
            tag, cmd = command(pair, spec, work)
            saved = work / f"{SHORT[pair]}-{tag}.json"
            wall = None
            if not saved.exists():
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                wall = round(time.perf_counter() - t0, 1)
                if proc.returncode not in (0, 1):
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
                saved.write_text(proc.stdout)
            row = row_of(pair, spec, json.loads(saved.read_text()), wall)
            row["command"] = " ".join(cmd[3:])
            rows.append(row)
            print(
                f"{pair} {spec}: tau ratio {row['tau_ratio']:.4f} at {row['bits_per_weight']} bits/weight", flush=True
            )
    for row in rows:
        if row["method"] != "gptq-kl":
            continue
        goal = row["run"].split(":", 1)[1]
        base = next((r for r in rows if r["pair"] == row["pair"] and r["run"] == f"gptq:{goal}"), None)
        if base is not None:
            row["minus_gptq_tau_ratio_95ci"] = paired_interval(row, base)
            row["minus_gptq_tau_ratio"] = round(row["tau_ratio"] - base["tau_ratio"], 4)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    write_json_atomic(
        Path(args.out),
        {
            "command": " ".join(sys.argv),
            "commit": commit.stdout.strip(),
            "date": time.strftime("%Y-%m-%d"),
            "device": "cpu",
            "cpu_threads_per_run": 1,
            "rows": rows,
        },
    )
    print("| pair | run | bits/weight | tau | tau / bf16 | minus GPTQ [95 % CI] | acceptance at 1..7 |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in rows:
        ci = r.get("minus_gptq_tau_ratio_95ci")
        diff = f"{r['minus_gptq_tau_ratio']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else ""
        acc = " / ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
        print(
            f"| {r['pair']} (bf16 {r['tau_bf16']:.3f}) | {r['run']} | {r['bits_per_weight']:.3f} | {r['tau']:.3f} | "
            f"{r['tau_ratio']:.4f} | {diff} | {acc} |"
        )


if __name__ == "__main__":
    main()
