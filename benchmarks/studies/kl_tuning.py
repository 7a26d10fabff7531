"""Choose gptq-kl's defaults on a development split, or measure methods on held-out prompts.

dev (default): calibration on the first 96 calibration prompts of each shipped pair, parity on the other 32
(never the held-out file); devfiles: calibration on the 128 (+ calib=N extra), parity on 128 extra prompts from
training files no calibration prompt comes from; heldout: calibration on all 128, parity on the pair's 64 held-out prompts; extra: the
same calibration, parity on 256 more held-out prompts (`benchmarks/prompts/*_heldout_extra.jsonl`). Each config
is one `dflash-quant gptq` subprocess (the calibration cache is shared, so each pair calibrates once per
split); the result keeps tau, tau ratio, per-position acceptance, lossless, and quantization time.

    python benchmarks/studies/kl_tuning.py --split dev --out benchmarks/results/kl_tuning_dev.json
    python benchmarks/studies/kl_tuning.py --split heldout --configs "gptq,gptq-kl" --bits 3:128,2:64 \
        --out benchmarks/results/kl_tuning_heldout.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash_quant.io.atomic import write_json_atomic  # noqa: E402

PAIRS = {
    "reference": ROOT / "dflash_quant/reference/pair",
    "reference-dflash2": ROOT / "dflash_quant/reference/dflash2_pair",
}
DEV_FROM = 96  # calibration prompts [0, 96) calibrate; [96, 128) are the development parity set
# devfiles: the pair's 128 calibration prompts (+ calib=N <= 512 extra) calibrate; extra prompts [512, 640), cut from
# training files none of those come from, measure (the dev split's prompts share files with the extra ones)
DEVFILES_FROM, DEVFILES_N = 512, 128


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """`gptq`, `gptq-kl`, `gptq+clip` (with --clip-search), `gptq+act` (--desc-act --static-groups), or
    `gptq-kl:lr=0.002:epochs=2:codes=no:code_travel=1:tokens=256:tf=yes:calib=512:gguf=Q3_K_S:sym=no` -> (method, extra
    options).
    calib=N adds the first N prompts of `benchmarks/prompts/*_calib_extra.jsonl` (cut from the pair's training
    files) to the split's calibration prompts."""
    method, *opts = text.split(":")
    return method, dict(o.split("=", 1) for o in opts)


def split_prompts(
    pair: str, split: str, n_extra: int = 0, devfiles_n: int = DEVFILES_N
) -> tuple[list[str], list[str] | None]:
    """The split's calibration and parity prompts (JSONL lines); parity None: the pair's held-out file (the CLI's
    default). n_extra adds the first n_extra prompts of `benchmarks/prompts/*_calib_extra.jsonl` to calibration."""
    lines = [x for x in (PAIRS[pair] / "calibration_prompts.jsonl").read_text().splitlines() if x.strip()]
    short = {"reference": "ref", "reference-dflash2": "d2"}[pair]
    extra = (ROOT / f"benchmarks/prompts/{short}_calib_extra.jsonl").read_text().splitlines()
    evals: list[str] | None = None
    if split == "extra":  # 256 more held-out prompts (benchmarks/heldout_extra.py), for tighter intervals
        evals = (ROOT / f"benchmarks/prompts/{short}_heldout_extra.jsonl").read_text().splitlines()
    elif split == "dev":
        lines, evals = lines[:DEV_FROM], lines[DEV_FROM:]
    elif split == "devfiles":
        # dev prompts from training files no calibration prompt is cut from (the extra prompts from 512 on are)
        if n_extra > DEVFILES_FROM:
            raise SystemExit(f"calib={n_extra}: the devfiles split measures on extra prompts from {DEVFILES_FROM} on")
        evals = extra[DEVFILES_FROM : DEVFILES_FROM + devfiles_n]
    if len(extra) < n_extra:
        raise SystemExit(f"calib={n_extra}: only {len(extra)} extra calibration prompts")
    lines = lines + extra[:n_extra]
    if split == "devfiles":
        shared = {json.loads(x)["source"] for x in lines} & {json.loads(x)["source"] for x in evals or []}
        if shared:
            raise SystemExit(f"devfiles: {len(shared)} dev files also give calibration prompts")
    return lines, [x for x in evals if x.strip()] if evals is not None else None


