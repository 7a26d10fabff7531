"""sha256 manifest of an artifact directory: the export stage's record of what it wrote.

Who writes what (docs/artifact.md):
- the export stage (`dflash-quant gptq`, inside its temp dir) records every file with `write_manifest`;
- a later stage (`card`, `memory`) first checks every recorded file with `require_intact` and refuses on
  any mismatch, then records only the files it wrote itself with `record_files`. It never re-hashes
  weights or other files into the manifest: a flipped byte must stay detectable until re-export.
- `push` uploads only what `verified_files` vouches for.

An artifact is intact when every manifest entry is a plain relative path naming a regular file (no
symlink anywhere on the way) inside the directory, with the recorded size and sha256, and no other
visible file, and no symlink at all, is in the tree. Hidden files (a leading dot in any part: our own
temp files, a lock file) are neither listed nor uploaded.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dflash_quant.artifact.reports import Manifest
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.weights import sha256_file, sha256_fileobj  # noqa: F401 (sha256_file re-exported)

MANIFEST = Manifest.FILE
REEXPORT = "re-export the artifact with `dflash-quant gptq`"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SHOWN = 3  # problems named in a one-line refusal


@dataclass(frozen=True)
class VerifiedFile:
    """A manifest entry checked against the file: the identity of what was hashed, for push."""

    name: str
    path: Path
    bytes: int
    sha256: str
    dev: int
    ino: int
    mtime_ns: int


def _hidden(rel: PurePosixPath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative posix name, lstat) of everything under root, symlinks not followed."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            yield full.relative_to(root).as_posix(), full.lstat()


def name_problem(name: object) -> str | None:
    """Why a manifest entry name is not a plain relative POSIX path inside the artifact (None if it is)."""
    if not isinstance(name, str) or not name:
        return f"entry {name!r} is not a file name"
    shown = repr(name) if any(c in name for c in "\\\0\n\r") else name
    if "\\" in name or "\0" in name or "\n" in name or "\r" in name:
        return f"entry {shown} contains a backslash or control character"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return f"entry {shown} is an absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"entry {shown} has an empty, '.' or '..' part (it must stay inside the artifact)"
    if name == MANIFEST:
        return f"entry {shown} names the manifest itself"
    return None


def _file_problem(root: Path, name: str) -> tuple[str | None, os.stat_result | None]:
    """lstat every part of root/name: no symlink on the way, a regular file at the end, inside root."""
    path = root
    st = None
    parts = name.split("/")
    for i, part in enumerate(parts):
        path = path / part
        try:
            st = path.lstat()
        except FileNotFoundError:
            return f"{name} is listed in the manifest but missing", None
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})", None
        if stat.S_ISLNK(st.st_mode):
            return f"{'/'.join(parts[: i + 1])} is a symlink (artifacts hold real files only)", None
        last = i == len(parts) - 1
        if not last and not stat.S_ISDIR(st.st_mode):
            return f"{name} is listed in the manifest but {'/'.join(parts[: i + 1])} is not a directory", None
        if last and not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file", None
    real_root = root.resolve()
    if not path.resolve().is_relative_to(real_root):  # belt and braces: lexical and lstat checks cover it
        return f"{name} resolves outside the artifact", None
    return None, st


def read_manifest(root: Path) -> tuple[dict | None, str | None]:
    """(files mapping, problem). The manifest itself must be a regular file, not a symlink."""
    path = Path(root) / MANIFEST
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return None, f"{MANIFEST} is not a regular file"
    data, problem = Manifest.load_json(root)
    if problem:
        return None, f"{MANIFEST} {problem}"
    return parse_files(data)


def parse_files(data: object) -> tuple[dict | None, str | None]:
    """(raw files mapping, problem) of parsed manifest JSON. Entries stay raw: each one's problems are
    reported by name (`_entry_problem`) rather than refusing the whole manifest."""
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None, f'{MANIFEST} has no "files" object'
    return files, None


def _entry_problem(name: str, entry: object) -> str | None:
    if not isinstance(entry, dict):
        return f"entry {name} is not an object"
    sha, size = entry.get("sha256"), entry.get("bytes")
    if not isinstance(sha, str) or not _HEX64.match(sha):
        return f"entry {name} has no valid sha256"
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"entry {name} has no valid byte count"
    return None


def _hash_open(path: Path, st: os.stat_result) -> tuple[str, os.stat_result]:
    """Hash through a descriptor opened without following a final symlink; it must be the file lstat saw."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        fst = os.fstat(fh.fileno())
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise OSError("file replaced while checking")
        digest = sha256_fileobj(fh)
    return digest, fst


