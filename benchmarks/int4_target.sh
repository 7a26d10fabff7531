#!/usr/bin/env bash
# Drafter calibrated on the bf16 reference target vs on its int4 (compressed-tensors W4A16 g32 RTN) form,
# both GPTQ 4-bit, both checked against the int4 target on the reference pair's held-out prompts.
# Usage: nice -n 10 bash benchmarks/int4_target.sh [NUM_PROMPTS] [MAX_NEW_TOKENS]
set -euo pipefail
N=${1:-64}; T=${2:-64}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
R=benchmarks/results
DQ="python -m dflash_quant.cli.app"
python scripts/make_int4_target.py reference:target "$W/target-w4g32" --group-size 32
$DQ gptq reference -o "$W/q-bf16target" --no-verify --no-card --format gptq --json > "$R/int4_target_gptq_bf16target.json"
$DQ gptq reference --target "$W/target-w4g32" -o "$W/q-int4target" --no-verify --no-card --format gptq --json \
  > "$R/int4_target_gptq_int4target.json"
for which in bf16target int4target; do
  $DQ verify "$W/q-$which" --target "$W/target-w4g32" --compare reference --prompts reference:heldout \
    --num-prompts "$N" --max-new-tokens "$T" --no-check-cache --json > "$R/int4_target_verify_$which.json" || true
done
# context: the bf16 drafter against the dense target on the same prompts (what the int4 target itself costs)
$DQ verify reference --target reference:target --prompts reference:heldout --num-prompts "$N" --max-new-tokens "$T" \
  --no-check-cache --json > "$R/int4_target_verify_dense_target.json"
python - "$W/target-w4g32" <<'PY' > "$R/int4_target_resident.json"
import json, sys, torch
from dflash_quant.loading import load_target
out, w4 = {}, sys.argv[1]
for name, src, dtype in [("int4_fp32", w4, torch.float32), ("dense_fp32", "reference:target", torch.float32),
                         ("int4_bf16", w4, torch.bfloat16), ("dense_bf16", "reference:target", torch.bfloat16)]:
    out[name] = load_target(src, dtype=dtype).quantization.to_dict()
print(json.dumps(out, indent=2))
PY
