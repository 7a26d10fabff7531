"""How vLLM lays out the cache pool of a hybrid (attention + Gated DeltaNet / Mamba) target with a drafter.

vLLM keeps attention KV and recurrent state in one pool of equal-sized pages (its "hybrid KV cache
manager"); three consequences change the bytes a request takes, beyond KV-per-token x tokens:

1. Block size. The attention block is made large enough that one attention page holds one layer's state:
   ``block = 16 * ceil(state_page / (16 * attn_bytes_per_token_per_layer))`` and the state page is padded up
   to ``block * attn_bytes_per_token_per_layer`` (vllm/model_executor/models/config.py,
   HybridAttentionMambaModelConfig.verify_and_update_config; logged as "Setting attention block size to 784
   tokens to ensure that attention page size is >= mamba page size" for Qwen3.6-27B at K=0, which this
   formula reproduces). The context is then rounded up to whole blocks of that size.
2. State slots. ``MambaSpec.max_memory_usage_bytes`` (vllm/v1/kv_cache_interface.py) keeps
   ``1 + num_speculative_blocks`` state pages per request with ``mamba_cache_mode="none"`` and
   ``2 + num_speculative_blocks`` in ``"align"`` mode; num_speculative_blocks is num_speculative_tokens (K).
   vLLM turned prefix caching on by default for hybrid models in ``align`` mode (vllm PR #50991, merged
   2026-08-04), so the default is 2 + K; ``--no-enable-prefix-caching`` gives 1 + K.
Group padding (vLLM pads each bucket of layers to whole cache groups) is priced by memory/mtp.py
(`kv_buckets`, `padding_bytes`) and shows as its own `kv_group_padding` term.

The state dtypes: conv state in the model dtype, the recurrent (ssm) state in ``mamba_ssm_cache_dtype``,
which vLLM takes from the HF config's ``mamba_ssm_dtype`` (float32 for Qwen3.5) unless
``--mamba-ssm-cache-dtype`` overrides it (vllm PR #34489).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_quant.memory.kv import ModelShape, dtype_bytes

BLOCK_ALIGN = 16  # vLLM rounds the hybrid attention block to a multiple of 16 tokens (attention kernels)


@dataclass(frozen=True)
class HybridLayout:
    block_tokens: int  # attention tokens per block (one page per layer)
    state_slots: int  # state pages per request and linear layer (1 or 2, + K)
    state_page_bytes: int  # one linear layer's state page, padded to the attention page

    @property
    def state_bytes_per_layer(self) -> int:
        return self.state_slots * self.state_page_bytes


def state_page_bytes(shape: ModelShape, spec_tokens: int, ssm_dtype: str | None) -> int:
    """One linear layer's conv + recurrent state for one slot (conv widened by K rows while speculating)."""
    r = shape.recurrent
    assert r is not None
    b_conv = dtype_bytes(shape.dtype, what="conv state dtype")
    b_ssm = dtype_bytes(ssm_dtype or r.ssm_dtype or shape.dtype, what="state dtype")
    return (r.conv_kernel - 1 + spec_tokens) * r.conv_dim * b_conv + r.state_elems * b_ssm


def hybrid_layout(
    target: ModelShape,
    *,
    kv_dtype: str | None,
    state_dtype: str | None,
    spec_tokens: int,
    prefix_caching: bool,
) -> HybridLayout:
    assert target.recurrent is not None
    attn_tok = 2 * target.num_kv_heads * target.head_dim * dtype_bytes(kv_dtype or target.dtype, what="KV dtype")
    raw = state_page_bytes(target, spec_tokens, state_dtype)
    block = BLOCK_ALIGN * -(-raw // (BLOCK_ALIGN * attn_tok))
    return HybridLayout(
        block_tokens=block,
        state_slots=(2 if prefix_caching else 1) + spec_tokens,
        state_page_bytes=block * attn_tok,
    )
