"""Speculative decoding on hybrid (linear-attention) targets is exact: qwen3_5 and qwen3_next, fp32, tiny models.

A verify forward pushes the rejected drafts into the Gated-DeltaNet conv/recurrent state, which `crop` cannot
undo; dflash_quant.speculative.target_cache restores and replays. Each test below fails with the old crop-only rollback.
"""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tiny import hybrid_target_config, save_hybrid_target
from transformers import AutoModelForCausalLM

from dflash_quant.calibration.capture import capture
from dflash_quant.errors import DFlashQuantError
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.target import load_target
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.speculative import target_cache
from dflash_quant.speculative.decode import speculative_generate, target_generate

FAMILIES = ["qwen3_5", "qwen3_next"]
# Where the scripted drafter goes wrong, by anchor index: a fixed pseudo-random mix of 0..3.
WRONG_AT = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(0)).tolist()
CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, tiny_pair):
    root = tmp_path_factory.mktemp("hybrid")
    return {fam: save_hybrid_target(root / fam, fam) for fam in FAMILIES}


@pytest.fixture(scope="module")
def drafter(tiny_pair):
    return load_drafter(tiny_pair[0]).model


@pytest.fixture(scope="module")
def targets(hybrid_dirs):
    return {fam: load_target(path).model for fam, path in hybrid_dirs.items()}


def _prompt(seed, n=7):
    return torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def _crop_only(self, saved, ids, length, final=False):
    """The old rollback (and the official transformers loop's): crop K/V, leave the linear-attention state."""
    rejected = saved.length + saved.size - length
    if rejected > 0:
        self._crop(rejected)


def _expected_replays(spec):
    """Every partially accepted step but the last needs one replay of its anchor + accepted drafts."""
    steps = list(zip(spec.accepted, spec.drafted, strict=True))[:-1]
    partial = [a for a, d in steps if a < d]
    return len(partial), sum(a + 1 for a in partial)


class _Scripted(torch.nn.Module):
    """A stand-in drafter that proposes the target's own greedy continuation, wrong from draft `k` on,
    with k = wrong_at(anchor index): acc = k exactly (k >= block - 1 means the whole block is accepted)."""

    def __init__(self, drafter, ref, prompt_len, wrong_at):
        super().__init__()
        self.config, self.ref, self.n, self.wrong_at = drafter.config, ref, prompt_len, wrong_at
        self.block_size, self.mask_token_id, self.target_layer_ids = (
            drafter.block_size,
            drafter.mask_token_id,
            drafter.target_layer_ids,
        )
        self.vocab = 123

    def forward(self, noise, ctx, positions, cache=None):
        q = noise.shape[1]
        first = int(positions[0, -q]) - self.n  # index of the anchor in the continuation
        toks = list(self.ref[first : first + q])
        k = self.wrong_at(first)
        if k + 1 < q:
            toks[k + 1] = (toks[k + 1] + 1) % self.vocab
        return torch.tensor(toks)[None, :, None]

    def compute_logits(self, hidden, head):
        return torch.nn.functional.one_hot(hidden[..., 0], self.vocab).float()

    propose = DFlashDrafter.propose  # the v1 drafting rule over compute_logits (decode calls propose)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_is_lossless_and_replay_is_counted(drafter, targets, family):
    target = targets[family]
    for seed in range(3):
        ids = _prompt(seed)
        ref = target_generate(target, ids, 24).tokens
        spec = speculative_generate(drafter, target, ids, 24)
        assert spec.tokens == ref, f"{family} prompt {seed}"
        assert spec.replay_forwards > 0 and spec.replay_seconds > 0
        assert (spec.replay_forwards, spec.replayed_tokens) == _expected_replays(spec)
        assert spec.target_forwards == len(spec.acceptance_lengths) + 1  # replays are counted apart


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_only_rollback_is_caught(drafter, targets, family, monkeypatch):
    """The bug this module fixes: without restoring the state, greedy output drifts from the target's."""
    target = targets[family]
    monkeypatch.setattr(target_cache.TargetCache, "commit", _crop_only)
    diverged = sum(
        speculative_generate(drafter, target, _prompt(s), 24).tokens != target_generate(target, _prompt(s), 24).tokens
        for s in range(3)
    )
    assert diverged >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_acceptance_is_exact(drafter, targets, family):
    target = targets[family]
    ids = _prompt(11)
    ref = target_generate(target, ids, 60).tokens
    scripted = _Scripted(drafter, ref, ids.shape[1], WRONG_AT.__getitem__)
    spec = speculative_generate(scripted, target, ids, 40)
    assert spec.tokens == ref[:40]
    assert set(spec.accepted[:-1]) == {0, 1, 2, 3}  # full rejection, partial and full acceptance all occur
    assert (spec.replay_forwards, spec.replayed_tokens) == _expected_replays(spec)
    # Same script with the old rollback: wrong.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_cache.TargetCache, "commit", _crop_only)
        assert speculative_generate(scripted, target, ids, 40).tokens != ref[:40]


