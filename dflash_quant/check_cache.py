"""Cache of the parity check's runs that do not change between recipes: the target-only baseline and the
bf16 drafter's speculative runs. A second `gptq` with other settings, or a `verify`, reuses them.

Entries are JSON (no pickle) under DIR/<kind>-<key sha256>.json, written atomically (temp file + rename).
The key holds everything the runs depend on: the drafter's weight hash (bf16 runs only), the target's
identity (weight sha256, or for targets over 4 GiB its resolved snapshot path with file names, sizes and
mtimes), the encoded prompt ids, max_new_tokens, temperature, block size, seed, stop tokens, device type,
dtype and the dflash-quant version. A stored entry whose key differs in any part is a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from dflash_quant import __version__
from dflash_quant.artifact.files import replace_atomic
from dflash_quant.decode import GreedyResult, SpecResult
from dflash_quant.io.weights import weight_files, weights_sha256


def default_dir() -> Path:
    """~/.cache/dflash-quant/check (or under $XDG_CACHE_HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-quant" / "check"


_HASH_LIMIT = 4 << 30  # bytes: above this a target is identified by its files' names, sizes and mtimes
_FINGERPRINTS: dict[tuple, str] = {}


def model_identity(path: Path) -> str:
    """sha256 of the weights (small models) or of a stat fingerprint of the weight files (large ones)."""
    files = sorted(weight_files(path))
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if stats not in _FINGERPRINTS:
        if sum(s[1] for s in stats) <= _HASH_LIMIT:
            _FINGERPRINTS[stats] = "sha256:" + weights_sha256(path)
        else:
            _FINGERPRINTS[stats] = "stat:" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    return _FINGERPRINTS[stats]


def check_key(
    *,
    target: str,
    prompts: list[list[int]],
    settings,
    device: torch.device,
    dtype: torch.dtype,
    drafter: str | None = None,
) -> dict[str, Any]:
    """The cache key of one kind of run; `drafter` (its weight hash) only for speculative runs."""
    key = {
        "target": target,
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "num_prompts": len(prompts),
        "max_new_tokens": settings.max_new_tokens,
        "stop_token_ids": sorted(settings.stop_token_ids or []),
        "device": torch.device(device).type,
        "dtype": str(dtype).replace("torch.", ""),
        "version": __version__,
    }
    if drafter is not None:
        key.update(
            drafter=drafter, temperature=settings.temperature, block_size=settings.block_size, seed=settings.seed
        )
        if getattr(settings, "batch", 1) > 1:  # same tokens, but only the first prompts are timed
            key["batch"] = settings.batch
    return key


class CheckCache:
    """get/put of GreedyResult or SpecResult lists; `directory=None` turns the cache off."""

    def __init__(self, directory: Path | None):
        self.directory = None if directory is None else Path(directory).expanduser()
        self.events: dict[str, str] = {}  # kind -> "hit" | "miss" | "off"

    def _path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        assert self.directory is not None, "the cache is off"
        return self.directory / f"{kind}-{digest[:32]}.json"

    def get(self, kind: str, key: dict[str, Any], cls: type) -> list | None:
        if self.directory is None:
            self.events[kind] = "off"
            return None
        path = self._path(kind, key)
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key or entry.get("type") != cls.__name__:
                raise ValueError("key mismatch")
            runs = [cls(**r) for r in entry["runs"]]
        except (OSError, ValueError, TypeError, KeyError):  # absent, torn or foreign: recompute
            self.events[kind] = "miss"
            return None
        self.events[kind] = "hit"
        return runs

    def put(self, kind: str, key: dict[str, Any], runs: list) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(kind, key)
        body = {
            "key": key,
            "type": type(runs[0]).__name__ if runs else "",
            "runs": [dataclasses.asdict(r) for r in runs],
        }
        text = json.dumps(body)
        replace_atomic(path, lambda tmp: tmp.write_text(text))


def cached_runs(cache: CheckCache, kind: str, key: dict[str, Any], cls: type, compute):
    """The runs from the cache, or computed (and stored)."""
    runs = cache.get(kind, key, cls)
    if runs is None:
        runs = compute()
        cache.put(kind, key, runs)
    return runs


__all__ = ["default_dir", "CheckCache", "cached_runs", "check_key", "model_identity", "GreedyResult", "SpecResult"]
