#!/usr/bin/env bash
# Issue #16 on one GPU in one command (results under $OUT/r, bundled as $OUT/speed.tgz; then locally
# `python benchmarks/speed_report.py --results DIR` writes speed_summary.json and speed_summary.png):
#   1. GPTQ, textbook vs ours, Qwen3-8B-DFlash-b16 shapes, same run      -> bench_gptq_h200_batched.json
#   2. one drafter step's GEMMs at 8/16 rows, bf16 vs our int4 kernels   -> int4_gemm_h200_cuda_final.json
#   3. prefill TTFT with/without the drafter at 1k/8k/32k tokens           -> prefill_h200.json
#   4. the main job (`gptq --bits 4` on the reference pair) on cuda, empty caches, timed, then a re-run with
#      other settings (caches kept); in the default dtype (bf16) and in fp32 (the CPU's dtype; DTYPES picks)
#                                                                          -> gpu_main_job_h200.json
# STEPS selects (default "gptq gemm prefill main"); each step is cut at its timeout, the whole at BUDGET s.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
BUDGET=${BUDGET:-560}
STEPS=${STEPS:-gptq gemm prefill main}
MAIN_FLAGS=${MAIN_FLAGS:-}  # e.g. "--check-batch 16 --calib-batch 16"
DTYPES=${DTYPES:-auto float32}
R=$OUT/r; mkdir -p "$R"
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  if (( SECONDS + 20 > BUDGET )); then echo "skipped $name (budget)" >> "$R/steps.log"; return; fi
  local left=$((BUDGET - SECONDS)) t0=$SECONDS; (( limit > left )) && limit=$left
  timeout "$limit" "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$R/steps.log"  # not to stdout: a step's stdout may be its JSON
}
want() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$R/gpu.txt"
want gptq && step gptq 200 $PY benchmarks/bench_gptq.py --device cuda --repeats 1 --no-gptqmodel \
  --out "$R/bench_gptq_h200_batched.json" > "$R/bench_gptq.log" 2>&1
# the CUDA kernel builds on its first use (~70 s) inside this step, before anything is timed
want gemm && step gemm 220 $PY benchmarks/gpu_int4.py gemm --group-size 128 --kernels cuda+fused,triton+fused \
  --out "$R/int4_gemm_h200_cuda_final.json" > "$R/gemm.log" 2>&1
want prefill && step prefill 120 $PY benchmarks/bench_prefill.py --device cuda --lengths 1024,8192,32768 --repeats 3 \
  --out "$R/prefill_h200.json" > "$R/prefill.log" 2>&1
if want main; then
  $PY -c "import dflash_quant.cli.app, transformers.models.qwen3" 2>/dev/null  # byte-compile once, before timing
  for dtype in $DTYPES; do
    export XDG_CACHE_HOME=/tmp/xdg-speed-$dtype; rm -rf "$XDG_CACHE_HOME"
    for run in "first --bits 4" "rerun --bits 8"; do
      set -- $run; name=${dtype}_$1; shift
      t0=$(date +%s.%N)
      step "main_$name" 240 $PY -m dflash_quant.cli.app gptq reference "$@" --device cuda --dtype "$dtype" \
        --output "/tmp/ref-$name" --overwrite --no-card $MAIN_FLAGS --json > "$R/main_$name.json" 2> "$R/main_$name.log"
      echo "$name $(python3 -c "import time; print(round(time.time() - $t0, 1))")" >> "$R/main_walls.txt"
    done
  done
  $PY - "$R" <<'PY'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
walls = dict(line.split() for line in (r / "main_walls.txt").read_text().splitlines())
import os
out = {"command": "bash benchmarks/gpu_speed.sh", "main_flags": os.environ.get("MAIN_FLAGS", ""), "gpu": (r / "gpu.txt").read_text().strip()}
for name in walls:
    try:
        j = json.loads((r / f"main_{name}.json").read_text())
    except (OSError, ValueError):
        out[name] = {"wall_s": float(walls[name]), "error": "no JSON (timed out or failed)"}
        continue
    p = j["parity"]
    out[name] = {
        "wall_s": float(walls[name]),
        "timings_s": {k: round(v, 2) for k, v in j.get("timings", {}).items()},
        "tau_bf16": p["baseline"]["tau"], "tau_quant": p["quantized"]["tau"], "tau_ratio": p["tau_ratio"],
        "lossless": p.get("lossless"), "lossless_status": p.get("lossless_status"), "passed": p.get("passed"),
        "dtype": p.get("dtype"), "check_batch": p["quantized"].get("spec_batch", 1),
        "calib_batch": j.get("calibration", {}).get("batch_rows", 1),
    }
(r / "gpu_main_job_h200.json").write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps(out))
PY
fi
cat "$R/steps.log"
tar -czf "$OUT/speed.tgz" -C "$OUT" r && rm -rf "$R"
