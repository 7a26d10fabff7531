"""DFlash2 drafter: convolution semantics, selector proposals, loading/pairing errors, exact sampling."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import dflash2_raw_config, dflash2_state_dict, save_dflash2_drafter, save_target
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_quant.errors import DFlashQuantError
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.target import load_target
from dflash_quant.models.checks import check_pair
from dflash_quant.models.config import parse_draft_config
from dflash_quant.models.model2 import DFlash2Drafter, grouped_causal_conv
from dflash_quant.speculative.decode import speculative_generate


def test_conv_is_causal_within_the_block_and_resets_per_block():
    torch.manual_seed(0)
    x, dyn, base = torch.randn(1, 6, 8), torch.randn(1, 6, 3, 2), torch.randn(3, 8)
    y = grouped_causal_conv(x, dyn, base, group_size=4)
    # by hand: y[t] = sum_o (base[o] + dyn[t, o, group]) * x[t - o]
    want = torch.zeros_like(x)
    for t in range(6):
        for o in range(3):
            if t - o >= 0:
                want[0, t] += (base[o] + dyn[0, t, o].repeat_interleave(4)) * x[0, t - o]
    torch.testing.assert_close(y, want)
    x2 = x.clone()
    x2[0, 4] += 1.0  # a later row never changes earlier outputs
    assert torch.equal(grouped_causal_conv(x2, dyn, base, 4)[0, :4], y[0, :4])
    # two blocks of 3 laid out along the rows == the blocks convolved separately
    split = grouped_causal_conv(x, dyn, base, 4, block=3)
    torch.testing.assert_close(split[:, :3], grouped_causal_conv(x[:, :3], dyn[:, :3], base, 4))
    torch.testing.assert_close(split[:, 3:], grouped_causal_conv(x[:, 3:], dyn[:, 3:], base, 4))


def test_fresh_drafter_state_dict_layout_and_identity_conv():
    model = DFlash2Drafter(parse_draft_config(dflash2_raw_config()))
    keys = set(model.state_dict())
    assert {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.1.mlp_conv.base_kernel",
        "layers.0.attention_conv.kernel_projection.weight",
    } <= keys
    assert model.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * 4, 64)
    base = model.layers[0].mlp_conv.base_kernel
    assert base.shape == (2, 2, 64) and torch.equal(base[:, 0], torch.ones(2, 64)) and not base[:, 1].any()
    assert "layers.0.attention_conv.kernel_projection" not in model.linear_names()
    assert not any("hidden_projection" in n or "_conv" in n for n in model.linear_names())


@torch.no_grad()
def test_propose_with_temperature_returns_candidate_distribution():
    cfg = parse_draft_config(dflash2_raw_config())
    model = DFlash2Drafter(cfg).eval()
    model.load_state_dict(dflash2_state_dict(cfg, std=0.3))
    head = torch.nn.Linear(64, cfg.vocab_size, bias=False)
    hidden = torch.randn(1, 3, 64)
    gen = torch.Generator().manual_seed(0)
    tokens, (ids, probs) = model.propose(hidden, torch.tensor([7]), head, 0.7, gen)
    assert tokens.shape == (3,) and ids.shape == probs.shape == (3, cfg.selector_top_k)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert all(int(t) in ids[i].tolist() for i, t in enumerate(tokens))  # drafts come from the candidates
    again, _ = model.propose(hidden, torch.tensor([7]), head, 0.7, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)  # reproducible with a seeded generator
    greedy, none = model.propose(hidden, torch.tensor([7]), head, 0.0)
    assert none is None and greedy.shape == (3,)


def test_pairing_checks(tmp_path):
    save_target(tmp_path / "t")
    target = load_target(tmp_path / "t").model
    d = load_drafter(save_dflash2_drafter(tmp_path / "d")).config
    check_pair(d, target)
    other = parse_draft_config(dflash2_raw_config(vocab_size=200))
    with pytest.raises(DFlashQuantError, match="codebooks cover 200 tokens but the target head has 123"):
        check_pair(other, target)
    target.lm_head = None
    target.get_output_embeddings = lambda: None
    with pytest.raises(DFlashQuantError, match="needs a dense target lm_head"):
        check_pair(d, target)


def test_codebook_with_weight_suffix_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_dflash2_drafter(tmp_path / "d")
    state = load_file(str(path / "model.safetensors"))
    state["candidate_selector.successor_codebook.weight"] = state.pop("candidate_selector.successor_codebook")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(DFlashQuantError, match="do not match the DFlash layout"):
        load_drafter(path)


# --- exactness of rejection sampling through the selector ------------------------------------------

VOCAB, PROMPT, TEMP = 6, [0, 1, 2], 1.0


def _micro_pair():
    torch.manual_seed(3)
    tcfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        tie_word_embeddings=False,
        initializer_range=0.5,
    )
    target = Qwen3ForCausalLM(tcfg).eval()
    raw = dflash2_raw_config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=VOCAB,
        block_size=3,
        num_target_layers=1,
        layer_types=["sliding_attention"],
        sliding_window=4,
        dflash_config={
            "mask_token_id": 5,
            "target_layer_ids": [0],
            "conv_kernel_size": 2,
            "conv_group_size": 8,
            "selector_rank": 4,
            "selector_top_k": 3,
        },
    )
    cfg = parse_draft_config(raw)
    drafter = DFlash2Drafter(cfg).eval()
    drafter.load_state_dict(dflash2_state_dict(cfg, seed=4, std=0.6))
    with torch.no_grad():  # a strong selector term, so its conditioning on the predecessor matters
        drafter.candidate_selector.predecessor_codebook.mul_(5)
    return drafter, target


@torch.no_grad()
def _exact_marginal(target) -> torch.Tensor:
    """P(t1, t2) of the target's own sampling, summed over the first token t0: [V, V]."""
    p0 = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1].float() / TEMP, -1)
    seqs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    logits = target(seqs).logits.float() / TEMP
    p1 = torch.softmax(logits[:, -2], -1).view(VOCAB, VOCAB, VOCAB)[:, 0]  # [t0, t1]
    p2 = torch.softmax(logits[:, -1], -1).view(VOCAB, VOCAB, VOCAB)  # [t0, t1, t2]
    return (p0[:, None, None] * p1[:, :, None] * p2).sum(0)


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    big = expected >= 5  # pool the small cells into one
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    return float(((c - e) ** 2 / e).sum()), int(e.numel()) - 1