def check_artifact_files(root: Path, *, skip: Iterable[str] = ()) -> tuple[list[str], list[VerifiedFile]]:
    """(problems, verified files). `skip`: names the caller is about to rewrite (checked for shape, not hash)."""
    root = Path(root)
    skip = set(skip)
    listed, problem = read_manifest(root)
    if problem:
        return [problem], []
    assert listed is not None  # read_manifest gives a problem or the files
    problems: list[str] = []
    verified: list[VerifiedFile] = []
    for name, entry in sorted(listed.items(), key=lambda kv: str(kv[0])):
        bad = name_problem(name) or _entry_problem(name, entry)
        if bad:
            problems.append(bad)
            continue
        bad, st = _file_problem(root, name)
        if bad:
            if not (name in skip and bad.endswith("but missing")):
                problems.append(bad)
            continue
        assert st is not None  # _file_problem gives a problem or the stat
        if name in skip:
            continue
        if st.st_size != entry["bytes"]:
            problems.append(
                f"{name} does not match its sha256 in the manifest ({st.st_size} bytes, recorded {entry['bytes']})"
            )
            continue
        try:
            digest, fst = _hash_open(root / name, st)
        except OSError as exc:
            problems.append(f"{name} cannot be read ({exc.strerror or exc})")
            continue
        if digest != entry["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest")
            continue
        verified.append(VerifiedFile(name, root / name, fst.st_size, digest, fst.st_dev, fst.st_ino, fst.st_mtime_ns))
    for rel, st in _walk(root):
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{rel} is a symlink (artifacts hold real files only)")
        elif stat.S_ISDIR(st.st_mode) or _hidden(PurePosixPath(rel)) or rel == MANIFEST:
            continue
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel} is not a regular file")
        elif rel not in listed and rel not in skip:
            problems.append(f"{rel} is not in the manifest")
    return list(dict.fromkeys(problems)), verified


def verify_manifest(root: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Problems found (empty when the artifact is intact; see the module docstring)."""
    return check_artifact_files(root, skip=skip)[0]


def summarize(problems: list[str]) -> str:
    more = len(problems) - _SHOWN
    return "; ".join(problems[:_SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def require_intact(root: Path, *, stage: str, skip: Iterable[str] = ()) -> list[VerifiedFile]:
    """Raise a one-line DFlashQuantError unless the artifact is intact; the fix is always a re-export."""
    problems, verified = check_artifact_files(root, skip=skip)
    if problems:
        raise DFlashQuantError(
            f"{stage}: artifact {root} fails its integrity check: {summarize(problems)}; {REEXPORT} "
            f"(only the export stage records weight hashes)"
        )
    return verified


# --------------------------------------------------------------------------- writing


def _artifact_files(root: Path) -> list[str]:
    names = []
    for rel, st in _walk(root):
        if stat.S_ISLNK(st.st_mode):
            raise DFlashQuantError(f"{root / rel} is a symlink; the export writes real files only")
        if stat.S_ISREG(st.st_mode) and rel != MANIFEST and not _hidden(PurePosixPath(rel)):
            names.append(rel)
    return sorted(names)


def _entry(path: Path) -> dict:
    st = path.lstat()
    return {"sha256": _hash_open(path, st)[0], "bytes": st.st_size}


def build_manifest(root: Path) -> dict:
    root = Path(root)
    return {"format": 1, "files": {name: _entry(root / name) for name in _artifact_files(root)}}


def _write_atomic(root: Path, manifest: dict) -> None:
    Manifest.from_dict(manifest).write(root)


def write_manifest(root: Path) -> dict:
    """Export stage only: record every visible file in root except the manifest itself."""
    manifest = build_manifest(root)
    _write_atomic(Path(root), manifest)
    return manifest


class _Held(threading.local):
    roots: set[Path]

    def __init__(self) -> None:
        self.roots = set()


_updating = _Held()  # per thread: the artifacts whose lock it holds (flock would block on itself)


LOCK = ".manifest.lock"  # only where a directory cannot be locked itself (NFS)


def _lock(directory: Path) -> int:
    """An fd holding an exclusive flock for the directory: on the directory itself (nothing is created), or, where
    the filesystem refuses that (NFS emulates flock with fcntl locks, which need a file open for writing), on a
    hidden lock file inside it."""
    import errno
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    except BaseException:
        os.close(fd)
        raise
    fd = os.open(directory / LOCK, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def updating(root: Path) -> Iterator[None]:
    """Serialise in-place updates of a finished artifact (`card`, `memory`): check, write, record, as one.

    Re-entrant in a thread; another process or thread waits for the lock (see _lock).
    """
    key = Path(root).resolve()
    held = _updating.roots
    if key in held:
        yield
        return
    try:
        fd = _lock(key)
    except OSError as exc:
        raise DFlashQuantError(
            f"cannot lock {key} for the update ({exc.strerror}); it must be a writable directory"
        ) from exc
    try:
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
    finally:
        os.close(fd)  # releases the flock


def record_files(root: Path, names: Iterable[str]) -> dict:
    """After `require_intact`: set (or drop, when the file is gone) the entries of `names` only."""
    root = Path(root)
    with updating(root):
        listed, problem = read_manifest(root)
        if problem:
            raise DFlashQuantError(f"cannot update {root / MANIFEST}: {problem}; {REEXPORT}")
        assert listed is not None  # read_manifest gives a problem or the files
        files = dict(listed)
        for name in names:
            bad = name_problem(name)
            if bad:
                raise ValueError(bad)  # a programming error: stages pass their own fixed names
            bad, _ = _file_problem(root, name)
            if bad and bad.endswith("but missing"):
                files.pop(name, None)
            elif bad:
                raise DFlashQuantError(f"cannot record {name}: {bad}; {REEXPORT}")
            else:
                files[name] = _entry(root / name)
        manifest = {"format": 1, "files": dict(sorted(files.items()))}
        _write_atomic(root, manifest)
    return manifest


def has_manifest(root: Path) -> bool:
    return os.path.lexists(Path(root) / MANIFEST)


def load_manifest(root: Path) -> dict:
    files, problem = read_manifest(root)
    if problem:
        raise DFlashQuantError(f"cannot read {Path(root) / MANIFEST}: {problem}; {REEXPORT}")
    return {"format": 1, "files": files}
