"""What a serving engine adds around a model's weights and caches, shared by the budget (memory.budget) and the
MTP comparison (memory.mtp): vLLM's KV-cache groups and their padding layers, one layer's activation peak, and
block rounding."""

from __future__ import annotations

from typing import Protocol

from dflash_quant.memory.hybrid import hybrid_layout
from dflash_quant.memory.kv import FULL, LINEAR, MAMBA, SLIDING, ModelShape, dtype_bytes, recurrent_state_bytes


class KvSettings(Protocol):
    """The serving settings the padding layers depend on (memory.budget.BudgetSettings has them)."""

    @property
    def engine(self) -> str: ...
    @property
    def kv_dtype(self) -> str | None: ...
    @property
    def state_dtype(self) -> str | None: ...
    @property
    def prefix_caching(self) -> bool: ...


ACT_BYTES = 2  # bf16 activations


LOGITS_COPIES = 3  # fp32 logits, probabilities, one sampler temporary


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block if n > 0 else 0


def layer_peak(shape: ModelShape, tokens: int, a: int = ACT_BYTES) -> int:
    """Largest transient of one target layer on `tokens` rows in a fused serving engine (bytes)."""
    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_attention_heads * shape.head_dim * (2 if shape.attn_output_gate else 1)
    kvd = shape.num_kv_heads * shape.head_dim
    attn = tokens * (q + 2 * kvd + shape.num_attention_heads * shape.head_dim) * a
    mlp_i = shape.moe_intermediate_size * 8 if shape.num_experts else i  # routed tokens, top-8 order of magnitude
    mlp = tokens * 3 * mlp_i * a  # fused gate_up (2I) + activation output (I)
    lin = 0
    r = shape.recurrent
    if r is not None:
        vd = r.v_heads * r.v_dim
        lin = tokens * (r.conv_dim + vd + 2 * r.v_heads + r.conv_dim + 2 * vd) * a
    return max(attn, mlp, lin) + 2 * tokens * h * a  # + residual stream (hidden, residual)


# ----------------------------------------------------------------------------- vLLM KV-cache grouping


def vllm_group_size(counts: list[int]) -> int:
    """vLLM's group size for buckets of these layer counts (`_get_kv_cache_groups_uniform_page_size`)."""
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * 1.5 else smallest


def padding_layers(counts: dict[tuple, int]) -> dict[tuple, int]:
    """Padding layers vLLM adds to each bucket: the last group of every bucket is filled to the group size."""
    if len(counts) <= 1:
        return {k: 0 for k in counts}  # one spec: a single group, no padding
    size = vllm_group_size(list(counts.values()))
    return {k: -n % size for k, n in counts.items()}


def kv_buckets(target: ModelShape, draft_layers: list[tuple]) -> dict[tuple, int]:
    """Layer counts per KV spec: (kind, kv_heads, head_dim, window). vLLM buckets by spec equality, so a drafter
    layer joins the target's bucket only with the same heads and head_dim (an MTP layer always does)."""
    out: dict[tuple, int] = {}
    for kind in target.layer_types:
        key: tuple
        if kind in (LINEAR, MAMBA):
            key = ("state",)
        elif kind == SLIDING:
            key = (SLIDING, target.num_kv_heads, target.head_dim, target.sliding_window)
        elif kind == FULL:
            key = (FULL, target.num_kv_heads, target.head_dim, None)
        else:
            continue  # MLP-only layers hold no cache
        out[key] = out.get(key, 0) + 1
    for key in draft_layers:
        out[key] = out.get(key, 0) + 1
    return out


def drafter_layer_keys(drafter: ModelShape) -> list[tuple]:
    keys = []
    for kind in drafter.layer_types:
        if kind == SLIDING:
            keys.append((SLIDING, drafter.num_kv_heads, drafter.head_dim, drafter.sliding_window))
        else:
            keys.append((FULL, drafter.num_kv_heads, drafter.head_dim, None))
    return keys


def padding_bytes(target: ModelShape, buckets: dict[tuple, int], s: KvSettings, tokens: int, k: int) -> int:
    """Per-request bytes of the padding layers: each costs what one real layer of its bucket costs."""
    pads = padding_layers(buckets)
    b_kv = dtype_bytes(s.kv_dtype or target.dtype, what="KV dtype")
    total = 0
    r = target.recurrent
    lay = None
    if r is not None and s.engine == "vllm":  # the hybrid pool's pages and blocks (memory/hybrid.py)
        lay = hybrid_layout(target, kv_dtype=s.kv_dtype, state_dtype=s.state_dtype, spec_tokens=k,
                            prefix_caching=s.prefix_caching)  # fmt: skip
        tokens = round_up(tokens, lay.block_tokens)
    for key, n in pads.items():
        if not n:
            continue
        if key == ("state",):
            assert r is not None  # a state bucket exists only for a target with recurrent layers
            if lay is not None:
                per_layer = lay.state_bytes_per_layer
            else:
                per_layer = recurrent_state_bytes(target, k, ssm_dtype=s.state_dtype) // r.num_layers
        else:
            _, heads, hd, window = key
            held = min(tokens, window) if window else tokens
            per_layer = 2 * heads * hd * b_kv * held
        total += n * per_layer
    return total
