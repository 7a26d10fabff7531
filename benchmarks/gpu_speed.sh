#!/usr/bin/env bash
# Issue #16 parts 1, 2, 4 on the lent H200 in one call (results under $OUT):
#   GPTQ textbook vs batched (+ Triton kernel equality tests), prefill TTFT with/without drafter, main job on cuda.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gptq_batched.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
timeout 170 python3 benchmarks/bench_gptq.py --device cuda --repeats 1 --no-gptqmodel --out "$OUT/bench_gptq.json" 2>&1 | tail -8
timeout 120 python3 benchmarks/bench_prefill.py --device cuda --lengths 1024,8192,32768 --repeats 3 --out "$OUT/prefill.json" 2>&1 | tail -4
for run in "cold --bits 4" "rerun --bits 8"; do
  set -- $run; name=$1; shift
  /usr/bin/time -f "$name wall %e s" timeout 150 python3 -m dflash_quant.cli.app gptq "$@" --device cuda --output /tmp/ref-$name \
    --overwrite --check-cache /tmp/check-cache --json > "$OUT/ref_cuda_$name.json" 2>> "$OUT/ref_cuda.log"
  python3 -c "import json,sys; r=json.load(open('$OUT/ref_cuda_$name.json')); p=r['parity']; print('$name', 'tau', p['baseline']['tau'], p['quantized']['tau'], 'ratio', p['tau_ratio'], 'cache', p['cache'], 'timings', {k: round(v,1) for k,v in r['timings'].items()})"
done
tail -2 "$OUT/ref_cuda.log"
