#!/usr/bin/env bash
# Issue #16 parts 2-4 on one GPU in one run (JSON under $OUT, bundled as $OUT/int4.tgz): our int4 kernels.
#   Builds our CUDA kernel, then one Qwen3-8B-DFlash-b16 drafter step's GEMMs at 8 and 16 rows, bf16 vs int4
#   (eager and CUDA graph), and the kernels' gpu tests; optional: E2E=1 tokens/s of the reference pair through
#   each kernel, EXTENDED=1 the Triton kernel's full tuning space, MAIN_JOB=1 the main job on cuda (timed, with
#   the kernel), PREFILL=1 prefill TTFT with and without the drafter (bf16, int4 dequantized, int4 kernel).
# Set KERNELS to add library kernels (gemlite needs the carried wheels in .wheels/: benchmarks/gpu_wheels.sh).
# Steps run in order of importance, each cut at BUDGET seconds in all; one that would start later is skipped.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
BUDGET=${BUDGET:-540}
KERNELS=${KERNELS:-cuda+fused,triton+fused}
R=$OUT/r; mkdir -p "$R"
step() {  # step NAME TIMEOUT CMD...: run CMD under a timeout unless the budget is spent
  local name=$1 limit=$2; shift 2
  if (( SECONDS + 20 > BUDGET )); then echo "skipped $name (budget: ${SECONDS}s of ${BUDGET}s used)" | tee -a "$R/steps.log"; return; fi
  local t0=$SECONDS left=$((BUDGET - SECONDS))
  (( limit > left )) && limit=$left  # no step runs past the budget
  timeout "$limit" "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$R/steps.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$R/versions.txt"
# our CUDA kernel is built once (torch's extension builder) before anything times it
step build_cuda 240 $PY -c "import time; t = time.time(); from dflash_quant.kernels.int4_cuda import module; module(); print(f'built in {time.time() - t:.1f} s')" \
  > "$R/build_cuda.log" 2>&1
tail -c 3000 "$R/build_cuda.log"
step gemm ${GEMM_LIMIT:-100} $PY benchmarks/gpu_int4.py gemm --group-size 128 --kernels "$KERNELS" --out "$R/int4_gemm_g128_sym.json" \
  > "$R/gemm.log" 2>&1
grep '^rows 16' "$R/gemm.log" | cut -c1-400
step gpu_tests 150 $PY -m pytest -q -x -p no:cacheprovider -m gpu -k "${TEST_K:-triton or cuda}" tests/test_int4_cuda.py \
  tests/test_int4_kernel.py > "$R/gpu_tests.log" 2>&1
tail -3 "$R/gpu_tests.log"
# EXTENDED=1: every config of DFLASH_INT4_TUNE=extended (warps, pipeline depth), i.e. what the pruned set gives up
[ "${EXTENDED:-0}" = 1 ] && step gemm_extended 250 env DFLASH_INT4_TUNE=extended $PY benchmarks/gpu_int4.py gemm --group-size 128 --rows 16 \
  --kernels "$KERNELS" --repeats 20 --out "$R/int4_gemm_g128_sym_extended.json" > "$R/gemm_extended.log" 2>&1
# E2E=1: the reference pair's int4 drafter (calibrated on cuda) through each kernel: speculative tokens/s and tau
[ "${E2E:-0}" = 1 ] && step e2e 200 bash -c "$PY -m dflash_quant.cli.app gptq reference --device cuda --no-verify --no-card \
  -o /tmp/ref-int4-e2e > '$R/e2e_artifact.log' 2>&1 && $PY benchmarks/gpu_int4.py e2e /tmp/ref-int4-e2e \
  --kernels '${E2E_KERNELS:-cuda,cuda:nofuse,triton}' --out '$R/int4_e2e.json' > '$R/e2e.log' 2>&1"
# the main job on cuda, empty caches, timed (vs the 2-core CPU's `make quickstart`); its parity.json and card carry
# drafter_kernel and spec_speed_ratio (int4 through the kernel vs bf16, same check)
[ "${MAIN_JOB:-0}" = 1 ] && step gptq_cuda 170 env XDG_CACHE_HOME=/tmp/xdg-empty /usr/bin/time -f "gptq_cuda wall %e s" $PY -m dflash_quant.cli.app \
  gptq reference --device cuda --int4-kernel ${MAIN_KERNEL:-cuda} --output /tmp/ref-int4-cuda --json > "$R/gptq_cuda.json" 2> "$R/gptq_cuda.log"
tail -2 "$R/gptq_cuda.log"
cp /tmp/ref-int4-cuda/parity.json "$R/gptq_cuda_parity.json" 2>/dev/null
cp /tmp/ref-int4-cuda/README.md "$R/gptq_cuda_card.md" 2>/dev/null
[ "${PREFILL:-0}" = 1 ] && step prefill 120 $PY benchmarks/bench_prefill.py --device cuda --lengths 1024,8192,32768 \
  --repeats 3 --out "$R/prefill_h200.json" > "$R/prefill.log" 2>&1
cat "$R/steps.log"
tar -czf "$OUT/int4.tgz" -C "$OUT" r && rm -rf "$R"
