"""Checkpoints of an unfinished calibration, so an interrupted `gptq` resumes instead of starting over.

One safetensors file holds the Hessians (fp32 sums and row counts), the per-step acceptance lengths, the
replay recorded so far (--sequential) and, in its metadata, the key and the number of prompts done. It is
written to a temp name and renamed, so a kill at any moment leaves the previous checkpoint or the new one,
never a torn file. The key (drafter and target hashes, prompt ids, settings) must match exactly to resume.
It lives in --calib-cache when given, else in the calibration store's slot for the key (calibration.store).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash_quant.calibration.capture import CaptureState, DraftCall
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import replace_atomic

FILE = "calib-checkpoint.safetensors"


@dataclass(frozen=True)
class Kept:
    """Where a calibration checkpoints, for the message of an interrupted run. The prompts done are read back
    from the file, not remembered: a signal can land between the rename and any bookkeeping after it."""

    path: Path
    key: dict[str, Any]
    total: int

    def done(self) -> int | None:
        """Prompts the checkpoint on disk holds, or None when there is none for this key."""
        try:
            with safe_open(str(self.path), framework="pt") as fh:
                meta = fh.metadata() or {}
        except (SafetensorError, OSError, ValueError):
            return None
        if meta.get("key") != json.dumps(self.key, sort_keys=True):
            return None  # another calibration's checkpoint (this run would have replaced it)
        try:
            return int(meta["done"])
        except (KeyError, ValueError):
            return None


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()


def _tensors(state: CaptureState) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {"lengths": torch.tensor(state.lengths, dtype=torch.int64)}
    for name, acc in state.hessians.items():
        for part, t in acc.state_dict().items():
            tensors[f"h.{name}.{part}"] = t.detach().cpu().contiguous()
    for p, calls in enumerate(state.replay or []):
        for c, call in enumerate(calls):
            for part in ("noise", "ctx", "positions", "labels"):
                if getattr(call, part) is not None:
                    tensors[f"r.{p}.{c}.{part}"] = getattr(call, part).contiguous()
    return tensors


def nbytes(state: CaptureState) -> int:
    """The checkpoint's tensor bytes (its file adds a small header), counted before anything is copied."""
    hessians = sum(4 * acc.in_features**2 + 8 for acc in state.hessians.values())  # fp32 xtx, int64 rows
    calls = [call for calls in state.replay or [] for call in calls]
    parts = [t for call in calls for t in (call.noise, call.ctx, call.positions, call.labels) if t is not None]
    replay = sum(t.numel() * t.element_size() for t in parts)
    return hessians + replay + 8 * len(state.lengths)


def save(directory: Path, key: dict[str, Any], state: CaptureState) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(state)
    meta = {"key": json.dumps(key, sort_keys=True), "done": str(state.done), "replay": str(state.replay is not None)}
    path = directory / FILE
    return replace_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load(directory: Path, key: dict[str, Any], device: torch.device) -> CaptureState | None:
    """The checkpoint in `directory` if it was written under the same key, else None (it is not used)."""
    path = directory / FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("key") != json.dumps(key, sort_keys=True):
                return None
            flat = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise DFlashQuantError(f"{path} is damaged ({exc}); delete it to calibrate from the start") from exc
    hessians: dict[str, HessianAccumulator] = {}
    for name in sorted({k[2:].rsplit(".", 1)[0] for k in flat if k.startswith("h.")}):
        hessians[name] = HessianAccumulator.from_state_dict(
            {"xtx": flat[f"h.{name}.xtx"], "rows": flat[f"h.{name}.rows"]}, name=name, device=device
        )
    done = int(meta["done"])
    replay = None
    if meta.get("replay") == "True":
        replay = []
        for p in range(done):
            n_calls = sum(1 for k in flat if k.startswith(f"r.{p}.") and k.endswith(".noise"))
            replay.append(
                [
                    DraftCall(
                        flat[f"r.{p}.{c}.noise"],
                        flat[f"r.{p}.{c}.ctx"],
                        flat[f"r.{p}.{c}.positions"],
                        flat.get(f"r.{p}.{c}.labels"),
                    )
                    for c in range(n_calls)
                ]
            )
    return CaptureState(done, hessians, flat["lengths"].tolist(), replay)


def clear(directory: Path) -> None:
    (directory / FILE).unlink(missing_ok=True)
