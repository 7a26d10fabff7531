"""Dev and test prompts for a shipped pair from its held-out corpus FILES, split in two by file.

The pair's calibration prompts (and the tau map's dev prompts, the first 32 of them) come from the text the drafter
was trained on; its held-out prompts from files it never saw. On reference-dflash2 the two disagree by more than
prompt noise (docs/mixed.md, "Held-out measurement"). This script splits the held-out files into two disjoint sets
by a salted sha256 of the relative path (`file_side`) and cuts, with the pair's own prompt recipe
(`reference.train.make_prompts`, the recorded prompt lengths):

- DEV (--dev-out, 128 prompts): dev-file prompts and the pair's shipped calibration prompts, alternating
  (dev file, shipped, dev file, ...), so the first 32 (the tau map's dev prompts) hold 16 of each kind;
- TEST (--test-out, 256 prompts): test-file prompts only, for measuring, never for choosing.

Every new prompt's text is absent from every other prompt file of the repo (the pairs' shipped files and
benchmarks/prompts/*) and from the other output. Both pairs share tokenizer, prompt recipe and corpus, so they get
the same dev-file and test prompts; only the shipped half of DEV differs. Deterministic for one stdlib:

    python benchmarks/studies/unseen_split.py reference-dflash2 --dev-out benchmarks/prompts/d2_dev_mixed.jsonl \\
        --test-out benchmarks/prompts/d2_test_unseen.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SALT = "dflash-quant unseen dev/test v1:"


def file_side(relpath: str) -> str:
    """'dev' or 'test' for a held-out file, by a salted hash of its path (the salt keeps it independent of the
    corpus's own train/held-out hash)."""
    digest = hashlib.sha256((SALT + relpath.replace("\\", "/")).encode("utf-8")).digest()
    return "dev" if digest[0] % 2 == 0 else "test"


def is_own_output(path: Path) -> bool:
    """This script's outputs (either pair): the pairs share tokenizer, recipe and corpus, so both get the same
    dev-file and test prompts, and neither pair's files may exclude the other's."""
    return path.name.endswith(("_dev_mixed.jsonl", "_test_unseen.jsonl"))


def repo_prompt_texts() -> set[str]:
    """Every prompt text in the repo's other prompt files (shipped pairs and benchmarks/prompts)."""
    files = sorted((ROOT / "dflash_quant" / "reference").glob("*/*_prompts.jsonl"))
    files += sorted((ROOT / "benchmarks" / "prompts").glob("*.jsonl"))
    texts: set[str] = set()
    for f in files:
        if is_own_output(f):
            continue
        for line in f.read_text().splitlines():
            if line.strip():
                texts.add(json.loads(line)["prompt"])
    return texts


def interleave(a: list[dict], b: list[dict]) -> list[dict]:
    """a[0], b[0], a[1], b[1], ... (equal lengths)."""
    if len(a) != len(b):
        raise ValueError(f"interleave needs equal halves, got {len(a)} and {len(b)}")
    return [row for pair in zip(a, b, strict=True) for row in pair]


def main() -> None:
    from tokenizers import Tokenizer

    from dflash_quant.reference import pair_dir
    from scripts.reference_pair.corpus import load_corpus, split_corpus
    from scripts.reference_pair.train import Recipe, make_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", choices=["reference", "reference-dflash2"])
    ap.add_argument("--dev-n", type=int, default=128, help="dev prompts in all (half from dev files)")
    ap.add_argument("--test-n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=2029)
    ap.add_argument("--dev-out", type=Path, required=True)
    ap.add_argument("--test-out", type=Path, required=True)
    args = ap.parse_args()
    if args.dev_n % 2:
        raise SystemExit(f"--dev-n must be even (half dev-file prompts, half shipped ones), got {args.dev_n}")

    root = pair_dir(args.pair)
    log = json.loads((root / "train_log.json").read_text())
    recorded = log["recipe"] if "recipe" in log else log["stage2_drafter"]["recipe"]  # reference: two-stage log
    recipe = Recipe(prompt_min_tokens=recorded["prompt_min_tokens"], prompt_max_tokens=recorded["prompt_max_tokens"])
    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    known = repo_prompt_texts()
    shipped = [json.loads(line) for line in (root / "calibration_prompts.jsonl").read_text().splitlines() if line]
    half = args.dev_n // 2
    if len(shipped) < half:
        raise SystemExit(f"the pair ships {len(shipped)} calibration prompts; --dev-n asks for {half} of them")

    _, held = split_corpus(load_corpus())
    dev_docs = [d for d in held if file_side(d.relpath) == "dev"]
    test_docs = [d for d in held if file_side(d.relpath) == "test"]

    def cut(docs, n: int, seed: int, tag: str, drop: set[str]) -> list[dict]:
        # over-generate, then drop texts the repo already holds (a few: other sets cut the same held-out files)
        rows = make_prompts(tok, docs, 3 * n, recipe, random.Random(seed), tag)
        rows = [r for r in rows if r["prompt"] not in drop][:n]
        if len(rows) < n:
            raise SystemExit(f"only {len(rows)} new {tag} prompts could be cut from {len(docs)} files; ask for fewer")
        return rows

    dev_rows = cut(dev_docs, half, args.seed, "devfile", known)
    test_rows = cut(test_docs, args.test_n, args.seed + 1, "test", known | {r["prompt"] for r in dev_rows})
    for i, r in enumerate(dev_rows):
        r["id"], r["kind"] = f"devfile-{i:03d}", "unseen_dev_file"
    own = [{**r, "kind": "shipped_calibration"} for r in shipped[:half]]
    dev = interleave(dev_rows, own)
    for i, r in enumerate(test_rows):
        r["id"] = f"test-unseen-{i:03d}"
    for path, rows in ((args.dev_out, dev), (args.test_out, test_rows)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(
        f"{len(held)} held-out files: {len(dev_docs)} dev, {len(test_docs)} test; "
        f"{args.dev_out}: {len(dev)} ({half} dev-file + {half} shipped calibration, alternating); "
        f"{args.test_out}: {len(test_rows)} from test files"
    )


if __name__ == "__main__":
    main()
