"""DFlash drafter config: one normalized form for the schema drift seen in released drafters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import Qwen3Config

from dflash_quant.errors import DFlashQuantError
from dflash_quant.models.config_check import (  # noqa: F401  (re-exported: one config model for the drafter)
    DFLASH2_KEYS,
    DFLASH_KEYS,
    REQUIRED_KEYS,
    default_target_layer_ids,
    draft_fields,
    require_object,
)

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


def parse_draft_config(raw: dict[str, Any], source: str = "config") -> DFlashDraftConfig:
    """Normalize a drafter config.json dict; raises DFlashQuantError naming what is missing or malformed.

    The numbers are checked by config_check.draft_fields first (types, ranges, divisibility); callers that have
    the weights check the layer count against them before this builds anything (loading.read_draft_config).
    """
    fields = draft_fields(raw, source)
    raw = dict(raw)
    nested = dict(raw.pop("dflash_config", None) or {})
    v2 = fields.dflash2

    # rope_theta may be flat (older files) or under rope_parameters (transformers 5).
    if "rope_parameters" not in raw or raw["rope_parameters"] is None:
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
        raw["rope_parameters"] = rope
    raw.pop("rope_theta", None)
    raw.pop("rope_scaling", None)

    layer_types = raw.get("layer_types")
    # Qwen3Config drops sliding_window unless use_sliding_window; a drafter that marks sliding layers means it.
    if layer_types and "sliding_attention" in layer_types and raw.get("sliding_window"):
        raw["use_sliding_window"] = True
    raw.setdefault("head_dim", fields.head_dim)
    for key in ("auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "quantization_config"):
        raw.pop(key, None)
    for key in (*DFLASH_KEYS, *DFLASH2_KEYS):
        raw.pop(key, None)
    raw["architectures"] = [DFLASH2_ARCH if v2 else DFLASH_ARCH]

    cfg = DFlashDraftConfig(  # type: ignore[call-arg]  # the config keeps unknown kwargs as attributes; its typed __init__ omits them
        **raw,
        block_size=fields.block_size,
        dflash_config={
            **nested,
            "mask_token_id": fields.mask_token_id,
            "target_layer_ids": fields.target_layer_ids,
            **v2,
        },
    )
    cfg.mask_token_id = fields.mask_token_id
    cfg.target_layer_ids = list(fields.target_layer_ids)
    for key, value in v2.items():
        setattr(cfg, key, value)
    return cfg


def read_config_json(path: Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise DFlashQuantError(f"{file} not found; point at a drafter directory containing config.json")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DFlashQuantError(f"{file} is not UTF-8 text (byte {exc.start}); fix or re-download it") from exc
    except json.JSONDecodeError as exc:
        raise DFlashQuantError(
            f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it"
        ) from exc
    return require_object(data, str(file))


def load_draft_config(src: str | Path | dict[str, Any]) -> DFlashDraftConfig:
    """Parse a drafter config from a dict, a config.json path, or a directory holding one."""
    if isinstance(src, dict):
        return parse_draft_config(src)
    raw = read_config_json(Path(src))
    return parse_draft_config(raw, source=str(src))
