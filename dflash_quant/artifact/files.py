"""The one atomic JSON writer, sha256 of open files, and the portable form of a local path."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from dflash_quant.io.weights import sha256_files


def replace_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Have `write` fill a fresh hidden temp file beside `path`, then rename it over `path`.

    Readers never see half a file and concurrent writers never share a temp file; on an error, or a signal
    under signals_raise, the temp file is removed. The file gets the umask's permissions (mkstemp: 0600).
    """
    from dflash_quant.export.atomic import current_umask, deferred_signals

    path = Path(path)
    tmp: Path | None = None
    try:
        with deferred_signals():  # a signal between mkstemp creating the file and `tmp` naming it would leave it
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmp = Path(name)
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write JSON through replace_atomic (readers never see half a file)."""
    text = json.dumps(data, indent=2) + "\n"
    return replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _update(digest, fh: BinaryIO, chunk: int = 1 << 20) -> None:
    while block := fh.read(chunk):
        digest.update(block)


def sha256_fileobj(fh: BinaryIO) -> str:
    """sha256 of what is left to read from an open binary file."""
    digest = hashlib.sha256()
    _update(digest, fh)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_files([path])


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