def _sample_pairs(drafter, target, n: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(VOCAB, VOCAB), []
    ids = torch.tensor([PROMPT])
    for _ in range(n):
        r = speculative_generate(drafter, target, ids, max_new_tokens=3, temperature=TEMP, generator=gen)
        counts[r.tokens[1], r.tokens[2]] += 1
        accepted.append(r.accepted[0])
    return counts.flatten(), accepted


def test_rejection_sampling_with_selector_is_exact():
    """The first speculative step's tokens (t1 from slot 0, t2 from slot 1 or the next step) follow the
    target's own distribution; a proposal that misreports q (the head's softmax instead of the
    selector's) is detected by the same test."""
    drafter, target = _micro_pair()
    expected_p = _exact_marginal(target).flatten()
    n = 800
    counts, accepted = _sample_pairs(drafter, target, n)
    assert set(accepted) == {0, 1, 2}  # rejections, partial and full acceptance all occur
    chi2, dof = _chi2(counts, expected_p * n)
    assert chi2 < _chi2_critical(dof), f"chi2 {chi2:.1f} over {dof} dof: not the target's distribution"

    class Wrong(type(drafter)):
        def propose(self, hidden, anchor_ids, head, temperature, generator=None):
            tokens, (ids, _) = super().propose(hidden, anchor_ids, head, temperature, generator)
            probs = torch.softmax(self.compute_logits(hidden, head)[0].float() / temperature, -1)
            return tokens, (ids, probs.gather(-1, ids))

    drafter.__class__ = Wrong
    n = 300  # the bias is large (chi2 ~1100 with 1500 samples, critical value ~47)
    counts, _ = _sample_pairs(drafter, target, n)
    chi2, dof = _chi2(counts, expected_p * n)
    assert chi2 > _chi2_critical(dof), f"the biased proposal went undetected (chi2 {chi2:.1f})"


def test_memory_and_inspect_name_the_dflash2_parts(tmp_path):
    from dflash_quant.cli.inspect_cmd import describe
    from dflash_quant.memory.kv import parse_shape
    from dflash_quant.memory.weights import count_params, weights_from_files

    path = save_dflash2_drafter(tmp_path / "d")
    model = DFlash2Drafter(parse_draft_config(dflash2_raw_config()))
    pc = count_params(parse_shape(path))
    assert pc.total_params == sum(p.numel() for p in model.parameters())  # config-based count is exact
    conv = sum(p.numel() for n, p in model.named_parameters() if "_conv." in n)
    assert pc.other["dflash2_conv"] == conv
    assert pc.other["dflash2_selector_codebooks"] == 2 * 123 * 8 and pc.other["dflash2_selector_projection"] == 64 * 8
    by_module = weights_from_files(path).by_module
    assert by_module["candidate_selector.predecessor_codebook"] == 123 * 8 * 4 and "layers.1.mlp_conv" in by_module
    info = describe(str(path))
    assert info["config"]["variant"] == "DFlash2" and info["config"]["selector_top_k"] == 4
    assert info["dflash2_parts"]["conv"]["elements"] == conv
    assert info["dflash2_parts"]["selector_codebooks"]["bytes"] == 2 * 123 * 8 * 4
