"""The shipped reference pairs (trained by dflash_quant.reference.train).

- ``reference``: a Qwen3 target and a DFlash (v1) drafter, in ``pair/``; names ``reference`` /
  ``reference/drafter`` (the drafter) and ``reference/target``;
- ``reference-dflash2``: a hybrid Qwen3.5 target (linear- and full-attention layers) and a DFlash2 drafter,
  in ``dflash2_pair/``; names ``reference-dflash2`` / ``reference-dflash2:drafter`` and
  ``reference-dflash2:target``.
"""

from __future__ import annotations

from pathlib import Path

from dflash_quant.errors import DFlashQuantError

PAIRS = {"reference": "pair", "reference-dflash2": "dflash2_pair"}
_SHORTCUTS = {
    "reference": ("reference", "drafter"),
    "reference/drafter": ("reference", "drafter"),
    "reference/target": ("reference", "target"),
    "reference-dflash2": ("reference-dflash2", "drafter"),
    "reference-dflash2:drafter": ("reference-dflash2", "drafter"),
    "reference-dflash2:target": ("reference-dflash2", "target"),
}


def pair_dir(name: str = "reference") -> Path:
    """Directory holding `target/`, `drafter/` and the pair's prompt files."""
    path = Path(__file__).resolve().parent / PAIRS[name]
    if not (path / "drafter" / "config.json").is_file() or not (path / "target" / "config.json").is_file():
        raise DFlashQuantError(
            f"the {name} pair is not installed at {path}; reinstall dflash-quant or pass DRAFTER and --target"
        )
    return path


def parse_shortcut(text: str) -> tuple[str, str] | None:
    """(pair name, 'drafter' | 'target') for a shipped pair's model name, else None."""
    return _SHORTCUTS.get(str(text))


def shortcut_name(pair: str, part: str) -> str:
    """The name a pair's drafter or target is addressed by (the inverse of parse_shortcut)."""
    if pair == "reference":
        return "reference" if part == "drafter" else "reference/target"
    return f"{pair}:{part}"
