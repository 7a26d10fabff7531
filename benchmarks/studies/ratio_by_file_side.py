"""Tau ratio of a gptq --json result split by the held-out file side (benchmarks/studies/unseen_split.py's
dev/test rule) of each prompt's source file: was a held-out set's ratio carried by the files that became dev or
test files?
  python benchmarks/studies/ratio_by_file_side.py PROMPTS.jsonl RESULT.json [RESULT.json ...]
"""

import importlib.util
import json
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("unseen_split", Path(__file__).with_name("unseen_split.py"))
assert _spec and _spec.loader
unseen_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unseen_split)

if len(sys.argv) < 3:
    raise SystemExit(__doc__)
rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
for path in sys.argv[2:]:
    parity = json.loads(Path(path).read_text())["parity"]
    q, b = parity["quantized"]["per_prompt"], parity["baseline"]["per_prompt"]
    cells = []
    for side in ("dev", "test"):
        idx = [i for i, x in enumerate(q) if unseen_split.file_side(rows[x["prompt_index"]]["source"]) == side]
        tq = sum(q[i]["tau"] * q[i]["steps"] for i in idx) / sum(q[i]["steps"] for i in idx)
        tb = sum(b[i]["tau"] * b[i]["steps"] for i in idx) / sum(b[i]["steps"] for i in idx)
        cells.append(f"{side} files n={len(idx)} ratio {tq / tb:.4f}")
    print(f"{Path(path).name:40s} all {parity['tau_ratio']:.4f}  " + "  ".join(cells))
