"""How a model source is recorded in an artifact: Hub id + revision, a shipped name, or a portable path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dflash_quant.artifact.reports import SourceRef
from dflash_quant.reference import parse_shipped, shipped_id, shipped_name

_CACHE_REPO = re.compile(r"^models--([^/]+?)--(.+)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def portable_path(path: str | Path, cwd: Path | None = None) -> str:
    """How a local path is recorded in an artifact: relative to the working directory when inside it,
    otherwise only its last component. Never an absolute path of the machine that wrote it."""
    cwd = Path(cwd or os.getcwd()).resolve()
    p = Path(os.path.expanduser(str(path)))
    real = (p if p.is_absolute() else cwd / p).resolve()
    if real.is_relative_to(cwd):
        rel = real.relative_to(cwd).as_posix()
        return rel or "."
    return real.name or "."


def hub_snapshot(path: Path) -> tuple[str, str] | None:
    """(`org/name`, commit) for a folder `.../models--org--name/snapshots/<commit>` of the HF cache."""
    path = Path(path)
    m = _CACHE_REPO.match(path.parent.parent.name) if path.parent.name == "snapshots" else None
    if not m:
        return None
    return f"{m.group(1)}/{m.group(2)}", path.name


def source_ref(source, sha256: str | None = None, cwd: Path | None = None) -> SourceRef:
    """The record of an io.source.Source; never an absolute path of this machine."""
    if source.kind == "shipped":
        return SourceRef(id=shipped_name(source.path) or source.id, kind="shipped", sha256=sha256)
    snap = hub_snapshot(source.path)
    if source.kind == "hub" or snap:
        repo = source.id if source.kind == "hub" or snap is None else snap[0]
        commit = snap[1] if snap and _COMMIT.match(snap[1]) else None
        return SourceRef(id=repo, kind="hub", revision=commit or source.revision, sha256=sha256)
    where = portable_path(source.path, cwd)
    return SourceRef(id=where, kind="local", sha256=sha256, path=where)


def model_label(spec: str | Path, cwd: Path | None = None) -> str:
    """A model argument as written into a report: shipped name, Hub id or preset kept, local paths made portable."""
    text = str(spec)
    parsed = parse_shipped(text)
    if parsed:
        return shipped_id(*parsed)
    path = Path(text).expanduser()
    if path.exists():
        snap = hub_snapshot(path)
        if snap:
            return snap[0]
        return shipped_name(path) or portable_path(path, cwd)
    return text


def _portable_arg(text: str, cwd: Path | None) -> str:
    import os

    if text.startswith("~") or os.path.isabs(text):
        return portable_path(text, cwd)
    return text


def portable_command(argv: list[str], cwd: Path | None = None) -> list[str]:
    """argv with every absolute (or ~) path made portable, also in `--flag=/abs/path` form."""
    out = []
    for arg in argv:
        arg = str(arg)
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("-"):
            out.append(f"{flag}={_portable_arg(value, cwd)}")
        else:
            out.append(_portable_arg(arg, cwd))
    return out


def prompt_label(spec: str | None, cwd: Path | None = None) -> str | None:
    """A prompt spec as recorded: builtin/reference names kept, a prompt file made portable."""
    if spec is None or spec.startswith(("builtin", "reference")):
        return spec
    return portable_path(spec, cwd)
