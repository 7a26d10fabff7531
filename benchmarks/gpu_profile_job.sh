#!/usr/bin/env bash
# Where the main job's time goes on a GPU (#16): the job under cProfile on cuda (each FLAGS set in JOBS), the
# import and CUDA start-up costs, and per-op host overhead of tiny ops on cuda vs cpu. Results: $OUT/prof.tgz
# (cProfile dumps + logs); read with `python -c "import pstats; pstats.Stats(F).sort_stats('tottime').print_stats(40)"`.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
JOBS=${JOBS:-"b1:|b16:--check-batch 16 --calib-batch 16"}
R=$OUT/p; mkdir -p "$R"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
  command -v nvcc || echo "no nvcc"
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  /usr/bin/time -f "import dflash_quant.cli.app: %e s" $PY -c "import dflash_quant.cli.app"
  /usr/bin/time -f "import torch + cuda init: %e s" $PY -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
  $PY - <<'PY'
import time, torch
for dev in ("cpu", "cuda"):
    x = torch.randn(16, 256, device=dev); w = torch.randn(256, 256, device=dev)
    for _ in range(200): y = torch.nn.functional.linear(x, w)
    if dev == "cuda": torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5000): y = torch.nn.functional.linear(x, w)
    if dev == "cuda": torch.cuda.synchronize()
    lin = (time.perf_counter() - t) / 5000 * 1e6
    t = time.perf_counter()
    for _ in range(2000): int(y.argmax())
    sync = (time.perf_counter() - t) / 2000 * 1e6
    print(f"{dev}: linear 16x256x256 {lin:.1f} us/call, argmax+int() {sync:.1f} us/call")
PY
} > "$R/env.txt" 2>&1
IFS='|' read -ra jobs <<< "$JOBS"
for j in "${jobs[@]}"; do
  name=${j%%:*}; flags=${j#*:}
  export XDG_CACHE_HOME=/tmp/xdg-prof-$name; rm -rf "$XDG_CACHE_HOME"
  /usr/bin/time -f "$name wall %e s" -a -o "$R/walls.txt" timeout 280 $PY -m cProfile -o "$R/prof_$name.out" \
    -m dflash_quant.cli.app gptq reference --bits 4 --device cuda --output "/tmp/prof-$name" --overwrite --no-card \
    $flags --json > "$R/job_$name.json" 2> "$R/job_$name.log"
done
tar -czf "$OUT/prof.tgz" -C "$OUT" p && rm -rf "$R"
