#!/usr/bin/env bash
# The main job (`gptq reference --bits 4`, --device cuda) under several settings in one run (#16): each job
# in JOBS is "NAME;ENV;FLAGS" (ENV like DFLASH_QUANT_SDPA=..., or empty), run with empty caches unless NAME
# ends in "-rerun" (then it reuses the caches of the job before it, with --bits 8). Also
# benchmarks/bench_sdpa.py (attention per call, per backend set). Results: $OUT/sweep.tgz -> sweep/summary.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
JOBS=${JOBS:-"default;;|default-rerun;;|cudnn;DFLASH_QUANT_SDPA=cudnn,flash,efficient,math;|b16;;--check-batch 16 --calib-batch 16|b32;;--check-batch 32 --calib-batch 32|b1;;--check-batch 1 --calib-batch 1"}
R=$OUT/sweep; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$R/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$R/gpu.txt"
[ "${SDPA:-1}" = 1 ] && timeout 120 $PY benchmarks/bench_sdpa.py --out "$R/sdpa_h200.json" > "$R/sdpa.log" 2>&1
$PY -c "import dflash_quant.cli.app, transformers.models.qwen3" 2>/dev/null  # byte-compile once, before timing
IFS='|' read -ra jobs <<< "$JOBS"
for j in "${jobs[@]}"; do
  IFS=';' read -r name envs flags <<< "$j"
  bits=4
  if [[ $name == *-rerun ]]; then bits=8; else export XDG_CACHE_HOME=/tmp/xdg-sweep-$name; rm -rf "$XDG_CACHE_HOME"; fi
  t0=$(date +%s.%N)
  env $envs timeout 240 $PY -m dflash_quant.cli.app gptq reference --bits $bits --device cuda --output "/tmp/sweep-$name" \
    --overwrite --no-card $flags --json > "$R/$name.json" 2> "$R/$name.log"
  echo "$name $? $(python3 -c "import time; print(round(time.time() - $t0, 1))")" >> "$R/walls.txt"
done
$PY - "$R" "$JOBS" <<'PY'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
out = {"command": "bash benchmarks/gpu_main_sweep.sh", "jobs": sys.argv[2], "gpu": (r / "gpu.txt").read_text().strip(), "runs": {}}
for line in (r / "walls.txt").read_text().splitlines():
    name, rc, wall = line.split()
    row = {"rc": int(rc), "wall_s": float(wall)}
    try:
        j = json.loads((r / f"{name}.json").read_text())
        p = j["parity"]
        row.update(timings_s={k: round(v, 2) for k, v in j.get("timings", {}).items()}, tau_bf16=p["baseline"]["tau"],
                   tau_quant=p["quantized"]["tau"], tau_ratio=p["tau_ratio"], lossless=p.get("lossless"),
                   lossless_status=p.get("lossless_status"), passed=p.get("passed"), cache=p.get("cache"),
                   calibration=j.get("calibration", {}).get("batch_rows"), spec_batch=p.get("spec_batch"))
    except (OSError, ValueError, KeyError) as exc:
        row["error"] = repr(exc)
    out["runs"][name] = row
(r / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
PY
tar -czf "$OUT/sweep.tgz" -C "$OUT" sweep
