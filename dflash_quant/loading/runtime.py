"""Device/dtype choice, pair loading and prompt encoding shared by `verify` and `gptq`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dflash_quant.artifact.reports import Provenance
from dflash_quant.errors import DFlashQuantError, UsageError, check_count
from dflash_quant.io.source import resolve
from dflash_quant.loading.drafter import LoadedDrafter, load_drafter, read_draft_config
from dflash_quant.loading.target import LoadedTarget, load_target
from dflash_quant.models.checks import check_pair
from dflash_quant.prompts import encode_prompt, load_prompts
from dflash_quant.reference import PAIRS, pair_dir
from dflash_quant.reference import default_target as shipped_target

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _cpu_threads() -> None:
    # Batch-1 decoding is made of tiny matmuls: extra OpenMP threads only spin, and on a shared machine
    # they slowed it ~25x on a loaded 2-core box (measured once). OMP_NUM_THREADS, when set, wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")
SDPA_ENV = "DFLASH_QUANT_SDPA"


def _cuda_attention() -> None:
    # cuDNN's attention builds an execution plan for every new shape, and decoding changes the key length at
    # every step: on an H200 that made attention 1.4-5 ms a call (benchmarks/bench_sdpa.py). Without it the
    # dispatcher picks flash / memory-efficient / math. DFLASH_QUANT_SDPA=flash,efficient,math,cudnn chooses.
    raw = os.environ.get(SDPA_ENV, "flash,efficient,math")
    allowed = {b.strip() for b in raw.split(",") if b.strip()}
    if not allowed or allowed - set(SDPA_BACKENDS):
        raise UsageError(f"{SDPA_ENV}={raw!r} must list some of {', '.join(SDPA_BACKENDS)} (comma-separated)")
    torch.backends.cuda.enable_flash_sdp("flash" in allowed)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in allowed)
    torch.backends.cuda.enable_math_sdp("math" in allowed)
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in allowed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        _cpu_threads()
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {name!r}; use auto, cpu or cuda[:N]") from exc
    if device.type == "cuda":
        _cuda_attention()
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """CPU runs in fp32 (exact checks), CUDA in bf16 (how drafters are served)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def default_target(drafter_src: str) -> str:
    """The target a drafter was made for: a shipped pair's, or the one recorded in an artifact."""

    shipped = shipped_target(drafter_src)
    if shipped:
        return shipped
    if (Path(drafter_src) / Provenance.FILE).is_file():
        target = Provenance.read(Path(drafter_src)).target
        if target is not None:
            recorded = target.recorded_spec()
            if recorded:
                return recorded
    raise UsageError(f"no --target given and {drafter_src} does not record one; pass --target TARGET")


def load_pair(
    drafter_src: str, target_src: str | None, device: torch.device, dtype: torch.dtype, placement: Any = None
) -> tuple[LoadedDrafter, LoadedTarget]:
    """The drafter on `device`; the target there too, or split by `placement` (models.placement.Placement)."""

    read_draft_config(resolve(drafter_src))  # config and weight-header errors before the target loads
    target = load_target(target_src or default_target(drafter_src), device=device, dtype=dtype, placement=placement)
    drafter = load_drafter(drafter_src, device=device, dtype=dtype)
    check_pair(drafter.config, target.model)
    return drafter, target


def reference_pair_of(target: LoadedTarget) -> str | None:
    """The name of the shipped pair whose target this is (`reference`, `reference-dflash2`), else None."""

    for name in PAIRS:
        try:
            if target.source.path.resolve() == (pair_dir(name) / "target").resolve():
                return name
        except DFlashQuantError:
            continue
    return None


def is_reference_target(target: LoadedTarget) -> bool:
    return reference_pair_of(target) is not None


def default_prompt_spec(target: LoadedTarget, split: str) -> str:
    """A shipped pair: its own held-out/calibration code prompts; any other pair: the built-in mix."""
    pair = reference_pair_of(target)
    return f"{pair}:{split}" if pair else f"builtin:{split}"


def encode_prompts(
    target: LoadedTarget,
    spec: str,
    limit: int | None,
    chat_template: bool,
    max_new_tokens: int | None = None,
    option: str = "--max-new-tokens",
    count_option: str = "--num-prompts",
) -> list[list[int]]:
    """Token ids of the prompts. A prompt that cannot fit the target's positions with max_new_tokens after it
    is refused (exit 2) rather than truncated: a cut prompt would be a different, silently measured prompt."""

    if target.tokenizer is None:
        raise DFlashQuantError(f"target {target.source.id} has no tokenizer files; add them to the target directory")
    check_count(limit, count_option)
    prompts = load_prompts(spec)
    if limit is not None:
        prompts = prompts[:limit]
    encoded = [encode_prompt(target.tokenizer, p, chat_template=chat_template) for p in prompts]
    model_cfg: Any = target.model.config
    cfg = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    positions = getattr(cfg, "max_position_embeddings", None)
    for i, ids in enumerate(encoded):
        if not ids:
            raise UsageError(f"prompt {i + 1} of {spec!r} encodes to no tokens; remove it or give it text")
        if isinstance(positions, int) and max_new_tokens is not None and len(ids) + max_new_tokens > positions:
            raise UsageError(
                f"prompt {i + 1} of {spec!r} is {len(ids)} tokens; with {option} {max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} positions but the target has {positions} (max_position_embeddings); "
                f"shorten the prompt or lower {option}"
            )
    return encoded


def prompt_categories(spec: str, limit: int | None) -> list[str | None]:
    """Each prompt's category (the built-in set's code / math / chat / reproduce; None for plain files)."""

    return [p.category for p in load_prompts(spec)][:limit]


def stop_tokens(target: LoadedTarget) -> list[int]:
    eos = (
        getattr(target.model.generation_config, "eos_token_id", None)
        if hasattr(target.model, "generation_config")
        else None
    )
    if eos is None and target.tokenizer is not None:
        eos = target.tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
