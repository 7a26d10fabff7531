"""Shipped model configs for budgeting without downloads. Each JSON names the source of its values in `_sources`."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.json"))


def preset_path(name: str) -> Path | None:
    p = HERE / f"{str(name).strip().lower()}.json"
    return p if p.is_file() else None


def load_preset(name: str) -> dict | None:
    p = preset_path(name)
    return json.loads(p.read_text()) if p else None
