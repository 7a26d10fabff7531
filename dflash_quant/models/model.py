"""The DFlash (v1) block drafter: a few pre-norm Qwen3 layers whose keys/values also see target features.

Layout and math follow the official drafter (field-notes section 1): state-dict keys without a `model.`
prefix, `fc` + `hidden_norm` over the concatenated target taps, per-head q/k RMSNorm, GQA, RoPE over
context-then-block positions, non-causal attention inside the block unless the layer is causal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash_quant.models.config import DFlashDraftConfig


@dataclass
class DraftCache:
    """Context K/V per layer (after k_norm and RoPE) and their positions.

    Only context rows are kept: block rows are recomputed every step, so nothing needs cropping.
    Sliding-window layers keep just the rows a future query can still see.
    """

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    positions: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0  # context rows appended so far (absolute)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if layer not in self.keys:
            return None
        return self.keys[layer], self.values[layer], self.positions[layer]

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None) -> None:
        if window is not None and k.shape[-2] > window - 1:
            k, v, pos = k[..., -(window - 1) :, :], v[..., -(window - 1) :, :], pos[-(window - 1) :]
        self.keys[layer], self.values[layer], self.positions[layer] = k, v, pos

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def visibility_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool, window: int | None
) -> torch.Tensor | None:
    """Boolean [q, k] mask (True = visible) from absolute positions; None means all visible."""
    if not is_causal and window is None:
        return None
    q, k = q_pos[:, None], k_pos[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q_pos.device)
    if is_causal:
        visible &= k <= q
    if window is not None:
        visible &= (q - k) < window
        if not is_causal:
            visible &= (k - q) < window
    return visible


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads or self.n_heads  # typed Optional; Qwen3Config defaults it the same way
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.is_causal, self.sliding_window = config.attention_kind(layer_idx)
        # q|k|v held as one Linear: called (h, cat(ctx, h)), returns (q, k|v) (int4_linear.Int4QKV, set by the
        # int4 drafter's fusion: one kernel launch a step instead of two)
        self.qkv_proj: nn.Module | None = None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim).transpose(1, 2)  # [b, n, t, d]

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        attention_mask: torch.Tensor | dict[tuple[bool, int | None], torch.Tensor] | None,
    ) -> torch.Tensor:
        q_len, c_len = h.shape[1], ctx.shape[1]
        if isinstance(attention_mask, dict):  # one mask per layer kind (batched decoding: per-row masks)
            attention_mask = attention_mask[(self.is_causal, self.sliding_window)]
        kv_in = torch.cat([ctx, h], dim=1)
        if self.qkv_proj is None:
            q_lin, k_lin, v_lin = self.q_proj(h), self.k_proj(kv_in), self.v_proj(kv_in)
        else:
            q_lin, kv_lin = self.qkv_proj(h, kv_in)
            k_lin, v_lin = kv_lin.split(self.n_kv * self.head_dim, dim=-1)
        q = self.q_norm(self._heads(q_lin, self.n_heads))
        k = self.k_norm(self._heads(k_lin, self.n_kv))
        v = self._heads(v_lin, self.n_kv)
        q = _rope(q, cos[:, None, -q_len:], sin[:, None, -q_len:])
        k = _rope(k, cos[:, None], sin[:, None])
        k_pos = positions
        if cache is not None:
            past = cache.get(self.layer_idx)
            if past is not None:
                k = torch.cat([past[0], k], dim=2)
                v = torch.cat([past[1], v], dim=2)
                k_pos = torch.cat([past[2], positions])
            n_ctx = k.shape[2] - q_len
            cache.put(self.layer_idx, k[:, :, :n_ctx], v[:, :, :n_ctx], k_pos[:n_ctx], self.sliding_window)
        if attention_mask is None:
            attention_mask = visibility_mask(positions[c_len:], k_pos, self.is_causal, self.sliding_window)
        gqa = self.n_kv != self.n_heads
        if gqa and q.device.type == "cuda":
            # CUDA's memory-efficient kernel takes a mask but not GQA; math takes both at ~3.6x its time per call
            # (benchmarks/bench_sdpa.py), so the key/value heads are repeated as the target's attention does.
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(h.shape[0], q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, positions, cache, attention_mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, positions, cache, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(PreTrainedModel):
    """DFlash v1 drafter. Uses the target's embedding (for block inputs) and head (for logits)."""

    config_class = DFlashDraftConfig
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    layer_class = DFlashDecoderLayer

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | dict[tuple[bool, int | None], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Post-norm hidden states of the block rows.

        noise_embedding [b, q, H]: target embeddings of [anchor, MASK, ...]; target_hidden [b, c, taps*H]:
        raw target taps of the new context rows; position_ids [b, c+q]: context positions then block
        positions. attention_mask (bool [b|1, 1, q, keys], True = visible) overrides the built-in mask,
        e.g. to train many blocks in one pass; a dict gives one mask per layer kind (is_causal, window).
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        h = noise_embedding
        cos, sin = self.rotary_emb(h, position_ids)
        positions = position_ids[0]
        for layer in self.layers:
            h = layer(h, ctx, cos.to(h.dtype), sin.to(h.dtype), positions, cache, attention_mask)
        if cache is not None:
            cache.length += ctx.shape[1]
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        # the target's head may sit on another device of a split target: its logits come back to the drafter's
        logits = head(hidden).to(hidden.device) * float(getattr(self.config, "output_multiplier", 1.0) or 1.0)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        head: nn.Module,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
        """Draft tokens for one block from the drafter's hidden rows [1, g, H] (batch 1).

        Returns (tokens [g], proposal): proposal is None at temperature 0, else the distribution the
        tokens were sampled from, [g, V] over the vocabulary (what rejection sampling needs).
        anchor_ids is unused here (DFlash2's selector conditions on it).
        """
        logits = self.compute_logits(hidden, head)[0]
        if temperature <= 0:
            return logits.argmax(-1), None
        probs = F.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs

    def linear_names(self) -> list[str]:
        """Every quantizable backbone Linear (attention, MLP), in execution order (fc first)."""
        return ["fc"] + [
            n
            for n, m in self.layers.named_modules(prefix="layers")
            if isinstance(m, nn.Linear) and n.split(".")[2] in ("self_attn", "mlp")
        ]

    def other_linear_names(self) -> list[str]:
        """Linears outside the quantizable backbone (DFlash2's conv and selector projections); kept bf16."""
        backbone = set(self.linear_names())
        return [n for n, m in self.named_modules() if isinstance(m, nn.Linear) and n not in backbone]
