"""The shipped reference pairs (trained by scripts/reference_pair/train.py): `reference`, a Qwen3 target with a
DFlash (v1) drafter, and `reference-dflash2`, a hybrid Qwen3.5 target (linear- and full-attention layers) with
a DFlash2 drafter.

Shipped pairs are named, not addressed by path: `NAME` is a pair's drafter and `NAME:target` its target
(the older spellings `NAME/drafter` and `NAME/target` are still accepted). Those names are what artifacts
record, never the install location. Any model directory inside this package counts as shipped.
"""

from __future__ import annotations

from pathlib import Path

from dflash_quant.errors import DFlashQuantError

PACKAGE_DIR = Path(__file__).resolve().parent
PAIRS = {"reference": "pair", "reference-dflash2": "dflash2_pair"}  # shipped pair name -> its folder here
PARTS = ("drafter", "target")


def pair_dir(name: str = "reference") -> Path:
    """Directory holding `target/`, `drafter/` and the pair's prompt files."""
    path = PACKAGE_DIR / PAIRS[name]
    if not (path / "drafter" / "config.json").is_file() or not (path / "target" / "config.json").is_file():
        raise DFlashQuantError(
            f"the {name} pair is not installed at {path}; reinstall dflash-quant or pass DRAFTER and --target"
        )
    return path


def parse_shipped(spec: str) -> tuple[str, str] | None:
    """(pair name, part) for `NAME`, `NAME:drafter`, `NAME:target`, `NAME/drafter`, `NAME/target`; else None."""
    for name in PAIRS:
        if spec == name:
            return name, "drafter"
        for sep in (":", "/"):
            for part in PARTS:
                if spec == f"{name}{sep}{part}":
                    return name, part
    return None


def shipped_id(name: str, part: str) -> str:
    """The recorded name of a shipped model: `reference` for the drafter, `reference:target` for the target."""
    return name if part == "drafter" else f"{name}:{part}"


def is_shipped(path: Path | str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(PACKAGE_DIR)
    except OSError:
        return False


def shipped_name(path: Path | str) -> str | None:
    """The recorded name of a directory inside this package: a pair part's name, else its package-relative path."""
    if not is_shipped(path):
        return None
    real = Path(path).resolve()
    for name, folder in PAIRS.items():
        for part in PARTS:
            if real == (PACKAGE_DIR / folder / part).resolve():
                return shipped_id(name, part)
    return "dflash_quant/reference/" + real.relative_to(PACKAGE_DIR).as_posix()


def default_target(drafter: str) -> str | None:
    """`NAME:target` for a shipped drafter spelling, else None."""
    parsed = parse_shipped(drafter)
    return shipped_id(parsed[0], "target") if parsed else None
