#!/usr/bin/env bash
# Issue #14 on one GPU in one run (results under $OUT): the target split between cuda:0 and CPU offload vs
# whole on cuda:0 (tau, tokens, Hessians, calibration peak vs prediction), and a compressed-tensors int4 target
# kept packed on CUDA (torch's tinygemm kernel) against the same target dequantized on CPU.
#   run: bash benchmarks/gpu_target_scale.sh [devmap] [int4]   (default both; needs $OUT; the image's python3)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${OUT:?set OUT to a results directory}
DQ="python3 -m dflash_quant.cli.app"
PARTS=" ${*:-devmap int4} "
W=$(mktemp -d)
if [[ $PARTS == *" devmap "* ]]; then
timeout 100 python3 benchmarks/gpu_devmap.py --pair reference --dtype float32 --out "$OUT/devmap_reference" 2>&1 | tail -2
timeout 240 python3 benchmarks/gpu_devmap.py --pair random --hidden 2048 --layers 16 --prompts 4 --new-tokens 32 --out "$OUT/devmap_random" > "$OUT/devmap_random.log" 2>&1; echo "random exit $?"; tail -4 "$OUT/devmap_random.log"
# The CLI end to end: gptq on one GPU vs the target's layers 3-5 offloaded to CPU (same packed tensors? same tau?)
SPLIT='{"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 0, "model.layers.3": "cpu", "model.layers.4": "cpu", "model.layers.5": "cpu"}'
for how in one split; do
  extra=(--device cuda); [ $how = split ] && extra=(--device-map "$SPLIT")
  timeout 150 $DQ gptq --bits 4 --dtype float32 "${extra[@]}" --num-prompts 16 --eval-num-prompts 16 --no-check-cache --no-card \
    --output "$W/gptq-$how" --json > "$OUT/gptq_devmap_$how.json" 2> "$OUT/gptq_devmap_$how.log"
  echo "gptq $how exit $?"
done
python3 - "$W" "$OUT" <<'PY'
import json, sys, torch
from safetensors.torch import load_file
w, out = sys.argv[1:]
a, b = (load_file(f"{w}/gptq-{h}/model.safetensors") for h in ("one", "split"))
same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
ra, rb = (json.load(open(f"{out}/gptq_devmap_{h}.json")) for h in ("one", "split"))
res = {"identical_tensors": same, "differing": [k for k in a if k in b and not torch.equal(a[k], b[k])][:10]}
for h, r in (("one", ra), ("split", rb)):
    p = r["parity"]
    res[h] = {"tau_bf16": p["baseline"]["tau"], "tau_int4": p["quantized"]["tau"], "lossless": p["lossless"],
              "acc": p["quantized"]["per_position_acceptance"], "calib_tau": r["calibration"]["mean_tau_bf16"], "memory": r.get("calibration", {}).get("memory")}
json.dump(res, open(f"{out}/gptq_devmap_compare.json", "w"), indent=1)
print(json.dumps(res)[:1500])
PY
fi
if [[ $PARTS == *" int4 "* ]]; then
source benchmarks/gpu_wheels.sh compressed-tensors
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_quantized_target.py 2>&1 | grep -E "tinygemm vs|passed|failed|Error" | tail -5
python3 scripts/make_int4_target.py reference:target "$W/t4" --group-size 32 | tail -1
for dev in cuda cpu; do
  dt=bfloat16; [ $dev = cpu ] && dt=float32
  timeout 120 $DQ verify reference --target "$W/t4" --prompts reference:heldout --num-prompts 32 --max-new-tokens 64 \
    --device $dev --dtype $dt --no-check-cache --json > "$OUT/int4_target_verify_$dev.json" 2> "$OUT/int4_target_verify_$dev.log"
  python3 -c "import json; r=json.load(open('$OUT/int4_target_verify_$dev.json')); s=r['summary']; print('$dev', 'tau', s['tau'], 'acc', s['per_position_acceptance'], 'lossless', s['lossless'], r['target_quantization'])"
done
fi
