#!/usr/bin/env bash
# Mixed precision on a shipped pair (issue #12): uniform 3/4-bit GPTQ vs --max-tau-loss 0.01 and --max-bytes at
# uniform 3-bit's size, all on the same held-out prompts (never the calibration/dev prompts), one calibration.
#   nice -n 10 bash benchmarks/mixed_reference.sh [PAIR] [HELD-OUT PROMPTS] [N] [NEW TOKENS]
#   nice -n 10 bash benchmarks/mixed_reference.sh reference-dflash2 benchmarks/prompts/d2_heldout_extra.jsonl
# Results: benchmarks/results/mixed_<pair>_{u4,u3,tau,bytes}.json (gptq --json), then paired_tau.py on them
# (mixed_<pair>_paired.txt). Measured (128 x 64, CPU fp32), tau ratio held-out:
#   reference: u4 0.9962, --max-tau-loss 0.01 0.9909 at 1,026,688 vs 1,049,088 B; u3 0.9573, --max-bytes 0.9790
#   reference-dflash2: u4 0.9871, --max-tau-loss 0.01 0.9866 at 1,026,688 B; u3 0.9528, --max-bytes 0.9751
# (the --max-tau-loss rows: the shared-slope planner; the per-kind planner's: benchmarks/studies/mixed_kinds.sh)
# (candidates with the four GPTQ solvers; the plain-solver build's mixes are kept as *_plainsolver.json)
# The map's check on the dev split: python benchmarks/studies/mixed_dev_check.py PAIR WORK OUT.json
# WORK (default /tmp/mixed_bench_<pair>) holds the calibration, table and tau map between runs.
set -euo pipefail
PAIR=${1:-reference}
PROMPTS=${2:-benchmarks/prompts/ref_heldout_extra.jsonl}
N=${3:-128}
NEW=${4:-64}
WORK=${WORK:-/tmp/mixed_bench_$PAIR}
PY=${PY:-python}
OUT=benchmarks/results
mkdir -p "$WORK"
run() {  # name, extra flags...; a result already there is kept (delete it to re-measure)
  local name=$1; shift
  [ -s "$OUT/mixed_${PAIR}_$name.json" ] && return 0
  # exit 1 is a failed parity gate (uniform 3-bit fails the default 0.97): its JSON is still the measurement
  $PY -m dflash_quant.cli.app gptq "$PAIR" --calib-cache "$WORK/calib" --eval-prompts "$PROMPTS" \
    --eval-num-prompts "$N" --eval-max-new-tokens "$NEW" -o "$WORK/$name" --overwrite --no-card --json "$@" \
    > "$OUT/mixed_${PAIR}_$name.json" || [ $? -eq 1 ]
}
run u4 --bits 4
run u3 --bits 3
run tau --max-tau-loss 0.01
U3=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['quant_report']['drafter_bytes_quantized'])" "$OUT/mixed_${PAIR}_u3.json")
run bytes --max-bytes "$U3"
{
  $PY benchmarks/paired_tau.py "$OUT/mixed_${PAIR}_bytes.json" "$OUT/mixed_${PAIR}_u3.json"
  $PY benchmarks/paired_tau.py "$OUT/mixed_${PAIR}_tau.json" "$OUT/mixed_${PAIR}_u4.json"
} | tee "$OUT/mixed_${PAIR}_paired.txt"
