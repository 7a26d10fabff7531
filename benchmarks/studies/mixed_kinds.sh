#!/usr/bin/env bash
# Issue #12, `--max-tau-loss 0.01` with a slope per solver kind (mixed_plan.kind_slope_bounds): the default
# calibration's plan measured on both held-out sets of the pair, the old one (128 of the extra held-out prompts,
# as benchmarks/mixed_reference.sh) and the unseen-file test set (256, as benchmarks/studies/mixed_unseen.sh), each
# paired with uniform 4-bit g128 of the same calibration on the same prompts (those scripts' results:
# benchmarks/results/mixed_<pair>_u4.json, benchmarks/studies/results/mixed_<pair>_default_u4_test.json).
#   nice -n 10 bash benchmarks/studies/mixed_kinds.sh reference|reference-dflash2
# WORK (default /tmp/mixed_unseen_<pair>, mixed_unseen.sh's) holds the calibration, table and tau map.
set -euo pipefail
PAIR=${1:-reference}
case $PAIR in
  reference) P=ref ;;
  reference-dflash2) P=d2 ;;
  *) echo "unknown pair $PAIR (reference or reference-dflash2)" >&2; exit 2 ;;
esac
WORK=${WORK:-/tmp/mixed_unseen_$PAIR}
PY=${PY:-python}
OUT=benchmarks/studies/results
R="$OUT/mixed_${PAIR}"
run() {  # name, prompts, n
  local res="${R}_$1.json"
  [ -s "$res" ] && return 0
  $PY -m dflash_quant.cli.app gptq "$PAIR" --calib-cache "$WORK/calib_default" --eval-prompts "$2" \
    --eval-num-prompts "$3" --eval-max-new-tokens 64 -o "$WORK/$1" --overwrite --no-card --json \
    --max-tau-loss 0.01 > "$res.part" || [ $? -eq 1 ]
  mv "$res.part" "$res"
  $PY -c "import json,sys; json.dump(json.load(open(sys.argv[1]))['mixed'], open(sys.argv[2], 'w'), indent=1)" \
    "$WORK/$1/provenance.json" "${R}_$1_provenance_mixed.json"
}
run kind_tau benchmarks/prompts/${P}_heldout_extra.jsonl 128
run kind_tau_test benchmarks/prompts/${P}_test_unseen.jsonl 256
{
  $PY benchmarks/paired_tau.py "${R}_kind_tau.json" "benchmarks/results/mixed_${PAIR}_u4.json"
  $PY benchmarks/paired_tau.py "${R}_kind_tau_test.json" "${R}_default_u4_test.json"
} | tee "${R}_kinds_paired.txt"
