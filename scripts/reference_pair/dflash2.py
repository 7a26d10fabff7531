"""The parts of the reference training recipe that belong to the second pair: a hybrid target and a DFlash2
drafter with its candidate selector (used by scripts/reference_pair/train.py with ``--pair dflash2``).

Target: ``Qwen3_5ForCausalLM`` (text only) whose ``layer_types`` mix Gated DeltaNet linear-attention layers
with full-attention layers, trained exactly like the first pair's Qwen3 target.

Selector loss, on top of the DFlash loss: for every scored block slot the candidates are the top-k of the
drafter's logits through the target head (as at inference); their scores are the official ones (logit +
rank-r bilinear term predecessor x slot hidden x candidate), with the TRUE previous token as predecessor
(teacher forcing: while the walk is still correct its predecessor is the true token, and acceptance
ends at the first wrong slot). Cross-entropy of those scores against the target's next token, where that
token is among the candidates; slots where it is not are left out. Same position weights as the DFlash loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hybrid_target_config(r, eos_id: int):
    """A Qwen3_5TextConfig (transformers >= 5.2) from the recipe's target fields."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=r.vocab_size,
        hidden_size=r.hidden,
        intermediate_size=r.target_intermediate,
        num_hidden_layers=len(r.target_layer_types),
        layer_types=list(r.target_layer_types),
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        head_dim=r.head_dim,
        linear_num_key_heads=r.linear_key_heads,
        linear_key_head_dim=r.head_dim,
        linear_num_value_heads=r.linear_value_heads,
        linear_value_head_dim=r.head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=r.max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": r.rope_theta, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def target_class(r):
    if r.target_layer_types:
        from transformers import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def drafter_extra_config(r) -> tuple[dict, dict]:
    """(top-level, dflash_config) additions for a DFlash2 drafter: the release's layout (all layers
    sliding-window, bidirectional inside the block) and the conv / selector sizes."""
    top = {
        "architectures": ["DFlash2DraftModel"],
        "layer_types": ["sliding_attention"] * r.draft_layers,
        "sliding_window": r.draft_window,
        "use_sliding_window": True,
        "is_causal": False,
    }
    nested = {
        "conv_kernel_size": r.conv_kernel_size,
        "conv_group_size": r.conv_group_size,
        "selector_rank": r.selector_rank,
        "selector_top_k": r.selector_top_k,
    }
    return top, nested


def selector_scores(selector, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor):
    """Teacher-forced selector scores: (scores [..., k], candidates [..., k]).

    hidden [..., H] and logits [..., V] of the scored slots; prev [...]: each slot's predecessor token.
    """
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    query = F.embedding(prev, selector.predecessor_codebook) * selector.hidden_projection(hidden)
    successors = F.embedding(candidates, selector.successor_codebook)
    scores = unary + torch.einsum("...r,...kr->...k", query.float(), successors.float())
    return scores, candidates


def selector_loss(selector, hidden, logits, anchors_tok, labels, weights):
    """(weighted selector cross-entropy, selected == label per slot) for blocks laid out as [b, A, B-1].

    anchors_tok [b, A]: each block's first token; labels [b, A, B-1]; weights [b, A, B-1] (0 = unscored).
    """
    prev = torch.cat([anchors_tok[..., None], labels[..., :-1]], dim=-1)
    scores, candidates = selector_scores(selector, hidden, logits, prev)
    hit = candidates == labels[..., None]
    found = hit.any(-1)
    ce = F.cross_entropy(scores.flatten(0, -2), hit.float().argmax(-1).flatten(), reduction="none")
    w = weights * found
    loss = (ce.view_as(w) * w).sum() / weights.sum().clamp_min(1e-9)
    chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return loss, chosen == labels


@torch.no_grad()
def select_blocks(drafter, hidden: torch.Tensor, logits: torch.Tensor, anchors_tok: torch.Tensor) -> torch.Tensor:
    """The selector's greedy walk (as in decoding) for many blocks at once: hidden [A, g, H],
    logits [A, g, V], anchors_tok [A] -> tokens [A, g]."""
    tokens, _, _ = drafter.candidate_selector.select(hidden, logits, anchors_tok, 0.0)
    return tokens
