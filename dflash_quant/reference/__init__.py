"""The shipped reference target + DFlash drafter pair (trained by dflash_quant.reference.train)."""

from __future__ import annotations

from pathlib import Path

from dflash_quant.errors import DFlashQuantError


def pair_dir() -> Path:
    """Directory holding `target/`, `drafter/` and the pair's prompt files."""
    path = Path(__file__).resolve().parent / "pair"
    if not (path / "drafter" / "config.json").is_file() or not (path / "target" / "config.json").is_file():
        raise DFlashQuantError(
            f"the reference pair is not installed at {path}; reinstall dflash-quant or pass DRAFTER and --target"
        )
    return path
