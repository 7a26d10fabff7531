"""Reading an artifact for its card: the typed reports, config.json, and where the source drafter came from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub.repocard import metadata_load

from dflash_quant.artifact.reports import MemoryReport, Parity, Provenance, QuantReport, SourceRef
from dflash_quant.artifact.sources import portable_command

README = "README.md"
REPORT_CLASSES = (Provenance, QuantReport, Parity, MemoryReport)
REPORTS = tuple(c.FILE for c in REPORT_CLASSES) + ("config.json",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")
_TOKENISH = re.compile(r"hf_[A-Za-z0-9]{16,}")
_SECRET_FLAGS = {"--token", "--hf-token", "--api-key"}


def _read_config(path: Path) -> tuple[dict | None, str | None]:
    """config.json (not one of the reports): (data, problem), data None when missing or unreadable."""
    if not path.is_file():
        return None, "missing"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"unreadable ({exc.__class__.__name__})"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    return data, None


def load_reports(artifact_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The typed reports (artifact.reports) and config.json; a missing or malformed one is None, with its problem."""
    reports: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for cls in REPORT_CLASSES:
        report, problem = cls.problem(Path(artifact_dir))
        reports[cls.FILE] = report
        if problem:
            problems[cls.FILE] = problem.removeprefix("is ")
    reports["config.json"], problem = _read_config(Path(artifact_dir) / "config.json")
    if problem:
        problems["config.json"] = problem
    return reports, problems


def dig(d: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return default if d is None else d


def is_hub_id(value: str | None) -> bool:
    if not value:
        return False
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def _hub_id_from_path(value: str) -> str | None:
    """`.../models--org--name/snapshots/<sha>` (the HF cache layout) -> `org/name`."""
    for part in Path(value).parts:
        m = _CACHE_DIR.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return None


def resolve_source(provenance: Provenance | None) -> dict[str, Any]:
    """Source drafter id, its Hub repo (Hub sources only), and the metadata of its own card when available.

    License and library are inherited from the source card only when a copy of that card is on disk
    (a local source directory or the local HF cache); no network call is made here. Shipped and local
    sources have no Hub repo, so no `base_model` and no link.
    """
    src = provenance.source_drafter if provenance and provenance.source_drafter else SourceRef()
    sid = src.id
    out: dict[str, Any] = {
        "id": sid,
        "kind": src.kind,
        "revision": src.revision,
        "sha256": src.sha256,
        "hub_id": src.hub_repo(),
        "metadata": {},
        "metadata_from": None,
    }
    if not sid:
        return out
    readme: Path | None = None
    local = Path(src.path or sid)
    if src.kind in (None, "local") and local.is_dir():
        if src.kind is None:  # written before `kind`: a path in the HF cache still names its repo
            out["hub_id"] = out["hub_id"] or _hub_id_from_path(str(local.resolve()))
        if (local / README).is_file():
            readme = local / README
    elif src.kind == "hub" or (src.kind is None and is_hub_id(sid)):
        out["hub_id"] = out["hub_id"] or sid
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(out["hub_id"], README, revision=src.revision)
            if isinstance(cached, str):
                readme = Path(cached)
        except Exception:  # a malformed revision or cache must never break the card
            readme = None
    if readme is not None:
        try:
            out["metadata"] = metadata_load(readme) or {}
            out["metadata_from"] = "the source drafter's card"
        except Exception:
            out["metadata"] = {}
    if src.license:
        out["metadata"] = {**out["metadata"], "license": src.license}
        out["metadata_from"] = out["metadata_from"] or "provenance.json"
    return out


def scrub_command(argv: list[str]) -> list[str]:
    """Never put a secret or a machine-local absolute path from the command line into a card."""
    argv = portable_command(argv)
    clean: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            clean.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in _SECRET_FLAGS:
            if eq:
                clean.append(f"{flag}=***")
            else:
                clean.append(arg)
                hide_next = True
            continue
        clean.append(_TOKENISH.sub("***", arg))
    return clean


def block_size(config: dict | None) -> int | None:
    value = dig(config, "block_size") or dig(config, "dflash_config", "block_size")
    return int(value) if isinstance(value, int) else None
