"""Checks of a drafter before anything runs: its config against its weights' headers (layer count, Linear shapes),
and the pairing with a target (hidden size, tapped layers, vocabulary, DFlash2's selector head)."""

from __future__ import annotations

from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.weights import Entry
from dflash_quant.models.config import DFlashDraftConfig
from dflash_quant.models.config_check import DraftFields, check_layers_present


def _expected_shapes(f: DraftFields) -> dict[str, tuple[int | None, int | None]]:
    """(out, in) of the Linears whose shapes follow from the config alone."""
    q, kv = f.num_attention_heads * f.head_dim, f.num_key_value_heads * f.head_dim
    h, i = f.hidden_size, f.intermediate_size
    return {
        "fc": (h, len(f.target_layer_ids) * h),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def check_draft_weights(fields: DraftFields, entries: dict[str, Entry], source: str, shapes: bool = True) -> None:
    """The drafter config against its weights' headers, before any model is built: layer count and the
    shapes of fc and the first layer's projections (for a GPTQ artifact, the output width of each qweight)."""
    names = [k[len("model.") :] if k.startswith("model.") else k for k in entries]
    check_layers_present(fields.num_hidden_layers, names, source)
    if not shapes:
        return
    stored = dict(zip(names, (list(e.shape) for e in entries.values()), strict=False))
    for part, (n_out, n_in) in _expected_shapes(fields).items():
        base = part if part == "fc" else f"layers.0.{part}"
        weight, qweight = stored.get(f"{base}.weight"), stored.get(f"{base}.qweight")
        if weight is not None and list(weight) != [n_out, n_in]:
            raise DFlashQuantError(
                f"{source}: {base}.weight is {list(weight)} but config.json implies "
                f"[{n_out}, {n_in}]; fix the config or re-download the weights"
            )
        if qweight is not None and (len(qweight) != 2 or qweight[1] != n_out):
            raise DFlashQuantError(
                f"{source}: {base}.qweight is {list(qweight)} but config.json implies "
                f"{n_out} outputs; fix the config or re-export the artifact"
            )


def check_pair(config: DFlashDraftConfig, target: torch.nn.Module) -> None:
    """Raise DFlashQuantError (one line) if the drafter cannot run on this target."""
    tcfg: Any = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config  # type: ignore[operator]
    t_hidden, t_layers = int(tcfg.hidden_size), int(tcfg.num_hidden_layers)
    t_vocab = int(target.get_input_embeddings().weight.shape[0])  # type: ignore[operator]  # nn.Module.__getattr__ types transformers' methods as Tensor | Module
    fc_in, want = config.num_taps * config.hidden_size, config.num_taps * t_hidden
    if config.hidden_size != t_hidden:
        raise DFlashQuantError(
            f"drafter fc takes {fc_in} features but {config.num_taps} taps x target hidden {t_hidden} = {want} "
            f"(drafter hidden {config.hidden_size}); pair the drafter with the target it was trained for"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise DFlashQuantError(
            f"drafter taps target layers {bad} but the target has {t_layers} layers; pair it with its own target"
        )
    if not 0 <= config.mask_token_id < t_vocab:
        raise DFlashQuantError(
            f"mask_token_id {config.mask_token_id} is outside the target vocabulary ({t_vocab}); wrong target"
        )
    if config.block_size < 2:
        raise DFlashQuantError(f"block_size {config.block_size} < 2; a drafter must propose at least one token")
    if config.is_dflash2:
        check_selector_head(config, target)


def check_selector_head(config: DFlashDraftConfig, target: torch.nn.Module) -> None:
    """DFlash2's selector takes the top-k of a dense target head and indexes its codebooks by token id."""
    head = target.get_output_embeddings()  # type: ignore[operator]  # nn.Module.__getattr__ types transformers' methods as Tensor | Module
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not callable(head):
        raise DFlashQuantError(
            "the DFlash2 candidate selector needs a dense target lm_head (get_output_embeddings() with a 2-D weight); "
            "this target has none"
        )
    head_vocab = int(weight.shape[0])
    if int(config.vocab_size) != head_vocab:
        raise DFlashQuantError(
            f"DFlash2 selector codebooks cover {config.vocab_size} tokens but the target head has {head_vocab}; "
            "pair the drafter with the target it was trained for"
        )
    if config.selector_top_k > head_vocab:
        raise DFlashQuantError(
            f"selector_top_k {config.selector_top_k} exceeds the target vocabulary ({head_vocab}); fix the config"
        )
