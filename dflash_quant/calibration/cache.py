"""Save and reuse captured calibration statistics (safetensors + a JSON key), so re-quantizing skips the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_quant.calibration.capture import CalibrationStats, DraftCall
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import check_writable_dir, replace_atomic, write_json_atomic

STATS = "hessians.safetensors"
REPLAY = "replay.safetensors"
META = "calibration.json"


def check_location(directory: Path) -> Path:
    """A usable --calib-cache: a directory (or creatable), writable; checked before any compute."""
    return check_writable_dir(directory, "--calib-cache")


def save(directory: Path, stats: CalibrationStats, key: dict[str, Any]) -> None:
    directory = check_location(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # no entry while the files change: a reader that finds the key finds the tensors written with it
    (directory / META).unlink(missing_ok=True)
    tensors = {}
    for name, acc in stats.hessians.items():
        for part, t in acc.state_dict().items():
            tensors[f"{name}.{part}"] = t.cpu()
    _atomic_save(tensors, directory / STATS)
    if stats.replay is not None:
        rep = {}
        for p, calls in enumerate(stats.replay):
            for c, call in enumerate(calls):
                rep[f"{p}.{c}.noise"], rep[f"{p}.{c}.ctx"], rep[f"{p}.{c}.positions"] = (
                    call.noise,
                    call.ctx,
                    call.positions,
                )
                if call.labels is not None:
                    rep[f"{p}.{c}.labels"] = call.labels
        _atomic_save({k: v.contiguous() for k, v in rep.items()}, directory / REPLAY)
    else:
        # a replay another calibration left here must not pass for this one's (plain GPTQ and gptq-kl can share
        # a key: a later gptq-kl run read 1120 prompts' drafter inputs beside 608 prompts' Hessians)
        (directory / REPLAY).unlink(missing_ok=True)
    meta = {
        "key": key,
        "replay_prompts": None if stats.replay is None else len(stats.replay),
        "kv_hessian": stats.kv_hessian,
        "prompts": stats.prompts,
        "steps": stats.steps,
        "mean_tau": stats.mean_tau,
    }
    write_json_atomic(directory / META, meta)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    replace_atomic(path, lambda tmp: save_file(tensors, str(tmp)))  # with the umask's permissions: a shared cache


def load(directory: Path, key: dict[str, Any], need_replay: bool, device: torch.device) -> CalibrationStats | None:
    """Cached stats if the directory holds ones captured with the same key, else None."""
    directory = check_location(directory)
    meta_path = directory / META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashQuantError(f"{meta_path} is damaged ({exc.msg}); delete the --calib-cache directory") from exc
    if meta.get("key") != key:
        return None
    if need_replay and (meta.get("replay_prompts") is None or not (directory / REPLAY).is_file()):
        return None  # no replay written with this key (entries from before replay_prompts are recaptured)
    try:
        flat = load_file(str(directory / STATS))
    except (SafetensorError, OSError) as exc:
        raise DFlashQuantError(f"{directory / STATS} is damaged ({exc}); delete the --calib-cache directory") from exc
    hessians = {}
    for name in sorted({k.rsplit(".", 1)[0] for k in flat}):
        acc = HessianAccumulator.from_state_dict(
            {"xtx": flat[f"{name}.xtx"], "rows": flat[f"{name}.rows"]}, name=name, device=device
        )
        assert acc.xtx is not None  # from_state_dict always loads one
        if not torch.isfinite(acc.xtx).all():
            raise DFlashQuantError(
                f"cached Hessian {name} contains NaN/inf; delete the --calib-cache directory and recollect"
            )
        hessians[name] = acc
    replay = None
    if need_replay:
        rep = load_file(str(directory / REPLAY))
        n_prompts = 1 + max(int(k.split(".")[0]) for k in rep) if rep else 0
        if n_prompts != meta["replay_prompts"]:
            return None  # the replay file changed under the key (another run saving here): capture again
        if any(k.endswith(".noise") and k[: -len("noise")] + "labels" not in rep for k in rep):
            return None  # recorded before the target's tokens were kept beside each call: capture again
        replay = []
        for p in range(n_prompts):
            n_calls = len([k for k in rep if k.startswith(f"{p}.") and k.endswith(".noise")])
            replay.append(
                [
                    DraftCall(
                        rep[f"{p}.{c}.noise"],
                        rep[f"{p}.{c}.ctx"],
                        rep[f"{p}.{c}.positions"],
                        rep.get(f"{p}.{c}.labels"),
                    )
                    for c in range(n_calls)
                ]
            )
    return CalibrationStats(
        hessians=hessians,
        kv_hessian=meta["kv_hessian"],
        prompts=meta["prompts"],
        steps=meta["steps"],
        mean_tau=meta.get("mean_tau"),
        replay=replay,
    )
