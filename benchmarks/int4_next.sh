#!/usr/bin/env bash
# Issue #16's next device calls. Two development patches under benchmarks/results/int4_cuda_dev/next/ must be applied
# here first (the device gets the working tree):
#   git apply benchmarks/results/int4_cuda_dev/next/v25_bulk_copies.patch benchmarks/results/int4_cuda_dev/next/v26_pdl.patch
# v25: the bulk-copy kernel (sm_90 default with the patch; variant 8 is the cp.async kernel anywhere). v26: the
# launch flags p (programmatic dependent launch, the first chunks' weights copied before waiting for the previous
# kernel) and w (PDL alone), for both kernels. JSON and logs under $OUT.
#   bash benchmarks/int4_next.sh          1. the int4 GPU tests (every path and launch flag against the fp32 reference,
#                                            the same bits everywhere; chained PDL launches, eager and in a graph)
#                                         2. one drafter step's GEMMs at 16 and 8 rows: cp.async (v8), bulk default,
#                                            each with p and w; bulk variants 4-7
#   bash benchmarks/int4_next.sh parts    3. where the time goes: builds with one stage left out (default and v8)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tx}
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
if ! grep -q w4a16_bulk_kernel dflash_quant/int4_cuda.cu || ! grep -q griddepcontrol dflash_quant/int4_cuda.cu; then
  echo "apply benchmarks/results/int4_cuda_dev/next/v25_bulk_copies.patch and v26_pdl.patch first (git apply)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${1:-}" = parts ]; then
  timeout 540 $PY benchmarks/int4_cuda_parts.py --variants 0,8 --out "$OUT/int4_cuda_parts.json" > "$OUT/parts.log" 2>&1
  echo "parts rc=$?"; tail -1 "$OUT/parts.log" | cut -c1-1500
  exit 0
fi
timeout 220 $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_int4_cuda.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
timeout 300 $PY benchmarks/gpu_int4.py gemm --rows 16,8 --repeats 15 --out "$OUT/int4_gemm_cuda_sweep22.json" \
  --kernels "cuda+fused:v8,cuda+fused:v8:p,cuda+fused:v8:w,cuda+fused,cuda+fused:p,cuda+fused:w,cuda+fused:v4,cuda+fused:v6" \
  > "$OUT/sweep22.log" 2>&1
echo "sweep rc=$?"; grep -E '^rows' "$OUT/sweep22.log" | cut -c1-900
