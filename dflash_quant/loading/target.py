"""Load a target model (dense through transformers, or a packed quantized checkpoint) from a local dir, a
shipped pair or a Hub repo id; its config is checked against its weights first. No remote code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.source import Source, resolve
from dflash_quant.io.weights import confined, tensor_entries, weight_files
from dflash_quant.loading.target_quant import describe, load_quantized_target
from dflash_quant.memory.kv import text_config
from dflash_quant.models.config import read_config_json
from dflash_quant.models.config_check import check_layers_present, check_model_fields
from dflash_quant.models.devmap import check_placement, load_kwargs, pin_offloaded, streamed_bytes


@dataclass
class LoadedTarget:
    model: torch.nn.Module
    tokenizer: Any | None
    source: Source
    quantization: Any = None  # artifact.reports.TargetQuantization
    streamed: dict[str, int] | None = None  # models.devmap.streamed_bytes, taken once the copies are page-locked


def check_target_config(source: Source, raw: dict[str, Any]) -> None:
    """A target's config.json before transformers builds it: counts are positive ints, heads split evenly,
    and the layers it claims are in the weights (a missing layer would otherwise be initialised at random)."""

    file = str(source.path / "config.json")
    cfg = text_config(raw)
    check_model_fields(cfg, file)
    if cfg.get("num_hidden_layers") is not None:
        check_layers_present(cfg["num_hidden_layers"], list(tensor_entries(source.path)), file, exact=False)


def load_target(
    src: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    placement: Any = None,
) -> LoadedTarget:
    """The target on `device`, or split by `placement` (a models.placement.Placement, checked before weights load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; keep the output clean
    hf_logging.set_verbosity_error()
    source = resolve(src, revision)
    raw = read_config_json(confined(source.path, "config.json"))
    if "mask_token_id" in raw or "dflash_config" in raw:
        raise DFlashQuantError(f"{source.id} is a DFlash drafter, not a target; pass the target model with --target")
    weight_files(source.path)  # refuse pickle-only targets before transformers looks
    check_target_config(source, raw)

    method = str((raw.get("quantization_config") or {}).get("quant_method") or "").lower()
    quantization = None
    streamed = None
    if method and placement is not None:
        raise UsageError(
            f"target {source.id} is quantized ({method}) and is loaded packed on one device; drop --device-map/--max-memory"
        )
    if method:
        model, quantization = load_quantized_target(source.path, raw, source.id, dtype, device)
        model.to(device)
        model.eval()
    else:
        place: dict[str, Any] = {}
        if placement is not None:
            check_placement(source.path, placement, dtype, source.id)
            place = load_kwargs(placement)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=dtype, trust_remote_code=False, use_safetensors=True, **place
            )
        except (OSError, ValueError, KeyError) as exc:
            raise DFlashQuantError(
                f"cannot load target {source.id} with transformers ({exc}); it must be a causal LM"
            ) from exc
        if placement is None:
            model.to(device)  # type: ignore[arg-type]  # transformers wraps .to() with @wraps(nn.Module.to): mypy sees it unbound
        else:
            pin_offloaded(model)  # offloaded layers stream onto the GPU at the page-locked copy rate
            streamed = streamed_bytes(model)
        model.eval()
    tokenizer = None
    if any((source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)

    return LoadedTarget(
        model=model, tokenizer=tokenizer, source=source, quantization=describe(model, quantization), streamed=streamed
    )
