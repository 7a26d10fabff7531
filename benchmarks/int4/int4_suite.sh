#!/usr/bin/env bash
# The int4 kernel's measurements on one GPU (issue #16). JSON and logs under $OUT; each mode runs in under 10 minutes.
# Compare ratios only within one run: the same kernel's step ratio moves by ~3 % between runs.
#   bash benchmarks/int4/int4_suite.sh        build; one step's GEMMs at 16 rows from CUDA graphs: the shipped kernel
#                                             with q|k|v as one launch (cuda+qkv, the runtime's default), the same with
#                                             the split-K sum's dead partials discarded from L2 (cuda+qkv:v6, same
#                                             bits), q and k|v apart (cuda+fused), bf16 as the drafter runs it,
#                                             bf16+fused, bf16+qkv; then the split-K sum's probes (parts, below)
#   bash benchmarks/int4/int4_suite.sh goal   the step ratio alone (~4 min with the build): cuda+qkv, cuda+qkv:v6,
#                                             cuda+fused, bf16+qkv
#   bash benchmarks/int4/int4_suite.sh parts  the split-K sum's probes alone (int4_cuda_parts.py: its code kept but
#                                             not run, partials stored with no count-in, a count-in with no last
#                                             block's sum, no sum)
#   bash benchmarks/int4/int4_suite.sh e2e    speculative tokens/s with q|k|v as one launch and without: the reference
#                                             pair (gpu_int4.py e2e) and the 8B-shaped random pair (e2e-full)
#   bash benchmarks/int4/int4_suite.sh tests  the cuda GPU tests and q|k|v at a decode step's real rows
#                                             (int4_qkv_rows.py: context rows 0-16)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tx}
export MAX_JOBS=${MAX_JOBS:-16} HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
parts() {  # what the split-K sum's pieces cost
  timeout 320 $PY benchmarks/int4/int4_cuda_parts.py --parts no_sum,sum_not_run,sum_stores_only,sum_no_last \
    --out "$OUT/int4_cuda_parts_sum.json" > "$OUT/parts.log" 2>&1
  echo "parts rc=$?"; tail -1 "$OUT/parts.log" | cut -c1-1500
}
gemm() {  # one step's GEMMs at 16 rows from CUDA graphs: gemm NAME REPEATS KERNELS
  timeout 240 $PY benchmarks/gpu_int4.py gemm --rows 16 --repeats "$2" --out "$OUT/int4_$1.json" --kernels "$3" \
    > "$OUT/$1.log" 2>&1
  echo "gemm rc=$?"; grep -E '^rows' "$OUT/$1.log" | cut -c1-1500
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# the runtime's build (int4_cuda_parts.py compiles its own, the shipped source included, so parts skips this)
[ "${1:-}" = parts ] ||
  $PY -c "import time; t = time.time(); from dflash_quant.kernels.int4_cuda import module; module(); print(f'built in {time.time() - t:.0f} s')"
case "${1:-}" in
  e2e)
    timeout 150 $PY -m dflash_quant.cli.app gptq reference --device cuda --no-verify --no-card -o /tmp/ref-int4-next \
      > "$OUT/e2e_artifact.log" 2>&1
    timeout 150 $PY benchmarks/gpu_int4.py e2e /tmp/ref-int4-next --kernels cuda,cuda:qkv --out "$OUT/int4_e2e_qkv.json" \
      > "$OUT/e2e.log" 2>&1
    echo "e2e rc=$?"
    timeout 250 $PY benchmarks/gpu_int4.py e2e-full --kernels cuda,cuda:qkv --out "$OUT/int4_e2e_full_qkv.json" \
      > "$OUT/e2e_full.log" 2>&1
    echo "e2e-full rc=$?"
    ;;
  parts)
    parts
    ;;
  goal)
    gemm gemm_goal 12 "cuda+qkv,cuda+qkv:v6,cuda+fused,bf16+qkv"
    ;;
  tests)
    timeout 200 $PY -m pytest -q -x -p no:cacheprovider -m gpu -k cuda tests/test_int4_kernel.py tests/test_int4_cuda.py \
      > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
    timeout 90 $PY benchmarks/int4/int4_qkv_rows.py --out "$OUT/int4_qkv_rows.json" > "$OUT/qkv_rows.log" 2>&1
    echo "qkv rows rc=$?"; tail -5 "$OUT/qkv_rows.log"
    ;;
  *)  # the step ratio first: if the time limit cuts the run, the parts benchmark is what is lost
    gemm gemm_qkv 20 "cuda+fused,cuda+qkv,cuda+qkv:v6,bf16+fused,bf16+qkv"
    parts
    ;;
esac
