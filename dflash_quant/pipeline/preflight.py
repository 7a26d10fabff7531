"""Before any compute: which paths a gptq run reads, and the guard over the directory it writes.

Kept free of torch/transformers imports so the CLI can refuse a bad --output or --calib-cache at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_quant.artifact.reports import Provenance
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import check_writable_dir, guard_output
from dflash_quant.reference import default_target, pair_dir, parse_shipped

KV_MODES = ("block", "block+context")  # calibration.capture.KV_MODES, repeated here to stay free of torch


def _model_paths(src: str) -> list[Path]:
    """Local files behind a drafter/target argument: its directory, the reference pair, or its Hub cache folder."""

    shipped = parse_shipped(src)
    if shipped:
        try:
            return [pair_dir(shipped[0]) / shipped[1]]
        except DFlashQuantError:
            return []  # not installed: the loader reports it
    path = Path(src).expanduser()
    if os.path.lexists(path):
        return [path]
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):  # a Hub id: protect its cache folder
        from huggingface_hub.constants import HF_HUB_CACHE

        return [Path(HF_HUB_CACHE) / f"models--{src.replace('/', '--')}"]
    return []


def _default_target(drafter: str) -> str | None:
    """The target recorded by an artifact used as the drafter (mirrors runtime.default_target, without loading)."""

    shipped = default_target(drafter)
    if shipped:
        return shipped
    provenance, _ = Provenance.problem(Path(drafter))
    return provenance.target.recorded_spec() if provenance and provenance.target else None


def input_paths(
    drafter: str,
    target: str | None,
    prompt_specs: Iterable[str | None],
    calib_cache: Path | None,
    check_cache: Path | None = None,
) -> list[Path]:
    paths = _model_paths(drafter)
    target = target or _default_target(drafter)
    if target:
        paths += _model_paths(target)
    for spec in prompt_specs:
        if spec and not spec.startswith(("builtin", "reference")):
            paths.append(Path(spec).expanduser())
    paths += [Path(cache) for cache in (calib_cache, check_cache) if cache is not None]
    return paths


@contextlib.contextmanager
def guard_run(
    output: Path,
    overwrite: bool,
    drafter: str,
    target: str | None,
    prompt_specs: Iterable[str | None],
    calib_cache: Path | None,
    check_cache: Path | None = None,
) -> Iterator[Path]:
    """Every path check of a gptq run, then its output lock (see io.atomic.guard_output); yields the resolved output."""
    if calib_cache is not None:
        check_writable_dir(calib_cache, "--calib-cache")  # what calibration.cache.check_location checks, without torch
    inputs = input_paths(drafter, target, prompt_specs, calib_cache, check_cache)
    with guard_output(output, overwrite, inputs) as final:
        yield final