def test_full_acceptance_needs_no_replay(drafter, targets):
    target = targets["qwen3_5"]
    ids = _prompt(12)
    ref = target_generate(target, ids, 60).tokens
    spec = speculative_generate(_Scripted(drafter, ref, ids.shape[1], lambda a: 3), target, ids, 33)
    assert spec.tokens == ref[:33] and spec.acceptance_lengths == [4] * 8
    assert spec.replay_forwards == spec.replayed_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_mid_block(drafter, targets, family):
    target = targets[family]
    ids = _prompt(13)
    ref = target_generate(target, ids, 60).tokens
    # A stop token whose first occurrence is inside a block (not its first position), after some rollbacks.
    j = next(i for i in range(6, 40) if ref[i] not in ref[:i] and i % 4 not in (0, 1))
    stop = [ref[j]]
    want = target_generate(target, ids, 60, stop_token_ids=stop).tokens
    assert want == ref[: j + 1]
    for wrong_at in (WRONG_AT.__getitem__, lambda a: 3):
        spec = speculative_generate(
            _Scripted(drafter, ref, ids.shape[1], wrong_at), target, ids, 60, stop_token_ids=stop
        )
        assert spec.tokens == want
    assert speculative_generate(drafter, target, ids, 60, stop_token_ids=stop).tokens == want


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_context_taps_equal_a_one_shot_forward(drafter, targets, family):
    """The ctx rows the drafter sees after rollbacks are the target's hidden states of the committed tokens."""
    target = targets[family]
    ids = _prompt(14)
    rows = []
    spec = speculative_generate(drafter, target, ids, 20, on_step=lambda s: rows.append(s["ctx"]))
    ctx = torch.cat(rows, dim=1)
    full = torch.cat([ids[0], torch.tensor(spec.tokens)])[None]
    with torch.no_grad():
        hs = target(full, output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1] for i in drafter.target_layer_ids], dim=-1)[:, : ctx.shape[1]]
    torch.testing.assert_close(ctx, want, atol=1e-4, rtol=1e-4)


def test_calibration_capture_runs_on_a_hybrid_target(drafter, targets):
    target = targets["qwen3_next"]
    prompts = [_prompt(s)[0].tolist() for s in range(2)]
    stats = capture(drafter, target, prompts, 16)
    ctx_rows, block_rows, lengths = 0, 0, []
    for p in prompts:
        spec = speculative_generate(drafter, target, torch.tensor([p]), 16)
        lengths += spec.acceptance_lengths
        ctx_rows += len(p) + sum(
            spec.acceptance_lengths[:-1]
        )  # prompt taps + committed rows of every step but the last
        block_rows += sum(d + 1 for d in spec.drafted)
    assert stats.steps == len(lengths) and stats.mean_tau == pytest.approx(sum(lengths) / len(lengths))
    assert stats.hessians["fc"].rows == ctx_rows
    assert stats.hessians["layers.0.self_attn.qkv"].rows == block_rows


def test_unknown_cache_layer_is_refused_in_one_line(drafter, targets, monkeypatch):
    class OpaqueStateLayer:
        """A cache layer whose state the loop cannot roll back."""

    real = target_cache.make_cache

    def make(config, rollback=True):
        cache = real(config, rollback)
        cache.layers[1] = OpaqueStateLayer()
        return cache

    monkeypatch.setattr(target_cache, "make_cache", make)
    with pytest.raises(DFlashQuantError) as err:
        speculative_generate(drafter, targets["qwen3_5"], _prompt(0), 8)
    msg = str(err.value)
    assert "\n" not in msg and "OpaqueStateLayer" in msg and "qwen3_5_text" in msg and "layer 1" in msg


def _verify_args(tiny_pair, hybrid_dirs, tmp_path):
    prompts = tmp_path / "two_prompts.txt"
    prompts.write_text("w1 w2 w3 w4 w5\nw9 w8 w7 w6\n")
    return [
        "verify",
        str(tiny_pair[0]),
        "--target",
        str(hybrid_dirs["qwen3_5"]),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "32",
    ]


def _check_summary(s):
    assert s["lossless"] is True and all(p["lossless"] for p in s["per_prompt"]) and s["new_tokens"] == 64
    assert s["target_forwards"] == s["steps"] + 2  # one prefill per prompt; replays are counted apart
    assert 0 < s["target_replay_forwards"] <= s["steps"] and s["replayed_tokens"] >= s["target_replay_forwards"]
    assert s["replay_seconds"] > 0


def test_verify_cli_on_a_hybrid_target(tiny_pair, hybrid_dirs, tmp_path):
    from typer.testing import CliRunner

    from dflash_quant.cli.app import app

    args = _verify_args(tiny_pair, hybrid_dirs, tmp_path)
    res = CliRunner().invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.output
    _check_summary(json.loads(res.stdout)["summary"])
    table = CliRunner().invoke(app, args[:-1] + ["8"])
    assert table.exit_code == 0, table.output
    assert "replayed tokens" in table.stdout and "target replay forwards" in table.stdout


