"""`--device-map` / `--max-memory` / `--hessian-device` parsed and checked before anything loads: a strategy name
or an explicit {module: device} map, devices that exist. Applying a placement to a model is models.devmap's."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_quant.errors import UsageError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


PLACES = ("cpu", "disk")


@dataclass
class Placement:
    """Where the target's modules live: a strategy name or an explicit {module: device} map."""

    device_map: str | dict[str, str | int]
    max_memory: dict[str | int, str] | None = None
    offload_dir: Path | None = None  # for "disk" entries; a temp dir by default
    _tmp: Any = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        mem = None if self.max_memory is None else {str(k): v for k, v in self.max_memory.items()}
        return {"device_map": self.device_map, "max_memory": mem}

    def offload_folder(self) -> str:
        if self.offload_dir is not None:
            return str(self.offload_dir)
        if self._tmp is None:  # lives as long as the placement (and so the loaded model)
            self._tmp = tempfile.TemporaryDirectory(prefix="dflash-quant-offload-")
        return self._tmp.name


def _gpu_count() -> int:
    import torch  # only for a GPU index: a map of cpu/disk and the CLI's refusals stay torch-free

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(value: Any, option: str) -> str | int:
    """One device of a map or a --max-memory key: a GPU index, cuda:N, cpu or disk; GPUs must exist."""
    if isinstance(value, bool):
        raise UsageError(f"{option}: device {value!r} is not a device; use a GPU index, cuda:N, cpu or disk")
    if isinstance(value, str) and value in PLACES:
        return value
    index: int | None = None
    if isinstance(value, int):
        index = value
    elif isinstance(value, str) and (m := re.fullmatch(r"(?:cuda:)?(\d+)", value.strip())):
        index = int(m.group(1))
    if index is None:
        raise UsageError(f"{option}: unknown device {value!r}; use a GPU index (0), cuda:N, cpu or disk")
    if index >= _gpu_count():
        have = _gpu_count()
        seen = f"only {have} GPU(s) are visible" if have else "no CUDA GPU is visible"
        raise UsageError(f"{option}: device {value!r} does not exist ({seen}); use cpu/disk or a visible GPU")
    return index


def parse_max_memory(text: str | None) -> dict[str | int, str] | None:
    """`0=20GiB,cpu=64GiB` -> {0: '20GiB', 'cpu': '64GiB'}; sizes as accelerate reads them (GiB, GB, MiB, bytes)."""
    if text is None or not text.strip():
        return None
    from accelerate.utils import convert_file_size_to_int

    out: dict[str | int, str] = {}
    for part in text.split(","):
        key, sep, size = part.partition("=")
        if not sep or not key.strip() or not size.strip():
            raise UsageError(f"--max-memory entry {part.strip()!r} is not DEVICE=SIZE; e.g. 0=20GiB,cpu=64GiB")
        dev = _device(key.strip(), "--max-memory")
        if dev == "disk":
            raise UsageError("--max-memory: disk has no limit to set; list GPUs and cpu only")
        try:
            if convert_file_size_to_int(size.strip()) <= 0:
                raise ValueError
        except (ValueError, TypeError, AttributeError):
            raise UsageError(f"--max-memory: size {size.strip()!r} is not a size; use e.g. 20GiB or 500MiB") from None
        out[dev] = size.strip()
    return out


def parse_device_map(text: str | None) -> str | dict[str, str | int] | None:
    """A strategy name, inline JSON, or a JSON file of {module name: device}."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if text in STRATEGIES:
        return text
    if text.startswith("{"):
        raw = text
    elif Path(text).is_file():
        raw = Path(text).read_text()
    else:
        raise UsageError(
            f"--device-map {text!r} is neither {', '.join(STRATEGIES)}, a JSON object, nor an existing JSON file"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--device-map is not valid JSON ({exc.msg} at char {exc.pos}); fix the map") from None
    if not isinstance(value, dict) or not value:
        raise UsageError("--device-map JSON must be a non-empty object {module name: device}")
    return {str(k): _device(v, "--device-map") for k, v in value.items()}


def make_placement(device_map: str | None, max_memory: str | None) -> Placement | None:
    """Parsed and device-checked flags (before anything loads); None when the target stays on one device."""
    dmap = parse_device_map(device_map)
    mem = parse_max_memory(max_memory)
    if dmap is None:
        if mem is not None:
            raise UsageError("--max-memory needs --device-map (auto, balanced, ...); add --device-map auto")
        return None
    if mem is not None and isinstance(dmap, dict):
        raise UsageError("--max-memory applies to a strategy (auto, balanced, ...), not to an explicit JSON map")
    return Placement(dmap, mem)


def check_hessian_device(name: str | None) -> None:
    """--hessian-device: cpu or a visible cuda[:N]."""
    if name is None or name == "cpu":
        return
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m is None:
        raise UsageError(f"--hessian-device {name!r} is not a device; use cpu or cuda[:N]")
    _device(int(m.group(1) or 0), "--hessian-device")