def run_one(
    pair: str,
    split: str,
    bits: int,
    group: int,
    method: str,
    opts: dict[str, str],
    work: Path,
    device: str = "cpu",
    devfiles_n: int = DEVFILES_N,
) -> dict:
    cmd = [sys.executable, "-m", "dflash_quant.cli.app", "gptq", pair, "--bits", str(bits), "--group-size", str(group)]
    label = method
    method, *flags = method.split("+")  # gptq+clip: the run adds --clip-search
    cmd += ["--clip-search"] if "clip" in flags else []
    cmd += ["--desc-act", "--static-groups"] if "act" in flags else []
    cmd += ["--method", method, "--calib-cache", str(work / f"cache-{pair}-{split}"), "--json", "--no-card"]
    out = work / f"out-{pair}-{bits}-{group}-{label}-{'-'.join(f'{k}={v}' for k, v in opts.items())}"
    cmd += ["--output", str(out), "--overwrite", "--tolerance", "0.99", "--device", device]
    for k, v in opts.items():
        if k == "codes":  # codes=no: scales only
            cmd += ["--tune-codes" if v == "yes" else "--no-tune-codes"]
        elif k == "norms":  # norms=yes: the RMSNorm weights tuned too
            cmd += ["--tune-norms" if v == "yes" else "--no-tune-norms"]
        elif k == "tokens":  # tokens=256: longer calibration rollouts (more drafter inputs per prompt)
            cmd += ["--max-new-tokens", v]
        elif k == "tf":  # tf=yes: --teacher-forced calibration and check
            cmd += ["--teacher-forced"] if v == "yes" else []
        elif k == "sym":  # sym=no: asymmetric grid (a zero point per group; same bytes in GPTQ v1)
            cmd += ["--sym" if v == "yes" else "--asym"]
        elif k == "calib":
            pass  # below, with the split's calibration prompts
        elif k == "gguf":  # gguf=Q3_K_S: llama.cpp's grid (the bits:group of the row are not used)
            cmd += ["--format", "gguf", "--gguf-type", v]
        else:
            cmd += [f"--tune-{k.replace('_', '-')}", v]
    n_extra = int(opts.get("calib", 0))
    lines, evals = split_prompts(pair, split, n_extra, devfiles_n)
    if evals is not None:
        ev = work / f"{pair}-{split}-eval.jsonl"
        ev.write_text("\n".join(evals) + "\n")
        cmd += ["--eval-prompts", str(ev)]
    calib = work / f"{pair}-{split}-calib{n_extra}.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    cmd += ["--calib-prompts", str(calib), "--num-prompts", str(len(lines))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout)
    par = res["parity"]
    rep = res["quant_report"]
    return {
        "pair": pair,
        "bits": bits,
        "group_size": group,
        "method": label,
        "options": opts,
        **parity_fields(par),
        "calibrate_s": res["timings"].get("calibrate_s"),
        "quantize_s": res["timings"].get("quantize_s"),
        "tuning": rep.get("tuning"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def parity_fields(par: dict) -> dict:
    """What a study row keeps of a `gptq --json` parity result: tau, per-position and per-prompt acceptance."""
    return {
        "tau_bf16": par["baseline"]["tau"],
        "tau": par["quantized"]["tau"],
        "tau_ratio": par["tau_ratio"],
        "per_position_acceptance": par["quantized"]["per_position_acceptance"],
        "per_position_acceptance_bf16": par["baseline"]["per_position_acceptance"],
        "lossless": par["lossless"],
        "prompts": par.get("num_prompts"),
        "per_prompt": par["quantized"].get("per_prompt"),
        "per_prompt_bf16": par["baseline"].get("per_prompt"),
    }


def tau(runs: list[dict]) -> float:
    return sum(r["tau"] * r["steps"] for r in runs) / sum(r["steps"] for r in runs)


def paired_interval(row: dict, base: dict, draws: int = 2000) -> list[float]:
    """95 % paired bootstrap over prompts of (tau ratio of row) - (tau ratio of base): same prompts, same bf16 runs."""
    rng = random.Random(0)
    q, b, bf = row["per_prompt"], base["per_prompt"], row["per_prompt_bf16"]
    n = len(q)
    out = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        ref = tau([bf[i] for i in idx])
        out.append(tau([q[i] for i in idx]) / ref - tau([b[i] for i in idx]) / ref)
    out.sort()
    return [round(out[int(0.025 * draws)], 4), round(out[int(0.975 * draws)], 4)]


def base_of(row: dict, rows: list[dict]) -> dict | None:
    """The GPTQ row a tuned row is compared with: same pair, grid (llama.cpp type too) and solver flags
    (`gptq-kl+act` -> `gptq+act`)."""
    flags = "".join("+" + f for f in row["method"].split("+")[1:])
    return next(
        (
            r
            for r in rows
            if (r["pair"], r["bits"], r["group_size"], r["method"], r["options"].get("gguf"))
            == (row["pair"], row["bits"], row["group_size"], "gptq" + flags, row["options"].get("gguf"))
        ),
        None,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("dev", "devfiles", "heldout", "extra"), default="dev")
    ap.add_argument("--pairs", default="reference,reference-dflash2")
    ap.add_argument("--bits", default="3:128", help="bits:group pairs, comma-separated")
    ap.add_argument("--configs", default="gptq,gptq-kl:codes=no,gptq-kl:code_travel=2,gptq-kl:code_travel=4")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each one CPU thread)")
    ap.add_argument("--device", default="cpu", help="--device of every run (cpu: the fp32 numbers of docs/quality.md)")
    ap.add_argument(
        "--devfiles-n",
        type=int,
        default=DEVFILES_N,
        help="devfiles split: how many of the extra prompts from 512 on to measure on (up to 512, all file-disjoint)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = [
        (pair, int(bg.split(":")[0]), int(bg.split(":")[1]), *parse_config(config), config)
        for pair in args.pairs.split(",")
        for bg in args.bits.split(",")
        for config in args.configs.split(",")
    ]
    rows: list[dict] = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)

    def save(done: list[dict]) -> None:  # after every run: a run cut short keeps what finished
        write_json_atomic(
            Path(args.out),
            {
                "split": args.split,
                "command": " ".join(sys.argv),
                "commit": commit.stdout.strip(),
                "date": time.strftime("%Y-%m-%d"),
                "device": args.device,
                "cpu_threads_per_run": 1,
                "rows": done,
            },
        )

    finished: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def one(run) -> dict:
            pair, bits, group, method, opts, config = run
            row = run_one(pair, args.split, bits, group, method, opts, work, args.device, args.devfiles_n)
            print(
                f"{pair} {bits}-bit g{group} {config}: tau {row['tau']:.3f} / {row['tau_bf16']:.3f} = "
                f"{row['tau_ratio']:.4f} lossless={row['lossless']} quantize {row['quantize_s']:.1f}s "
                f"calibrate {row['calibrate_s'] or 0:.1f}s",
                flush=True,
            )
            finished.append(row)
            save(finished)
            return row

        # first one run per pair and calibration kind (gptq-kl records the drafter's inputs and decodes prompts one
        # by one; plain GPTQ batches them, so its Hessians are keyed apart): the rest read their cache entries
        first: dict[tuple, tuple] = {}
        for run in runs:
            key = (run[0], run[3].startswith("gptq-kl"), run[4].get("tokens"), run[4].get("tf"), run[4].get("calib"))
            first.setdefault(key, run)
        with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
            rows += list(pool.map(one, first.values()))
            rows += list(pool.map(one, [r for r in runs if r not in first.values()]))
    for row in rows:
        base = base_of(row, rows)
        if base is not None and base is not row:
            row["minus_gptq_tau_ratio_95ci"] = paired_interval(row, base)
            print(
                f"{row['pair']} {row['bits']}-bit {row['method']} {row['options']} - {base['method']}: "
                f"{row['tau_ratio'] - base['tau_ratio']:+.4f} {row['minus_gptq_tau_ratio_95ci']}"
            )
    save(rows)


if __name__ == "__main__":
    main()
