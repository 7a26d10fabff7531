"""The user's calibration store: captured Hessians reused by a later `gptq` on the same inputs, so a re-run
with other quantization settings (bits, group size, damp...) skips the drafter-with-target capture.

One entry per key under DIR/<key sha256>/ in the --calib-cache layout (calibration.cache). The key holds
everything the Hessians depend on: drafter weights and config, target identity (check_cache.model_identity)
and config, the encoded prompt ids, tokens per prompt, stop tokens, kv_hessian, extra Linears, dtype, the
compute and Hessian device types and the dflash-quant version. An entry is written to a hidden temp folder and
renamed into place (readers see a whole entry or none; concurrent writers of one key keep one). A damaged or
unreadable entry is a miss: it is removed and recomputed. The store is capped (oldest-used entries are evicted
first; an entry larger than the cap is not stored): a 27B drafter's Hessians are ~10 GB.

An unfinished calibration checkpoints into DIR/<key sha256>.checkpoint/ (CheckpointSlot), so an interrupted
`gptq` leaves nothing beside its output and its rerun resumes. Checkpoints count toward the cap like entries;
a live run holds its slot with a shared flock, and only a holder of the exclusive lock (eviction, the cleanup
of a finished run) removes one, so no run loses the checkpoint it is writing.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

import dflash_quant
from dflash_quant.calibration import cache as calib_cache
from dflash_quant.calibration import checkpoint as ckpt
from dflash_quant.calibration.capture import CalibrationStats, CaptureState
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.cache_dirs import calib_store_dir
from dflash_quant.speculative.check_cache import model_identity

_STALE_S = 24 * 3600  # a temp or trash folder this old belongs to a run that died: removed on the next write
CHECKPOINT = ".checkpoint"  # suffix of a key's checkpoint folder beside its entry


def default_dir() -> Path:
    """~/.cache/dflash-quant/calib (or under $XDG_CACHE_HOME), beside the check cache."""
    return calib_store_dir()


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _size(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:  # a checkpoint's temp file renamed meanwhile
            continue
    return total


def _remove(path: Path) -> bool:
    """Rename out of the way first, so a reader never opens a half-deleted entry."""
    trash = path.with_name(f".trash-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except OSError:  # already gone (another run evicted or replaced it)
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _lock(fd: int, op: int) -> bool | None:
    """flock: True when taken, False when another run holds it, None where the filesystem has no directory locks."""
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):  # NFS and the like
            return None
        raise
    return True


def _is(fd: int, path: Path) -> bool:
    """Whether the folder open as `fd` is still the one at `path` (a finished run may have removed it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # removed meanwhile (a symlink in its place raises: never followed)
        return None


def _remove_checkpoint(path: Path) -> bool:
    """Evict a checkpoint folder only under its exclusive lock: never one a live run holds."""
    try:
        fd = _open_dir(path)
    except OSError:  # unreadable: not ours to judge
        return False
    if fd is None:
        return False
    try:
        return _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is True and _is(fd, path) and _remove(path)
    finally:
        os.close(fd)


def store_key(
    key: dict[str, Any],
    drafter,
    target,
    prompts: list[list[int]],
    stop_token_ids: list[int],
    device: torch.device,
    hessian_device: torch.device,
) -> dict[str, Any]:
    """The --calib-cache key (drafter weights, prompt spec, settings) plus what else the Hessians depend on."""

    return {
        **key,
        "drafter_identity": model_identity(drafter.source.path),
        "drafter_config_sha256": file_sha256(drafter.source.path / "config.json"),
        "target_identity": model_identity(target.source.path),
        "target_config_sha256": file_sha256(target.source.path / "config.json"),
        "prompt_ids_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "stop_token_ids": sorted(stop_token_ids),
        "device": torch.device(device).type,
        "hessian_device": torch.device(hessian_device).type,
        "version": dflash_quant.__version__,  # read per call (a test bumps it)
    }


class CalibStore:
    """load/save of CalibrationStats by key; `max_bytes` caps the store's total size."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes

    def _entry(self, key: dict[str, Any]) -> Path:
        return self.directory / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def checkpoint(self, key: dict[str, Any]) -> CheckpointSlot:
        """The slot of the key's unfinished calibration, beside where its entry goes."""
        entry = self._entry(key)
        return CheckpointSlot(self, entry.with_name(entry.name + CHECKPOINT))

    def load(self, key: dict[str, Any], need_replay: bool, device: torch.device) -> CalibrationStats | None:
        entry = self._entry(key)
        if not entry.is_dir():
            return None
        try:
            stats = calib_cache.load(entry, key, need_replay, device)
        except (DFlashQuantError, SafetensorError, OSError, ValueError, KeyError, TypeError):
            _remove(entry)  # damaged (torn write, full disk, foreign file): recomputed and stored again
            return None
        if stats is not None:
            try:
                os.utime(entry)  # most recently used: evicted last
            except OSError:
                pass
        return stats

    def save(self, stats: CalibrationStats, key: dict[str, Any]) -> str:
        """`stored`, or why the entry was not stored (the run goes on either way)."""
        need = sum(a.xtx.numel() * a.xtx.element_size() for a in stats.hessians.values() if a.xtx is not None)
        if need > self.max_bytes:
            return (
                f"not stored: {need / 1e9:.2f} GB is over the {self.max_bytes / 1e9:.2f} GB cap (--calib-cache-max-gb)"
            )
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_stale()
            calib_cache.save(tmp, stats, key)
            size = _size(tmp)
            if size > self.max_bytes:  # the replay inputs made it larger than the Hessians alone
                return f"not stored: {size / 1e9:.2f} GB is over the {self.max_bytes / 1e9:.2f} GB cap (--calib-cache-max-gb)"
            entry = self._entry(key)
            own = entry.with_name(entry.name + CHECKPOINT)  # superseded by this entry: not counted
            self._evict(size, keep=(entry, own))
            if entry.exists():  # an older entry for this key (e.g. without replay inputs), or a concurrent writer's
                _remove(entry)
            try:
                os.rename(tmp, entry)
            except OSError:  # a concurrent run stored this key between the two lines above: theirs is kept
                pass
            return "stored"
        except (OSError, DFlashQuantError) as exc:
            return f"not stored: {exc}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _entries(self) -> list[Path]:
        # Only folders this store wrote: a symlink or a folder without our metadata is never evicted.
        def ours(p: Path) -> bool:
            marker = ckpt.FILE if p.name.endswith(CHECKPOINT) else calib_cache.META
            return not p.name.startswith(".") and not p.is_symlink() and p.is_dir() and (p / marker).is_file()

        return [p for p in self.directory.iterdir() if ours(p)]

    def _evict(self, incoming: int, keep: Collection[Path]) -> None:
        """Remove the least recently used entries and checkpoints no live run holds, until the store plus
        `incoming` bytes fits the cap (what is kept is not counted: it is being replaced)."""
        sized = []
        for p in self._entries():
            try:
                sized.append((p.stat().st_mtime, _size(p), p))
            except OSError:  # removed by another run meanwhile
                continue
        total = sum(s for _, s, p in sized if p not in keep)
        for _, s, p in sorted(sized, key=lambda x: x[0]):
            if total + incoming <= self.max_bytes:
                break
            if p in keep:
                continue
            if _remove_checkpoint(p) if p.name.endswith(CHECKPOINT) else _remove(p):
                total -= s

    def _clean_stale(self) -> None:
        now = time.time()
        for p in self.directory.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                try:
                    if now - p.stat().st_mtime > _STALE_S:
                        shutil.rmtree(p, ignore_errors=True)
                except OSError:
                    continue


class CheckpointSlot:
    """The folder of one key's calibration checkpoint in the store.

    A run holds it (a shared flock on the folder, released by the kernel if the run is killed) from before it
    reads a checkpoint until calibration ends. Runs of one key share it: each writes whole files (renamed into
    place) of the same key, so whichever is newest resumes the rerun.
    """

    def __init__(self, store: CalibStore, path: Path):
        self.store, self.path = store, path
        self._fd: int | None = None

    def hold(self) -> None:
        while True:  # until the folder held is still the one at the path (a finished run may remove it)
            self.store.directory.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(exist_ok=True)
            fd = _open_dir(self.path)
            if fd is None:
                continue
            try:
                if _lock(fd, fcntl.LOCK_SH) is not True or _is(fd, self.path):
                    self._fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def save(self, key: dict[str, Any], state: CaptureState) -> bool:
        """Write the checkpoint, first evicting older entries to keep the store under its cap; False (nothing
        written, calibration goes on) when the checkpoint alone is over the cap or the cache refuses it."""
        need = ckpt.nbytes(state)
        if need > self.store.max_bytes:
            return False
        try:
            self.store._evict(need, keep=(self.path,))
            ckpt.save(self.path, key, state)
        except OSError:  # full or read-only cache: no checkpoint, as with --calib-checkpoint-every 0
            return False
        return True

    def release(self, finished: bool) -> None:
        """Let go; when no other run holds the folder, remove a finished calibration's checkpoint, temp files of
        killed writers, and the folder once empty (a file someone else put there stays, and so does the folder)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is not False and _is(fd, self.path):
                self._clean(finished)
        finally:
            os.close(fd)

    def _clean(self, finished: bool) -> None:
        try:
            if finished:
                (self.path / ckpt.FILE).unlink(missing_ok=True)
            for tmp in self.path.glob(f".{ckpt.FILE}.*.tmp"):
                tmp.unlink(missing_ok=True)
            self.path.rmdir()
        except OSError:  # not empty (a checkpoint to resume, a file that is not ours) or not ours to remove
            pass
