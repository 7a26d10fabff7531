#!/usr/bin/env bash
# Issue #16 part 3 on the lent H200 in one call (< 8 min; JSON under $OUT): int4 drafter kernels.
#   one Qwen3-8B-DFlash-b16 drafter step's GEMMs at 8 and 16 rows, bf16 vs each int4 kernel (eager and CUDA
#   graph); gpu tests of the kernels; speculative tokens/s, bf16 vs int4 drafter, on the reference pair (its GPTQ
#   artifact) and on a random Qwen3-8B pair of full size.
# Needs the carried wheels in .wheels/ (gemlite); without them gemlite is reported as not installed.
# Steps run in order of importance, each cut at BUDGET seconds in all; one that would start later is skipped.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
BUDGET=${BUDGET:-450}
step() {  # step NAME TIMEOUT CMD...: run CMD under a timeout unless the budget is spent
  local name=$1 limit=$2; shift 2
  if (( SECONDS + 20 > BUDGET )); then echo "skipped $name (budget: ${SECONDS}s of ${BUDGET}s used)" | tee -a "$OUT/steps.log"; return; fi
  local t0=$SECONDS left=$((BUDGET - SECONDS))
  (( limit > left )) && limit=$left  # no step runs past the budget
  timeout "$limit" "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -d .wheels ]; then
  $PY -m pip install -q --no-index --find-links .wheels gemlite compressed_tensors > "$OUT/pip.log" 2>&1 \
    || $PY -m pip install -q --no-index --no-deps --find-links .wheels gemlite compressed_tensors >> "$OUT/pip.log" 2>&1
fi
$PY -c "import torch, triton, importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, *(f'{m} {bool(u.find_spec(m))}' for m in ('gemlite', 'compressed_tensors')))" | tee "$OUT/versions.txt"
step gemm_g128_sym 200 $PY benchmarks/gpu_int4.py gemm --group-size 128 --out "$OUT/int4_gemm_g128_sym.json" > "$OUT/gemm_g128.log" 2>&1
tail -c 3000 "$OUT/gemm_g128.log" | grep -v '^ ' | tail -5
step gpu_tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu -k "not gemlite" tests/test_int4_kernel.py > "$OUT/gpu_tests.log" 2>&1
tail -15 "$OUT/gpu_tests.log"
# the reference pair's GPTQ int4 drafter (calibrated on the CPU: the artifact does not depend on the device)
step ref_gptq 90 $PY -m dflash_quant.cli.app gptq reference --device cpu --output /tmp/ref-int4 --overwrite --no-verify \
  --no-card --format gptq --json > "$OUT/ref_gptq.json" 2> "$OUT/ref_gptq.log"
step e2e 120 $PY benchmarks/gpu_int4.py e2e /tmp/ref-int4 --out "$OUT/int4_e2e_reference.json" > "$OUT/e2e.log" 2>&1
tail -c 2500 "$OUT/e2e.log"
step e2e_full 150 $PY benchmarks/gpu_int4.py e2e-full --out "$OUT/int4_e2e_qwen3_8b_shapes.json" > "$OUT/e2e_full.log" 2>&1
tail -c 2000 "$OUT/e2e_full.log"
step gemm_g128_extended 120 env DFLASH_INT4_TUNE=extended $PY benchmarks/gpu_int4.py gemm --group-size 128 --rows 16 \
  --kernels triton --repeats 20 --out "$OUT/int4_gemm_g128_sym_extended.json" > "$OUT/gemm_g128_extended.log" 2>&1
step e2e_gemlite 90 $PY benchmarks/gpu_int4.py e2e /tmp/ref-int4 --kernels gemlite --out "$OUT/int4_e2e_reference_gemlite.json" \
  > "$OUT/e2e_gemlite.log" 2>&1
step gemm_g32_asym 90 $PY benchmarks/gpu_int4.py gemm --group-size 32 --asym --rows 16 --kernels triton,gemlite,tinygemm \
  --repeats 20 --out "$OUT/int4_gemm_g32_asym.json" > "$OUT/gemm_g32.log" 2>&1
step verify 80 $PY -m dflash_quant.cli.app verify /tmp/ref-int4 --compare reference --device cuda --num-prompts 16 \
  --no-check-cache --json > "$OUT/verify_int4_auto.json" 2> "$OUT/verify.log"
$PY -c "import json; r=json.load(open('$OUT/verify_int4_auto.json')); print({k: r.get(k) for k in ('drafter_kernel', 'parity')})" 2>&1 | tail -3
# the main job on cuda: its parity.json and card carry drafter_kernel and spec_speed_ratio
step gptq_cuda 170 $PY -m dflash_quant.cli.app gptq reference --device cuda --output /tmp/ref-int4-cuda --overwrite \
  --no-check-cache --json > "$OUT/gptq_cuda.json" 2> "$OUT/gptq_cuda.log"
cp /tmp/ref-int4-cuda/parity.json "$OUT/gptq_cuda_parity.json" 2>/dev/null
cp /tmp/ref-int4-cuda/README.md "$OUT/gptq_cuda_card.md" 2>/dev/null
step gpu_tests_gemlite 100 $PY -m pytest -q -p no:cacheprovider -m gpu -k gemlite tests/test_int4_kernel.py \
  > "$OUT/gpu_tests_gemlite.log" 2>&1
tail -5 "$OUT/gpu_tests_gemlite.log"
cat "$OUT/steps.log"
