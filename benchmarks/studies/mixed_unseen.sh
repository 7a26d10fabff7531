#!/usr/bin/env bash
# Issue #12's --max-tau-loss goal under a dev/test protocol built from UNSEEN corpus files (docs/mixed.md,
# "Calibrating on unseen files"). The pair's held-out corpus files are split in two by file
# (benchmarks/studies/unseen_split.py): the DEV file (128 prompts: 64 from dev files alternating with 64 of the pair's
# shipped calibration prompts) is the GPTQ calibration and, through its first 32, the tau map's dev split; the
# TEST file (256 prompts from the other files) is only measured on.
#   nice -n 10 bash benchmarks/studies/mixed_unseen.sh [PAIR]        # reference-dflash2 (default) or reference
# Steps, each result kept when already there (delete it to re-measure):
#   1. plan on the dev side only: --max-tau-loss 0.01 with --no-verify (mixed_<pair>_devmixed_tau_plan.json and
#      its provenance's `mixed` section, which holds the tau map with uniform 4-bit's dev point);
#   2. on the test prompts (N x NEW tokens): dev-mixed calibration uniform 4-bit g128 (`devmixed_u4`),
#      dev-mixed --max-tau-loss 0.01 (`devmixed_tau`), default calibration uniform 4-bit (`default_u4_test`)
#      and, added after the first test numbers as a comparator only, the default calibration's own
#      --max-tau-loss 0.01 mix (`default_tau_test`);
#   3. paired bootstrap (benchmarks/paired_tau.py) -> mixed_<pair>_unseen_paired.txt;
#   4. benchmarks/studies/unseen_dev_check.py: every drafter on the 128 DEV prompts
#      -> mixed_<pair>_unseen_dev_check.json.
# Results under benchmarks/studies/results/. WORK (default /tmp/mixed_unseen_<pair>) holds both calibrations, the
# table and the tau map between runs.
set -euo pipefail
PAIR=${1:-reference-dflash2}
case $PAIR in
  reference) P=ref ;;
  reference-dflash2) P=d2 ;;
  *) echo "unknown pair $PAIR (reference or reference-dflash2)" >&2; exit 2 ;;
esac
N=${N:-256}
NEW=${NEW:-64}
WORK=${WORK:-/tmp/mixed_unseen_$PAIR}
PY=${PY:-python}
OUT=benchmarks/studies/results
DEV=benchmarks/prompts/${P}_dev_mixed.jsonl
TEST=benchmarks/prompts/${P}_test_unseen.jsonl
mkdir -p "$WORK" "$OUT"
[ -s "$DEV" ] && [ -s "$TEST" ] || $PY benchmarks/studies/unseen_split.py "$PAIR" --dev-out "$DEV" --test-out "$TEST"
run() {  # name, calibration cache, extra flags...
  local name=$1 cache=$2; shift 2
  local res="$OUT/mixed_${PAIR}_$name.json"
  [ -s "$res" ] && return 0
  # exit 1 is a failed parity gate: its JSON is still the measurement
  $PY -m dflash_quant.cli.app gptq "$PAIR" --calib-cache "$WORK/$cache" --eval-prompts "$TEST" \
    --eval-num-prompts "$N" --eval-max-new-tokens "$NEW" -o "$WORK/$name" --overwrite --no-card --json "$@" \
    > "$res.part" || [ $? -eq 1 ]
  mv "$res.part" "$res"
  if [ -s "$WORK/$name/provenance.json" ] && grep -q '"mixed"' "$WORK/$name/provenance.json"; then
    $PY -c "import json,sys; json.dump(json.load(open(sys.argv[1]))['mixed'], open(sys.argv[2], 'w'), indent=1)" \
      "$WORK/$name/provenance.json" "$OUT/mixed_${PAIR}_${name}_provenance_mixed.json"
  fi
}
run devmixed_tau_plan calib_devmixed --calib-prompts "$DEV" --max-tau-loss 0.01 --no-verify
run devmixed_u4 calib_devmixed --calib-prompts "$DEV" --bits 4
run devmixed_tau calib_devmixed --calib-prompts "$DEV" --max-tau-loss 0.01
run default_u4_test calib_default --bits 4
# comparator added after the first test numbers (chooses nothing): the default protocol's own --max-tau-loss mix
run default_tau_test calib_default --max-tau-loss 0.01
R="$OUT/mixed_${PAIR}"
{
  $PY benchmarks/paired_tau.py "${R}_devmixed_tau.json" "${R}_default_u4_test.json"
  $PY benchmarks/paired_tau.py "${R}_devmixed_tau.json" "${R}_devmixed_u4.json"
  $PY benchmarks/paired_tau.py "${R}_devmixed_u4.json" "${R}_default_u4_test.json"
  $PY benchmarks/paired_tau.py "${R}_default_tau_test.json" "${R}_default_u4_test.json"
} | tee "${R}_unseen_paired.txt"
# dev-side diagnostic (run after the test numbers; decodes the DEV prompts only): the map's 32 and the other 96
[ -s "${R}_unseen_dev_check.json" ] ||
  $PY benchmarks/studies/unseen_dev_check.py "$PAIR" "$WORK" "${R}_unseen_dev_check.json"
