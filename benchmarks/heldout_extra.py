"""More prompts for a shipped pair: held-out ones to separate quantizers whose difference the shipped 64 cannot,
or (`--from train`) more calibration prompts to see whether calibration-hungry methods are data-limited.

Prompts are cut from the pair's held-out corpus files (never seen in training) or from its training files, exactly
as the pair's own prompts were (`reference.train.make_prompts`, the pair's recorded prompt lengths), with another
seed, and every text already in the pair's prompt files is dropped. Deterministic for one stdlib:

    python benchmarks/heldout_extra.py reference-dflash2 --n 256 --out benchmarks/prompts/d2_heldout_extra.jsonl
    python benchmarks/heldout_extra.py reference-dflash2 --from train --n 1024 \
        --exclude benchmarks/prompts/d2_heldout_extra.jsonl --out benchmarks/prompts/d2_calib_extra.jsonl
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
    ap.add_argument("--from", dest="split", choices=("heldout", "train"), default="heldout", help="corpus files to cut")
    ap.add_argument("--exclude", type=Path, action="append", default=[], help="a prompt file whose texts to leave out")
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
    for path in args.exclude:  # e.g. the extra held-out prompts: a snippet can occur in a train and a held-out file
        known |= {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}
    train_docs, held_docs = split_corpus(load_corpus())
    docs = held_docs if args.split == "heldout" else train_docs
    # Over-generate, then drop prompts the pair already ships, so the extra set is disjoint from both files.
    rows = make_prompts(tok, docs, args.n + len(known), recipe, random.Random(args.seed), "extra")
    rows = [r for r in rows if r["prompt"] not in known][: args.n]
    if len(rows) < args.n:
        raise SystemExit(f"only {len(rows)} new {args.split} prompts could be cut; ask for fewer")
    tag = "heldout-extra" if args.split == "heldout" else "calib-extra"
    for i, row in enumerate(rows):
        row["id"] = f"{tag}-{i:03d}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} prompts from {len(docs)} {args.split} files -> {args.out}")


if __name__ == "__main__":
    main()
