"""More held-out prompts for a shipped pair, to separate quantizers whose difference the shipped 64 cannot.

Prompts are cut from the pair's held-out corpus files (never seen in training) exactly as the pair's own
held-out prompts were (`reference.train.make_prompts`, the pair's recorded prompt lengths), with another seed,
and every text already in the pair's prompt files is dropped. Deterministic for one stdlib:

    python benchmarks/heldout_extra.py reference-dflash2 --n 256 --out benchmarks/prompts/d2_heldout_extra.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

from dflash_quant.reference import pair_dir
from scripts.reference_pair.corpus import load_corpus, split_corpus
from scripts.reference_pair.train import Recipe, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", choices=["reference", "reference-dflash2"])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1009)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    root = pair_dir(args.pair)
    log = json.loads((root / "train_log.json").read_text())
    recorded = log["recipe"] if "recipe" in log else log["stage2_drafter"]["recipe"]  # reference: two-stage log
    recipe = Recipe(prompt_min_tokens=recorded["prompt_min_tokens"], prompt_max_tokens=recorded["prompt_max_tokens"])
    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    known = set()
    for name in ("calibration_prompts.jsonl", "heldout_prompts.jsonl"):
        known |= {json.loads(line)["prompt"] for line in (root / name).read_text().splitlines() if line.strip()}
    _, held_docs = split_corpus(load_corpus())
    # Over-generate, then drop prompts the pair already ships, so the extra set is disjoint from both files.
    rows = make_prompts(tok, held_docs, args.n + len(known), recipe, random.Random(args.seed), "extra")
    rows = [r for r in rows if r["prompt"] not in known][: args.n]
    if len(rows) < args.n:
        raise SystemExit(f"only {len(rows)} new held-out prompts could be cut; ask for fewer")
    for i, row in enumerate(rows):
        row["id"] = f"heldout-extra-{i:03d}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} prompts from {len(held_docs)} held-out files -> {args.out}")


if __name__ == "__main__":
    main()
