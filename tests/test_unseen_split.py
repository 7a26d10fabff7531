"""benchmarks/studies/unseen_split.py: the dev/test file rule and the committed prompt files it wrote."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("unseen_split", ROOT / "benchmarks" / "studies" / "unseen_split.py")
assert _spec and _spec.loader
unseen_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unseen_split)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_file_side_is_a_fixed_rule():
    names = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(10)]
    sides = [unseen_split.file_side(n) for n in names]
    assert sides == [unseen_split.file_side(n) for n in names]
    assert set(sides) == {"dev", "test"}
    assert 60 < sides.count("dev") < 140  # about half
    assert unseen_split.file_side("a\\b.py") == unseen_split.file_side("a/b.py")
    # pinned: a change of salt or rule would silently move files between dev and test
    assert [unseen_split.file_side(n) for n in ("email/parser.py", "ctypes/test/test_callbacks.py")] == ["dev", "test"]


def test_interleave_alternates_and_refuses_unequal_halves():
    a, b = [{"i": 0}, {"i": 2}], [{"i": 1}, {"i": 3}]
    assert [r["i"] for r in unseen_split.interleave(a, b)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="equal halves"):
        unseen_split.interleave(a, b[:1])


@pytest.mark.parametrize("p, pair_dir", [("d2", "dflash2_pair"), ("ref", "pair")])
def test_committed_files_are_split_by_file_and_disjoint(p, pair_dir):
    dev = _rows(ROOT / "benchmarks" / "prompts" / f"{p}_dev_mixed.jsonl")
    test = _rows(ROOT / "benchmarks" / "prompts" / f"{p}_test_unseen.jsonl")
    shipped = _rows(ROOT / "dflash_quant" / "reference" / pair_dir / "calibration_prompts.jsonl")
    assert len(dev) == 128 and len(test) == 256
    kinds = [r["kind"] for r in dev]
    assert kinds == ["unseen_dev_file", "shipped_calibration"] * 64  # the tau map's first 32 hold both
    assert [r["prompt"] for r in dev[1::2]] == [r["prompt"] for r in shipped[:64]]
    assert all(unseen_split.file_side(r["source"]) == "dev" for r in dev[0::2])
    assert all(unseen_split.file_side(r["source"]) == "test" for r in test)
    new_dev, test_texts = {r["prompt"] for r in dev[0::2]}, {r["prompt"] for r in test}
    assert len(new_dev) == 64 and len(test_texts) == 256
    assert not new_dev & test_texts
    assert not {r["prompt"] for r in dev} & test_texts
    others = unseen_split.repo_prompt_texts()  # every other prompt file of the repo
    assert not new_dev & others and not test_texts & others
