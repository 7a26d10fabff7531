"""Where dflash-quant keeps what it may reuse across runs: ~/.cache/dflash-quant (or under $XDG_CACHE_HOME)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-quant"


def calib_store_dir() -> Path:
    """The calibration store (calibration.store), beside the check cache."""
    return cache_root() / "calib"


def check_cache_dir() -> Path:
    """The parity check's reusable runs (speculative.check_cache)."""
    return cache_root() / "check"
