"""Per-Linear sensitivity table for the mixed-precision search, built from a captured calibration and cached
beside it (sensitivity.json in the --calib-cache directory, keyed like the calibration itself).

Each entry is (GPTQ v1 bytes, relative output error trace(E H E^T) / trace(W H W^T)) for one candidate
(bits, group size, and how GPTQ solves it: plain, act-order with static groups, clip search, or both)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_quant.calibration.capture import CalibrationStats
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.atomic import write_json_atomic
from dflash_quant.quantize.mixed import Candidate, candidate_errors, packed_bytes

TABLE = "sensitivity.json"
Table = dict[str, dict[Candidate, tuple[int, float]]]


def build_table(
    weights: Mapping[str, torch.Tensor], stats: CalibrationStats, candidates: Sequence[Candidate], *, sym: bool = True
) -> Table:
    if not candidates:
        raise UsageError("no candidate settings to measure; pass at least one bits/group pair")
    table: Table = {}
    for name, W in weights.items():
        H = stats.for_linear(name).hessian()
        ref = float(((W.float() @ H.float()) * W.float()).sum())
        if not ref > 0:
            raise DFlashQuantError(f"Linear {name!r}: zero output energy on the calibration rows; recollect")
        errs = candidate_errors(W, H, candidates, sym=sym)
        table[name] = {c: (packed_bytes(W.shape[0], W.shape[1], c), e / ref) for c, e in errs.items()}
    return table


def save_table(directory: Path, table: Table, key: dict[str, Any]) -> Path:
    rows = {
        name: [
            {"bits": c.bits, "group_size": c.group_size, "act": c.act, "clip": c.clip, "bytes": b, "rel_error": e}
            for c, (b, e) in cands.items()
        ]
        for name, cands in table.items()
    }
    return write_json_atomic(directory / TABLE, {"key": key, "linears": rows})


def load_table(directory: Path, key: dict[str, Any]) -> Table | None:
    """The cached table if it was built with the same key, else None."""
    path = directory / TABLE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashQuantError(f"{path} is damaged ({exc.msg}); delete it and the search rebuilds it") from exc
    if data.get("key") != key:
        return None
    return {
        name: {
            Candidate(r["bits"], r["group_size"], bool(r.get("act")), bool(r.get("clip"))): (
                int(r["bytes"]),
                float(r["rel_error"]),
            )
            for r in rows
        }
        for name, rows in data["linears"].items()
    }


def save_curve(directory: Path, key: dict[str, Any], curve_key: dict[str, Any], curve: dict[str, Any]) -> Path:
    """Store the loss -> tau map (dev-prompt measurements) in the table's file, beside the table it used."""
    path = directory / TABLE
    data = json.loads(path.read_text()) if path.is_file() else {}
    if data.get("key") != key:
        raise DFlashQuantError(f"{path} holds another calibration's table; the tau map is stored beside its own table")
    data["tau_calibration"] = {"key": curve_key, **curve}
    return write_json_atomic(path, data)


def load_curve(directory: Path, key: dict[str, Any], curve_key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached tau map if it was measured for this table and these dev prompts, else None."""
    path = directory / TABLE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    cal = data.get("tau_calibration")
    if data.get("key") != key or not cal or cal.get("key") != curve_key:
        return None
    return {k: v for k, v in cal.items() if k != "key"}  # tau_bf16, per_prompt (the bootstrap's data), points
