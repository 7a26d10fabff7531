"""DFlash drafter config: one normalized form for the schema drift seen in released drafters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import Qwen3Config

from dflash_quant.errors import DFlashQuantError

# Keys that may sit top-level or inside `dflash_config` (z-lab moved them between releases).
DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids")
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH_ARCH, DFLASH2_ARCH = "DFlashDraftModel", "DFlash2DraftModel"


class DFlashDraftConfig(Qwen3Config):
    """A Qwen3Config carrying the DFlash fields as plain attributes.

    Saved with `dflash_config: {mask_token_id, target_layer_ids}` (plus the DFlash2 keys
    `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` for a DFlash2 drafter) and
    top-level `block_size` / `num_target_layers`, the layout the official loader reads.
    """

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter: conv around each sublayer and a candidate selector on the head's top-k."""
        return getattr(self, "conv_kernel_size", None) is not None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def attention_kind(self, layer_idx: int) -> tuple[bool, int | None]:
        """(is_causal, sliding_window) of one draft layer, as the official drafter decides it."""
        layer_type = self.layer_types[layer_idx] if self.layer_types else "full_attention"
        sliding = layer_type == "sliding_attention"
        explicit = getattr(self, "is_causal", None)
        is_causal = sliding if explicit is None else bool(explicit)
        return is_causal, (self.sliding_window if sliding else None)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's fallback: evenly spaced taps between layer 1 and N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash2_fields(raw: dict[str, Any], nested: dict[str, Any], archs: list[str], source: str) -> dict[str, int]:
    """The four DFlash2 keys (top-level or in `dflash_config`) as validated ints; {} for a v1 drafter."""
    present = {k: nested.get(k, raw.get(k)) for k in DFLASH2_KEYS}
    if not any("DFlash2" in a for a in archs) and all(v is None for v in present.values()):
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


def parse_draft_config(raw: dict[str, Any], source: str = "config") -> DFlashDraftConfig:
    """Normalize a drafter config.json dict; raises DFlashQuantError naming what is missing."""
    raw = dict(raw)
    nested = dict(raw.pop("dflash_config", None) or {})
    archs = raw.get("architectures") or []

    def pick(name: str) -> Any:
        return nested.get(name, raw.get(name))

    v2 = dflash2_fields(raw, nested, archs, source)

    is_dflash = any("DFlash" in a for a in archs) or pick("mask_token_id") is not None
    if not is_dflash:
        raise DFlashQuantError(
            f"{source} is not a DFlash drafter config (no `mask_token_id` top-level or in `dflash_config`, "
            "no DFlash architecture); pass the drafter directory, not the target"
        )
    missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
    if missing:
        raise DFlashQuantError(f"{source} lacks {', '.join(missing)}; the drafter config must define them")
    mask_token_id = pick("mask_token_id")
    if mask_token_id is None:
        raise DFlashQuantError(f"{source} has no `mask_token_id` (top-level or in `dflash_config`)")

    n_layers = int(raw["num_hidden_layers"])
    target_layer_ids = pick("target_layer_ids")
    if target_layer_ids is None:
        n_target = raw.get("num_target_layers")
        if n_target is None:
            raise DFlashQuantError(
                f"{source} has neither `target_layer_ids` nor `num_target_layers`; add one of them"
            )
        target_layer_ids = default_target_layer_ids(int(n_target), n_layers)
    block_size = int(pick("block_size") or 16)

    # rope_theta may be flat (older files) or under rope_parameters (transformers 5).
    if "rope_parameters" not in raw or raw["rope_parameters"] is None:
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
        raw["rope_parameters"] = rope
    raw.pop("rope_theta", None)
    raw.pop("rope_scaling", None)

    layer_types = raw.get("layer_types")
    if layer_types is not None and len(layer_types) != n_layers:
        raise DFlashQuantError(
            f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers; fix the config"
        )
    # Qwen3Config drops sliding_window unless use_sliding_window; a drafter that marks sliding layers means it.
    if layer_types and "sliding_attention" in layer_types and raw.get("sliding_window"):
        raw["use_sliding_window"] = True
    raw.setdefault("head_dim", int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    for key in ("auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "quantization_config"):
        raw.pop(key, None)
    raw.pop("block_size", None)
    raw.pop("mask_token_id", None)
    raw.pop("target_layer_ids", None)
    for key in DFLASH2_KEYS:
        raw.pop(key, None)
    raw["architectures"] = [DFLASH2_ARCH if v2 else DFLASH_ARCH]
    if v2 and int(raw["hidden_size"]) % v2["conv_group_size"]:
        raise DFlashQuantError(
            f"{source}: hidden_size {raw['hidden_size']} is not divisible by conv_group_size "
            f"{v2['conv_group_size']}; fix the config"
        )
    if v2 and raw.get("vocab_size") is not None and v2["selector_top_k"] > int(raw["vocab_size"]):
        raise DFlashQuantError(
            f"{source}: selector_top_k {v2['selector_top_k']} exceeds vocab_size {raw['vocab_size']}; fix the config"
        )

    cfg = DFlashDraftConfig(  # type: ignore[call-arg]  # the config keeps unknown kwargs as attributes; its typed __init__ omits them
        **raw,
        block_size=block_size,
        dflash_config={
            **nested,
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in target_layer_ids],
            **v2,
        },
    )
    cfg.mask_token_id = int(mask_token_id)
    cfg.target_layer_ids = [int(i) for i in target_layer_ids]
    for key, value in v2.items():
        setattr(cfg, key, value)
    if cfg.block_size < 2:
        raise DFlashQuantError(f"{source}: block_size is {cfg.block_size}; a DFlash drafter needs block_size >= 2")
    return cfg


def read_config_json(path: Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise DFlashQuantError(f"{file} not found; point at a drafter directory containing config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashQuantError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from exc


def load_draft_config(src: str | Path | dict[str, Any]) -> DFlashDraftConfig:
    """Parse a drafter config from a dict, a config.json path, or a directory holding one."""
    if isinstance(src, dict):
        return parse_draft_config(src)
    raw = read_config_json(Path(src))
    return parse_draft_config(raw, source=str(src))
