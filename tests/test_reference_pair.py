"""The shipped reference pair: files, sizes, loading, tokenizer, prompt splits; its tau and sensitivity (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_quant.reference.corpus import split_of

PAIR = Path(__file__).resolve().parent.parent / "dflash_quant" / "reference" / "pair"
MAX_BYTES = 16_000_000  # "at most 16 MB" for both models + tokenizer (+ prompt files and card)


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (PAIR / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def test_files_present_and_small():
    for rel in (
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "drafter/config.json",
        "drafter/model.safetensors",
        "calibration_prompts.jsonl",
        "heldout_prompts.jsonl",
        "README.md",
        "train_log.json",
    ):
        assert (PAIR / rel).is_file(), rel
    total = sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, total


def test_pair_dir_api():
    from dflash_quant.reference import pair_dir

    assert pair_dir().resolve() == PAIR.resolve()


def test_configs_parse():
    from dflash_quant.config import load_draft_config

    cfg = load_draft_config(PAIR / "drafter")
    raw = json.loads((PAIR / "drafter" / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert raw["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert raw["block_size"] == cfg.block_size == 8
    tcfg = json.loads((PAIR / "target" / "config.json").read_text())
    assert tcfg["model_type"] == "qwen3" and tcfg["architectures"] == ["Qwen3ForCausalLM"]
    assert tcfg["hidden_size"] == cfg.hidden_size
    assert max(cfg.target_layer_ids) < tcfg["num_hidden_layers"] - 1  # never the (normed) last layer
    # Linear input widths quantize in groups of 128.
    assert cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 128 == 0


@pytest.fixture(scope="module")
def pair():
    from dflash_quant.loading import check_pair, load_drafter, load_target

    drafter = load_drafter("reference")
    target = load_target("reference/target")
    check_pair(drafter.config, target.model)
    return drafter, target


def test_pair_loads(pair):
    drafter, target = pair
    assert next(drafter.model.parameters()).dtype == torch.float32
    assert target.tokenizer is not None
    n_t = sum(p.numel() for p in target.model.parameters())
    n_d = sum(p.numel() for p in drafter.model.parameters())
    assert 1e6 < n_d < n_t < 8e6


def test_tokenizer_round_trip_and_mask(pair):
    drafter, target = pair
    tok = target.tokenizer
    text = 'def f(x, y=3):\n    """Doc."""\n    return {"a": x ** y}  # ünïcode\n\tpass\n'
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|MASK|>") == drafter.config.mask_token_id
    assert tok.eos_token == "<|endoftext|>"
    assert len(tok) == target.model.get_input_embeddings().weight.shape[0]


def test_prompt_splits():
    calib, held = _rows("calibration_prompts.jsonl"), _rows("heldout_prompts.jsonl")
    assert len(calib) >= 64 and len(held) >= 32
    assert all(split_of(r["source"]) == "train" for r in calib)
    assert all(split_of(r["source"]) == "heldout" for r in held)
    assert not {r["prompt"] for r in calib} & {r["prompt"] for r in held}
    assert len({r["id"] for r in calib + held}) == len(calib) + len(held)


def test_heldout_prompts_absent_from_training_corpus():
    """The held-out prompts' files were excluded from training; their text appears in no train file."""
    from dflash_quant.reference.corpus import default_corpus_dir, load_corpus, split_corpus

    try:
        train, _ = split_corpus(load_corpus(default_corpus_dir()))
    except FileNotFoundError:
        pytest.skip("this interpreter ships no standard-library sources")
    blob = "\n".join(d.text for d in train)
    held = _rows("heldout_prompts.jsonl")
    leaked = [r["id"] for r in held if r["prompt"] in blob]
    # Licence headers and short idioms can repeat across files; whole prompts should almost never do.
    assert len(leaked) <= len(held) // 8, leaked


def _tau(drafter, target, prompts, max_new):
    from dflash_quant.decode import speculative_generate, target_generate

    lengths, lossless = [], True
    for ids in prompts:
        x = torch.tensor([ids])
        spec = speculative_generate(drafter, target, x, max_new, temperature=0.0)
        ref = target_generate(target, x, max_new)
        lossless &= spec.tokens == ref.tokens
        lengths += spec.acceptance_lengths
    return sum(lengths) / len(lengths), lossless


@pytest.mark.slow
def test_reference_tau_and_sensitivity(pair):
    from dflash_quant.reference.sensitivity import rtn_quantize_drafter

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    drafter, target = pair
    tok = target.tokenizer
    prompts = [tok(r["prompt"])["input_ids"] for r in _rows("heldout_prompts.jsonl")[:12]]
    tau, lossless = _tau(drafter.model, target.model, prompts, 64)
    assert lossless
    assert tau >= 3.0, tau
    q = rtn_quantize_drafter(drafter.model, bits=2, group_size=128)
    tau2, lossless2 = _tau(q, target.model, prompts, 64)
    assert lossless2  # greedy decoding stays exact whatever the drafter proposes
    assert tau2 <= 0.8 * tau, (tau, tau2)
