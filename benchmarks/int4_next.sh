#!/usr/bin/env bash
# Issue #16's next device call, in one command: the bulk-copy kernel of
# benchmarks/results/int4_cuda_dev/next/v25_bulk_copies.patch (apply it here first: `git apply ...`; the device gets
# the working tree) checked and timed against the cp.async kernel (variant 8) in one run. JSON and logs under $OUT.
#   1. the GPU tests (every path against the fp32 reference, the same bits as the cp.async kernel)
#   2. one drafter step's GEMMs at 16 and 8 rows: cp.async (v8), bulk default, bulk variants 4-7, the split rule at
#      3 and 2 blocks an SM
#   3. where the time goes: builds with one stage left out, as the default and as the cp.async kernel
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tx}
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
if ! grep -q w4a16_bulk_kernel dflash_quant/int4_cuda.cu; then
  echo "the bulk-copy kernel is not in dflash_quant/int4_cuda.cu: git apply benchmarks/results/int4_cuda_dev/next/v25_bulk_copies.patch first" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_int4_cuda.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
timeout 240 $PY benchmarks/gpu_int4.py gemm --rows 16,8 --repeats 20 --out "$OUT/int4_gemm_cuda_sweep21.json" \
  --kernels "cuda+fused:v8,cuda+fused,cuda+fused:v4,cuda+fused:v5,cuda+fused:v6,cuda+fused:v7,cuda+fused:b3,cuda+fused:b2" \
  > "$OUT/sweep21.log" 2>&1
echo "sweep rc=$?"; grep -E '^rows' "$OUT/sweep21.log" | cut -c1-600
timeout 300 $PY benchmarks/int4_cuda_parts.py --variants 0,8 --out "$OUT/int4_cuda_parts.json" > "$OUT/parts.log" 2>&1
echo "parts rc=$?"; tail -1 "$OUT/parts.log" | cut -c1-1500
