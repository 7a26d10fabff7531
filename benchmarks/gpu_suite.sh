#!/usr/bin/env bash
# GPTQ wall time, memory and the main job on one GPU (H200 for the committed results), results under $OUT.
#   run: bash benchmarks/gpu_suite.sh      (needs $OUT; uses the image's python3 with torch + transformers)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

# 1. GPTQ wall time at Qwen3-8B-DFlash-b16 shapes (GPTQModel column skipped where it cannot import).
timeout 200 python3 benchmarks/bench_gptq.py --device cuda --repeats 1 --desc-act --out "$OUT/bench_gptq.json" 2>&1 | tee "$OUT/bench_gptq.log"

# 2. budget --engine reference vs measured allocator peak.
timeout 120 python3 benchmarks/bench_memory.py --device cuda --cases reference,qwen3-8b --contexts 4096,16384,32768 \
    --new-tokens 48 --out "$OUT" 2>&1 | tee "$OUT/bench_memory.log"

# 3. The main job on CUDA (bf16) on the reference pair.
timeout 230 python3 -m dflash_quant.cli.app gptq --bits 4 --device cuda --output /tmp/ref-int4-cuda --overwrite \
    --num-prompts 64 --eval-num-prompts 32 \
    --json > "$OUT/gptq_reference_cuda.json" 2> "$OUT/gptq_reference_cuda.log"
echo "gptq exit: $?" | tee -a "$OUT/gptq_reference_cuda.log"
python3 - <<'PY'
import json, os
r = json.load(open(os.path.join(os.environ["OUT"], "gptq_reference_cuda.json")))
p = r["parity"]
print("cuda gptq: tau bf16", p["baseline"]["tau"], "tau int4", p["quantized"]["tau"], "ratio", p["tau_ratio"], "lossless", p["lossless"], "timings", r["timings"])
PY
