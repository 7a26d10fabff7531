"""Type and range checks of model configs, without transformers (so `budget` stays instant).

`draft_fields` is the one reading of a DFlash drafter config's numbers: `config.parse_draft_config` builds the
Qwen3Config from it, `memory.kv.parse_shape` budgets from it. `check_model_fields` checks a target's (or any
transformers) config. `check_layers_present` compares a config with the safetensors headers before anything is
allocated, so a config claiming 10^9 layers is refused at once instead of building them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dflash_quant.errors import DFlashQuantError

DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids")
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Fields of a transformers config that are counts or sizes: when present they must be positive integers.
MODEL_INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
_LAYER_KEY = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


def require_object(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise DFlashQuantError(
            f"{source} holds a JSON {type(data).__name__}, not an object; it must be a "
            "transformers config.json (re-download it)"
        )
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any, key: str, source: str, minimum: int = 1) -> int:
    """value as an int >= minimum; a string, float, bool or small value is named with the fix."""
    if not _is_int(value):
        raise DFlashQuantError(
            f"{source}: {key} is {value!r} ({type(value).__name__}); it must be an integer >= {minimum}; fix the config"
        )
    if value < minimum:
        raise DFlashQuantError(f"{source}: {key} is {value}; it must be >= {minimum}; fix the config")
    return value


def check_model_fields(cfg: dict[str, Any], source: str) -> None:
    """Every count/size field present is a positive int, and the attention heads split evenly."""
    for key in MODEL_INT_KEYS:
        if cfg.get(key) is not None:
            positive_int(cfg[key], key, source)
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise DFlashQuantError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; fix the config"
        )
    if (
        heads is not None
        and cfg.get("head_dim") is None
        and cfg.get("hidden_size") is not None
        and cfg["hidden_size"] % heads
    ):
        raise DFlashQuantError(
            f"{source}: hidden_size {cfg['hidden_size']} is not divisible by num_attention_heads "
            f"{heads} and no head_dim is given; fix the config"
        )


@dataclass(frozen=True)
class DraftFields:
    """The numbers of a DFlash (or DFlash2) drafter config, type- and range-checked."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None  # None only for a shape-only (budget) config
    vocab_size: int | None
    block_size: int
    mask_token_id: int | None  # None only for a shape-only (budget) config
    target_layer_ids: list[int]  # [] only for a shape-only config without taps
    dflash2: dict[str, int] = field(default_factory=dict)  # the DFlash2 keys; {} for a v1 drafter


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's fallback: evenly spaced taps between layer 1 and N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _dflash2(raw: dict[str, Any], nested: dict[str, Any], archs: list[str], source: str) -> dict[str, int]:
    present = {k: nested.get(k, raw.get(k)) for k in DFLASH2_KEYS}
    if not any("DFlash2" in str(a) for a in archs) and all(v is None for v in present.values()):
        return {}
    missing = [k for k, v in present.items() if v is None]
    if missing:
        raise DFlashQuantError(
            f"{source} is a DFlash2 drafter but lacks {', '.join(missing)} (top-level or in `dflash_config`); add them"
        )
    out = {}
    for key, value in present.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashQuantError(f"{source}: {key} is {value!r}; it must be a positive integer")
        out[key] = value
    return out


def draft_fields(raw: dict[str, Any], source: str = "config", shape_only: bool = False) -> DraftFields:
    """Check a drafter config.json dict; raises DFlashQuantError (one line, with the fix) on the first problem.

    shape_only (the memory budget): the attention/cache numbers are checked the same way, but a config that
    only describes the shapes (no mask_token_id, intermediate_size or taps) is accepted."""
    require_object(raw, source)
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise DFlashQuantError(f"{source}: dflash_config is a {type(nested).__name__}; it must be an object")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise DFlashQuantError(f"{source}: architectures must be a list of names; fix the config")

    def pick(name: str) -> Any:
        return nested.get(name, raw.get(name))

    v2 = _dflash2(raw, nested, archs, source)
    if not shape_only and not (any("DFlash" in str(a) for a in archs) or pick("mask_token_id") is not None):
        raise DFlashQuantError(
            f"{source} is not a DFlash drafter config (no `mask_token_id` top-level or in `dflash_config`, "
            "no DFlash architecture); pass the drafter directory, not the target"
        )
    needed = REQUIRED_KEYS[:3] if shape_only else REQUIRED_KEYS
    missing = [k for k in needed if raw.get(k) is None]
    if missing:
        raise DFlashQuantError(f"{source} lacks {', '.join(missing)}; the drafter config must define them")
    if pick("mask_token_id") is None and not shape_only:
        raise DFlashQuantError(f"{source} has no `mask_token_id` (top-level or in `dflash_config`)")
    check_model_fields(raw, source)
    hidden, layers = raw["hidden_size"], raw["num_hidden_layers"]
    heads = raw["num_attention_heads"]
    kv = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    mask = (
        None
        if pick("mask_token_id") is None
        else positive_int(pick("mask_token_id"), "mask_token_id", source, minimum=0)
    )
    # Absent block_size means the official default 16; present, it must be a real block (never silently 16).
    block = 16 if pick("block_size") is None else positive_int(pick("block_size"), "block_size", source, minimum=2)
    taps = pick("target_layer_ids")
    if taps is None:
        n_target = raw.get("num_target_layers")
        if n_target is None and not shape_only:
            raise DFlashQuantError(f"{source} has neither `target_layer_ids` nor `num_target_layers`; add one of them")
        taps = (
            []
            if n_target is None
            else default_target_layer_ids(positive_int(n_target, "num_target_layers", source), layers)
        )
    if not isinstance(taps, list) or not (taps or shape_only) or not all(_is_int(t) and t >= 0 for t in taps):
        raise DFlashQuantError(
            f"{source}: target_layer_ids is {taps!r}; it must be a non-empty list of layer "
            "indices (integers >= 0); fix the config"
        )
    if v2 and hidden % v2["conv_group_size"]:
        raise DFlashQuantError(
            f"{source}: hidden_size {hidden} is not divisible by conv_group_size {v2['conv_group_size']}; fix the config"
        )
    vocab = raw.get("vocab_size")
    if v2 and vocab is not None and v2["selector_top_k"] > vocab:
        raise DFlashQuantError(
            f"{source}: selector_top_k {v2['selector_top_k']} exceeds vocab_size {vocab}; fix the config"
        )
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers):
        n = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        raise DFlashQuantError(f"{source}: layer_types has {n} entries for {layers} layers; fix the config")
    return DraftFields(
        hidden, layers, heads, kv, head_dim, raw.get("intermediate_size"), vocab, block, mask, list(taps), v2
    )


def layers_in_headers(names: list[str]) -> int | None:
    """1 + the largest `layers.N` index among tensor names (None when no name has one)."""
    found = [int(m.group(1)) for n in names if (m := _LAYER_KEY.match(n))]
    return max(found) + 1 if found else None


def check_layers_present(configured: int, names: list[str], source: str, exact: bool = True) -> None:
    """The config's layer count against the weights (headers only): refuse before building a model."""
    present = layers_in_headers(names)
    if present is None:
        return
    if present < configured or (exact and present != configured):
        raise DFlashQuantError(
            f"{source}: config.json says num_hidden_layers {configured} but the weights hold "
            f"{present} layers; fix the config or re-download the model"
        )
