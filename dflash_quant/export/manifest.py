"""sha256 manifest over an artifact directory, so that push (and users) can check what they got."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_quant.errors import DFlashQuantError

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _artifact_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def build_manifest(root: Path) -> dict:
    root = Path(root)
    files = {
        p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in _artifact_files(root)
    }
    return {"format": 1, "files": files}


def write_manifest(root: Path) -> dict:
    """(Re)write manifest.json over every file in root except itself."""
    manifest = build_manifest(root)
    tmp = Path(root) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(Path(root) / MANIFEST)
    return manifest


def verify_manifest(root: Path) -> list[str]:
    """Problems found (empty when every listed file is present with its hash and no file is unlisted)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        return [f"{path} is missing; re-export the artifact or run `dflash-quant card` to refresh it"]
    try:
        manifest = json.loads(path.read_text())
        listed = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"{path} is not a valid manifest ({exc})"]
    problems = []
    for name, entry in sorted(listed.items()):
        file = root / name
        if not file.is_file():
            problems.append(f"{name} is listed in the manifest but missing")
        elif file.stat().st_size != entry.get("bytes") or sha256_file(file) != entry.get("sha256"):
            problems.append(f"{name} does not match its sha256 in the manifest")
    for file in _artifact_files(root):
        name = file.relative_to(root).as_posix()
        if name not in listed:
            problems.append(f"{name} is not in the manifest")
    return problems


def load_manifest(root: Path) -> dict:
    try:
        return json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DFlashQuantError(f"cannot read {Path(root) / MANIFEST}: {exc}") from exc
