"""The DFlash2 drafter: the DFlash backbone plus grouped dynamic causal convolutions and a candidate selector.

Layout and math follow the official `DFlash2DraftModel` (field-notes section 3):

- each decoder layer wraps its attention and its MLP in a `GroupedDynamicCausalConv`: before the sublayer
  the (normed) input is convolved with kernel 0, after it the sublayer output is convolved with kernel 1.
  Both kernels are `base_kernel[j]` (per channel) plus a dynamic part that `kernel_projection` computes
  from the sublayer input, one value per (position, tap, channel group). The convolution is causal over
  the block rows only (zero padding before the block start), so nothing of it is cached.
- `candidate_selector` keeps the target head's top-k tokens per slot and walks the block from the anchor:
  slot i scores its candidates with the head logit plus a rank-r bilinear term between the previous token
  (`predecessor_codebook`), the slot's hidden row (`hidden_projection`) and the candidate
  (`successor_codebook`). Greedy takes the best candidate; with temperature it samples from the softmax
  over the candidates, and that distribution is the proposal rejection sampling must use.

The codebooks are plain Parameters so their state-dict keys carry no `.weight` suffix, as in the release.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_quant.models.config import DFlashDraftConfig
from dflash_quant.models.model import DFlashDecoderLayer, DFlashDrafter


def grouped_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block: int | None = None
) -> torch.Tensor:
    """y[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o], zero before the start of each block.

    x [b, L, H]; dynamic [b, L, K, G] (G = H / group_size, broadcast over a group's channels); base [K, H].
    block: rows per independent block (None = the L rows are one block), e.g. several training blocks
    laid out along L.
    """
    length = x.shape[1]
    row = torch.arange(length, device=x.device) % (block or length)
    dyn = dynamic.repeat_interleave(group_size, dim=-1)  # [b, L, K, H]
    out = torch.zeros_like(x)
    for offset in range(base.shape[0]):
        if offset >= length:
            break
        shifted = F.pad(x[:, : length - offset], (0, 0, offset, 0)) if offset else x
        if block is not None and offset:
            shifted = shifted * (row >= offset).to(x.dtype)[None, :, None]
        out = out + (base[offset].to(x.dtype) + dyn[:, :, offset]) * shifted
    return out


class GroupedDynamicCausalConv(nn.Module):
    """Two grouped dynamic causal depthwise convolutions: `prepare` before a sublayer, `finish` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(convolved input, the dynamic kernel `finish` needs); both kernels come from this input."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        y = grouped_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block)
        return y, dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block: int | None = None) -> torch.Tensor:
        return grouped_causal_conv(x, dynamic, self.base_kernel[1], self.group_size, block)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        h, k, g = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(h, k, g)
        self.mlp_conv = GroupedDynamicCausalConv(h, k, g)
        self.conv_block: int | None = None  # set by DFlash2Drafter.forward

    def forward(self, h, ctx, cos, sin, positions, cache, attention_mask):
        x, kernel = self.attention_conv.prepare(self.input_layernorm(h), self.conv_block)
        x = self.self_attn(x, ctx, cos, sin, positions, cache, attention_mask)
        h = h + self.attention_conv.finish(x, kernel, self.conv_block)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h), self.conv_block)
        return h + self.mlp_conv.finish(self.mlp(x), kernel, self.conv_block)


class CandidateSelector(nn.Module):
    """Picks each slot's token among the target head's top-k, conditioned on the previous slot's token."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        rank, vocab = config.selector_rank, config.vocab_size
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [b, g, H], logits [b, g, V], anchor_ids [b] -> (tokens [b, g], candidates [b, g, k],
        probs [b, g, k] the proposal each token was sampled from, or None at temperature 0)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        proj = self.hidden_projection(hidden)
        successors = F.embedding(candidates, self.successor_codebook)  # [b, g, k, r]
        prev = anchor_ids
        tokens, rows = [], []
        for slot in range(hidden.shape[1]):
            query = F.embedding(prev, self.predecessor_codebook) * proj[:, slot]  # [b, r]
            scores = unary[:, slot] + torch.einsum("br,bkr->bk", query, successors[:, slot])
            if temperature > 0:
                probs = F.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(probs, 1, generator=generator)[:, 0]
                rows.append(probs)
            else:
                index = scores.argmax(-1)
            prev = candidates[:, slot].gather(-1, index[:, None])[:, 0]
            tokens.append(prev)
        return torch.stack(tokens, 1), candidates, torch.stack(rows, 1) if rows else None


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 drafter. Same inputs and outputs as DFlashDrafter; drafting goes through the selector."""

    _no_split_modules = ["DFlash2DecoderLayer"]
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlashDraftConfig):
        if not config.is_dflash2:
            raise ValueError("DFlash2Drafter needs a DFlash2 config (conv_kernel_size, conv_group_size, selector_*)")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, GroupedDynamicCausalConv):
            # identity convolution at init (tap 0 = 1): a fresh DFlash2 drafter starts as its backbone
            with torch.no_grad():
                module.base_kernel.zero_()
                module.base_kernel[:, 0].fill_(1.0)
        elif isinstance(module, CandidateSelector):
            nn.init.normal_(module.predecessor_codebook, std=std)
            nn.init.normal_(module.successor_codebook, std=std)

    def forward(self, *args, conv_block: int | None = None, **kwargs) -> torch.Tensor:
        """As DFlashDrafter.forward; conv_block splits the block rows into independent blocks of that
        many rows for the convolutions (training several blocks in one pass), None = one block."""
        for layer in self.layers:
            cast(DFlash2DecoderLayer, layer).conv_block = conv_block
        return super().forward(*args, **kwargs)

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        head: nn.Module,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Draft tokens through the selector (batch 1): (tokens [g], proposal) where proposal is None at
        temperature 0, else (candidate ids [g, k], their probabilities [g, k])."""
        logits = self.compute_logits(hidden, head)
        anchor = anchor_ids.reshape(1).to(logits.device)
        tokens, candidates, probs = self.candidate_selector.select(hidden, logits, anchor, temperature, generator)
        return tokens[0], None if probs is None else (candidates[0], probs[0])

    def conv_names(self) -> list[str]:
        """The convolution modules (kept bf16 by default)."""
        return [n for n, m in self.named_modules() if isinstance(m, GroupedDynamicCausalConv)]


def build_drafter(config: DFlashDraftConfig) -> DFlashDrafter:
    """The drafter class a config asks for."""
    return DFlash2Drafter(config) if config.is_dflash2 else DFlashDrafter(config)