@pytest.mark.slow
def test_verify_subprocess_on_a_hybrid_target(tiny_pair, hybrid_dirs, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        CLI + _verify_args(tiny_pair, hybrid_dirs, tmp_path) + ["--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    _check_summary(json.loads(res.stdout)["summary"])


def _chi2_critical_p001(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 0.001 (z = 3.0902)."""
    h = 2 / (9 * dof)
    return dof * (1 - h + 3.0902 * math.sqrt(h)) ** 3


class _FixedDraft(torch.nn.Module):
    """Drafts every position from one fixed distribution q, far from the target's p."""

    def __init__(self, q, block):
        super().__init__()
        self.config = type("Config", (), {"input_embedding_scale": 1.0})()
        self.block_size, self.mask_token_id, self.target_layer_ids = block, 0, [0, 2]
        self.logits = q.log()

    def forward(self, noise, ctx, positions, cache=None):
        return noise.new_zeros(1, noise.shape[1], 1)

    def compute_logits(self, hidden, head):
        return self.logits.expand(*hidden.shape[:2], -1)

    propose = DFlashDrafter.propose


@pytest.mark.slow
def test_rejection_sampling_on_a_hybrid_target_is_exact_in_distribution():
    """Joint law of the first 3 tokens at T=1 equals the target's own (chi-square over a 3-token vocabulary).

    Rejections early in a run make the later tokens depend on the rolled-back state, so a wrong rollback
    shows up as a different joint distribution (checked below with the crop-only rollback).
    """
    vocab, k = 3, 3
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(
        hybrid_target_config(vocab_size=vocab, initializer_range=0.2, eos_token_id=None)
    ).eval()
    prompt = torch.tensor([[1, 0, 1, 1, 0]])
    exact = torch.zeros([vocab] * k)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=k):
            full = torch.cat([prompt, torch.tensor([seq])], dim=1)
            logp = torch.log_softmax(target(full).logits[0, prompt.shape[1] - 1 : -1].float(), -1)
            exact[seq] = float(logp.gather(-1, torch.tensor(seq)[:, None]).sum().exp())
    draft = _FixedDraft(torch.tensor([0.6, 0.3, 0.1]), block=3)

    def chi2(n):
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros([vocab] * k)
        replays = 0
        for _ in range(n):
            run = speculative_generate(draft, target, prompt, k, temperature=1.0, block_size=3, generator=gen)
            counts[tuple(run.tokens)] += 1
            replays += run.replay_forwards
        expected = (exact * n).flatten()
        small = expected < 5  # pool rare outcomes so every cell's expected count is at least 5
        obs = torch.cat([counts.flatten()[~small], counts.flatten()[small].sum()[None]])
        exp = torch.cat([expected[~small], expected[small].sum()[None]])
        return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1, replays

    stat, dof, replays = chi2(800)
    assert replays > 100  # the rollback really ran
    assert stat < _chi2_critical_p001(dof)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_cache.TargetCache, "commit", _crop_only)
        bad, bad_dof, _ = chi2(400)
    assert bad > 2 * _chi2_critical_p001(bad_dof)


def test_sliding_window_target_stays_lossless(drafter):
    """Attention-only targets keep the crop path; sliding windows past their size roll back exactly too."""
    from tiny import target_config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = target_config(
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=5,
        use_sliding_window=True,
        initializer_range=0.1,
    )
    target = Qwen3ForCausalLM(cfg).eval()
    ids = _prompt(15)
    ref = target_generate(target, ids, 30).tokens
    for wrong_at in (WRONG_AT.__getitem__, lambda a: 0):
        spec = speculative_generate(_Scripted(drafter, ref + [0] * 8, ids.shape[1], wrong_at), target, ids, 30)
        assert spec.tokens == ref and spec.replay_forwards == 0
    # The window really matters here: a full-attention twin decodes differently.
    full = Qwen3ForCausalLM(target_config(initializer_range=0.1)).eval()
    full.load_state_dict(target.state_dict())
    assert target_generate(full, ids, 30).tokens != ref


@pytest.mark.parametrize("family", FAMILIES)
def test_random_dflash2_drafter_is_lossless_on_hybrid_targets(tmp_path, targets, family):
    """DFlash2 (convolutions + selector path) on both hybrid families: greedy output == target-only output."""
    from tiny import save_dflash2_drafter

    d2 = load_drafter(save_dflash2_drafter(tmp_path / "d2", std=0.2)).model
    for seed in range(3):
        ids = _prompt(20 + seed)
        ref = target_generate(targets[family], ids, 24)
        spec = speculative_generate(d2, targets[family], ids, 24)
        assert spec.tokens == ref.tokens
        assert spec.drafter_forwards > 0
