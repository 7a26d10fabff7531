"""Shape check of an artifact's provenance.json (docs/artifact.md) before `card` or `push` rely on it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_quant.errors import DFlashQuantError

PROVENANCE = "provenance.json"
_FIX = "re-export the artifact with `dflash-quant gptq` (provenance.json is written by the export stage)"

# field -> allowed JSON types (None: null allowed); sub-objects checked one level deep.
_TOP = {"tool": (str,), "tool_version": (str,), "created_utc": (str,), "command": (list,),
        "source_drafter": (dict,), "target": (dict,), "calibration": (dict,), "quantization": (dict,)}
_SUB = {
    "source_drafter": {"id": (str,), "revision": (str,), "sha256": (str,), "hub_id": (str,), "license": (str,)},
    "target": {"id": (str,), "revision": (str,), "path": (str,)},
    "quantization": {"skipped": (list,), "bits": (int,), "group_size": (int,)},
}
_NAMES = {str: "a string", list: "a list", dict: "an object", int: "an integer"}


def provenance_problem(root: Path) -> str | None:
    """Why provenance.json cannot be used (None when it is absent or well formed)."""
    path = Path(root) / PROVENANCE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"is not valid JSON ({exc.__class__.__name__})"
    if not isinstance(data, dict):
        return "is not a JSON object"
    for key, types in _TOP.items():
        value = data.get(key)
        if value is not None and not isinstance(value, types):
            return f"field {key!r} must be {_NAMES[types[0]]}"
    for key, fields in _SUB.items():
        for sub, types in fields.items():
            value = (data.get(key) or {}).get(sub)
            if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
                return f"field {key}.{sub} must be {_NAMES[types[0]]}"
    if any(not isinstance(a, (str, int, float)) for a in data.get("command") or []):
        return "field 'command' must be a list of strings"
    return None


def check_provenance(root: Path) -> None:
    problem = provenance_problem(root)
    if problem:
        raise DFlashQuantError(f"{Path(root) / PROVENANCE} {problem}; {_FIX}")
