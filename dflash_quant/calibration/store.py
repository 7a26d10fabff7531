"""The user's calibration store: captured Hessians reused by a later `gptq` on the same inputs, so a re-run
with other quantization settings (bits, group size, damp...) skips the drafter-with-target capture.

One entry per key under DIR/<key sha256>/ in the --calib-cache layout (calibration.cache). The key holds
everything the Hessians depend on: drafter weights and config, target identity (check_cache.model_identity)
and config, the encoded prompt ids, tokens per prompt, stop tokens, kv_hessian, extra Linears, dtype, the
compute and Hessian device types and the dflash-quant version. An entry is written to a hidden temp folder and
renamed into place (readers see a whole entry or none; concurrent writers of one key keep one). A damaged or
unreadable entry is a miss: it is removed and recomputed. The store is capped (oldest-used entries are evicted
first; an entry larger than the cap is not stored): a 27B drafter's Hessians are ~10 GB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

import dflash_quant
from dflash_quant.calibration import cache as calib_cache
from dflash_quant.calibration.capture import CalibrationStats
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.cache_dirs import calib_store_dir
from dflash_quant.speculative.check_cache import model_identity

_STALE_S = 24 * 3600  # a temp or trash folder this old belongs to a run that died: removed on the next write


def default_dir() -> Path:
    """~/.cache/dflash-quant/calib (or under $XDG_CACHE_HOME), beside the check cache."""
    return calib_store_dir()


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    """Rename out of the way first, so a reader never opens a half-deleted entry."""
    trash = path.with_name(f".trash-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except OSError:  # already gone (another run evicted or replaced it)
        return
    shutil.rmtree(trash, ignore_errors=True)


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
            self._evict(size, keep=entry)
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
        return [
            p
            for p in self.directory.iterdir()
            if not p.name.startswith(".") and not p.is_symlink() and p.is_dir() and (p / calib_cache.META).is_file()
        ]

    def _evict(self, incoming: int, keep: Path) -> None:
        """Remove the least recently used entries until the store plus `incoming` bytes fits the cap."""
        sized = []
        for p in self._entries():
            try:
                sized.append((p.stat().st_mtime, _size(p), p))
            except OSError:  # removed by another run meanwhile
                continue
        total = sum(s for _, s, p in sized if p != keep)
        for _, s, p in sorted(sized, key=lambda x: x[0]):
            if total + incoming <= self.max_bytes:
                break
            if p != keep:
                _remove(p)
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
