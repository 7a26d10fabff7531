"""The shipped reference pair: files, sizes, loading, tokenizer, prompt splits; its tau and sensitivity (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.reference_pair.corpus import split_of

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
    from dflash_quant.models.config import load_draft_config

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
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.target import load_target
    from dflash_quant.models.checks import check_pair

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
    from scripts.reference_pair.corpus import default_corpus_dir, load_corpus, split_corpus

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
    from dflash_quant.speculative.decode import speculative_generate, target_generate

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
    from scripts.reference_pair.sensitivity import rtn_quantize_drafter

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


# ---------------------------------------------------------------------------------------------- the DFlash2 pair

PAIR2 = PAIR.parent / "dflash2_pair"


def test_dflash2_files_present_and_small():
    for rel in (
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "drafter/config.json",
        "drafter/model.safetensors",
        "calibration_prompts.jsonl",
        "heldout_prompts.jsonl",
        "README.md",
        "train_log.json",
    ):
        assert (PAIR2 / rel).is_file(), rel
    total = sum(p.stat().st_size for p in PAIR2.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, total


def test_dflash2_configs():
    from dflash_quant.models.config import load_draft_config

    cfg = load_draft_config(PAIR2 / "drafter")
    raw = json.loads((PAIR2 / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and cfg.is_dflash2
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert key in raw["dflash_config"] and key not in raw  # release layout: inside dflash_config only
    assert raw["is_causal"] is False and set(raw["layer_types"]) == {"sliding_attention"}
    tcfg = json.loads((PAIR2 / "target" / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert {"linear_attention", "full_attention"} == set(tcfg["layer_types"])
    assert max(cfg.target_layer_ids) < tcfg["num_hidden_layers"] - 1  # llama.cpp cannot tap the last layer
    assert cfg.hidden_size == tcfg["hidden_size"] and cfg.vocab_size == tcfg["vocab_size"]


def test_dflash2_names_and_prompt_sets():
    from dflash_quant.io.source import HUB_ID, resolve
    from dflash_quant.loading.runtime import default_target
    from dflash_quant.prompts import load_prompts
    from dflash_quant.reference import pair_dir

    assert pair_dir("reference-dflash2").resolve() == PAIR2.resolve()
    assert resolve("reference-dflash2").path.resolve() == (PAIR2 / "drafter").resolve()
    assert resolve("reference-dflash2:drafter").path.resolve() == (PAIR2 / "drafter").resolve()
    assert resolve("reference-dflash2:target").path.resolve() == (PAIR2 / "target").resolve()
    assert resolve("reference").path.resolve() == (PAIR / "drafter").resolve()  # the first pair keeps its names
    assert resolve("reference/target").path.resolve() == (PAIR / "target").resolve()
    assert not HUB_ID.match("reference-dflash2:target") and not HUB_ID.match("reference-dflash2")
    assert default_target("reference-dflash2") == "reference-dflash2:target"
    assert default_target("reference") == "reference:target"
    held = load_prompts("reference-dflash2:heldout")
    calib = load_prompts("reference-dflash2:calib")
    assert len(held) == len(_rows2("heldout_prompts.jsonl")) and len(calib) == len(_rows2("calibration_prompts.jsonl"))
    assert {p.split for p in held} == {"heldout"} and not {p.text for p in held} & {p.text for p in calib}


def _rows2(name: str) -> list[dict]:
    return [json.loads(line) for line in (PAIR2 / name).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.slow
def test_dflash2_pair_lossless_and_tau():
    """The shipped DFlash2 pair through the real loop (selector drafting, hybrid target restored and replayed)."""
    from dflash_quant.loading.runtime import default_prompt_spec, encode_prompts, load_pair
    from dflash_quant.models.model2 import DFlash2Drafter
    from dflash_quant.speculative.decode import speculative_generate, target_generate

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    drafter, target = load_pair("reference-dflash2", None, torch.device("cpu"), torch.float32)
    assert isinstance(drafter.model, DFlash2Drafter)
    assert default_prompt_spec(target, "heldout") == "reference-dflash2:heldout"
    prompts = encode_prompts(target, "reference-dflash2:heldout", 8, chat_template=False)
    lengths, replays = [], 0
    for ids in prompts:
        x = torch.tensor([ids])
        spec = speculative_generate(drafter.model, target.model, x, 64, temperature=0.0)
        assert spec.tokens == target_generate(target.model, x, 64).tokens  # lossless
        lengths += spec.acceptance_lengths
        replays += spec.replay_forwards
    assert replays > 0  # partial acceptances happened and the linear-attention state was rolled back
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.0, tau


@pytest.mark.slow
def test_dflash2_training_smoke(tmp_path):
    """`train --pair dflash2 --smoke` runs end to end on CPU and writes a pair the loaders accept."""
    import subprocess
    import sys

    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.target import load_target
    from dflash_quant.models.checks import check_pair
    from dflash_quant.models.model2 import DFlash2Drafter

    out = tmp_path / "pair2"
    cmd = [
        sys.executable,
        "-m",
        "scripts.reference_pair.train",
        "--pair",
        "dflash2",
        "--smoke",
        "--device",
        "cpu",
        "--threads",
        "2",
        "--out",
        str(out),
        "--set",
        "max_docs=30",
        "target_steps=12",
        "target_eval_every=6",
        "target_batch=4",
        "gen_sequences=8",
        "gen_batch=8",
        "gen_new=24",
        "draft_steps=12",
        "draft_batch=4",
        "eval_prompts=2",
        "eval_new_tokens=16",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["recipe"]["pair"] == "dflash2" and log["recipe"]["selector_top_k"] == 8
    assert 1.0 <= log["eval"]["tau"] <= 8.0
    drafter, target = load_drafter(out / "drafter"), load_target(out / "target")
    check_pair(drafter.config, target.model)
    assert isinstance(drafter.model, DFlash2Drafter)
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
