#!/usr/bin/env bash
# Issue #16 part 3 on the lent H200 in one call (< 8 min; JSON under $OUT): int4 drafter kernels.
#   gpu tests of the int4 kernels; one Qwen3-8B-DFlash-b16 drafter step's GEMMs at 8 and 16 rows, bf16 vs
#   each int4 kernel (eager and CUDA graph); the reference pair's speculative tokens/s, bf16 vs GPTQ int4.
# Needs the carried wheels in .wheels/ (gemlite); without them gemlite is reported as not installed.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -d .wheels ]; then
  $PY -m pip install -q --no-index --find-links .wheels gemlite > "$OUT/pip.log" 2>&1 \
    || $PY -m pip install -q --no-index --no-deps --find-links .wheels gemlite >> "$OUT/pip.log" 2>&1
fi
$PY -c "import torch, triton; import importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, 'gemlite', bool(u.find_spec('gemlite')))" | tee "$OUT/versions.txt"
timeout 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_int4_kernel.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout 170 $PY benchmarks/gpu_int4.py gemm --group-size 128 --out "$OUT/int4_gemm_g128_sym.json" 2>&1 | grep -v '^ ' | tail -4
timeout 80 $PY benchmarks/gpu_int4.py gemm --group-size 32 --asym --rows 16 --kernels triton,gemlite,tinygemm \
  --repeats 20 --out "$OUT/int4_gemm_g32_asym.json" 2>&1 | grep -v '^ ' | tail -3
# the reference pair's GPTQ int4 drafter (calibrated on the CPU: the artifact does not depend on the device)
timeout 90 $PY -m dflash_quant.cli.app gptq reference --device cpu --output /tmp/ref-int4 --overwrite --no-verify \
  --no-card --format gptq --json > "$OUT/ref_gptq.json" 2> "$OUT/ref_gptq.log"
timeout 100 $PY benchmarks/gpu_int4.py e2e /tmp/ref-int4 --out "$OUT/int4_e2e_reference.json" 2>&1 | tail -30
timeout 80 $PY -m dflash_quant.cli.app verify /tmp/ref-int4 --compare reference --device cuda --num-prompts 16 \
  --no-check-cache --json > "$OUT/verify_int4_auto.json" 2> "$OUT/verify.log"
$PY -c "import json; r=json.load(open('$OUT/verify_int4_auto.json')); print({k: r.get(k) for k in ('int4_kernel', 'parity')})" 2>&1 | tail -3
