#!/usr/bin/env bash
# Issue #14 on the lent H200 in one call (results under $OUT): the target split between cuda:0 and CPU offload vs
# whole on cuda:0 (tau, tokens, Hessians, calibration peak vs prediction), and a compressed-tensors int4 target
# kept packed on CUDA (torch's tinygemm kernel) against the same target dequantized on CPU.
#   run: bash benchmarks/gpu_target_scale.sh      (needs $OUT; uses the image's python3)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
DQ="python3 -m dflash_quant.cli.app"
timeout 150 python3 benchmarks/gpu_devmap.py --pair reference --dtype float32 --out "$OUT/devmap_reference" 2>&1 | tail -6
timeout 200 python3 benchmarks/gpu_devmap.py --pair random --hidden 2048 --layers 24 --out "$OUT/devmap_random" 2>&1 | tail -6
W=$(mktemp -d)
python3 scripts/make_int4_target.py reference:target "$W/t4" --group-size 32 | tail -1
for dev in cuda cpu; do
  dt=bfloat16; [ $dev = cpu ] && dt=float32
  timeout 120 $DQ verify reference --target "$W/t4" --prompts reference:heldout --num-prompts 32 --max-new-tokens 64 \
    --device $dev --dtype $dt --no-check-cache --json > "$OUT/int4_target_verify_$dev.json" 2> "$OUT/int4_target_verify_$dev.log"
  python3 -c "import json; r=json.load(open('$OUT/int4_target_verify_$dev.json')); s=r['summary']; print('$dev', 'tau', s['tau'], 'acc', s['per_position_acceptance'], 'lossless', s['lossless'], r['target_quantization'])"
done
