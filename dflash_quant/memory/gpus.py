"""Named GPUs and byte-size parsing for `dflash-quant budget --gpu ...`.

Capacities are the *nominal* memory of each card (what the vendor sells: 24 GB on an RTX 4090 is
24 GiB of GDDR6X). The driver reports a little less (nvidia-smi's `memory.total`, after ECC and
firmware reservations), and the CUDA context takes a few hundred MiB more; the budget covers those with
its runtime overhead and the engine's utilisation fraction. For an exact figure pass the byte count from
`nvidia-smi --query-gpu=memory.total --format=csv` (e.g. `--gpu 24564MiB`).

Units are strict: `GB`/`MB`/`KB`/`TB` are powers of 1000, `GiB`/`MiB`/`KiB`/`TiB` powers of 1024,
a bare number is bytes. `24GB` is therefore 24e9 bytes (22.35 GiB), not a 24 GiB card; use a card name
or `24GiB` for that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_quant.errors import UsageError

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class GPU:
    name: str
    total_bytes: int
    description: str


# Nominal capacities (vendor spec sheets). Aliases map to the same entry.
_GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU("rtx3090", 24 * GiB, "NVIDIA GeForce RTX 3090, 24 GiB GDDR6X"),
        GPU("rtx3090ti", 24 * GiB, "NVIDIA GeForce RTX 3090 Ti, 24 GiB GDDR6X"),
        GPU("rtx4090", 24 * GiB, "NVIDIA GeForce RTX 4090, 24 GiB GDDR6X"),
        GPU("rtx5090", 32 * GiB, "NVIDIA GeForce RTX 5090, 32 GiB GDDR7"),
        GPU("rtx4080", 16 * GiB, "NVIDIA GeForce RTX 4080, 16 GiB GDDR6X"),
        GPU("a10g", 24 * GiB, "NVIDIA A10G (AWS g5), 24 GiB GDDR6"),
        GPU("a10", 24 * GiB, "NVIDIA A10, 24 GiB GDDR6"),
        GPU("l4", 24 * GiB, "NVIDIA L4, 24 GiB GDDR6"),
        GPU("a6000", 48 * GiB, "NVIDIA RTX A6000, 48 GiB GDDR6"),
        GPU("l40s", 48 * GiB, "NVIDIA L40S, 48 GiB GDDR6"),
        GPU("a100-40gb", 40 * GiB, "NVIDIA A100 40GB"),
        GPU("a100-80gb", 80 * GiB, "NVIDIA A100 80GB"),
        GPU("h100", 80 * GiB, "NVIDIA H100 80GB (SXM/PCIe)"),
        GPU("h200", 141 * GiB, "NVIDIA H200, 141 GB HBM3e (nominal; the driver reports ~140 GiB)"),
    ]
}
_ALIASES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "rtx-3090": "rtx3090",
    "rtx-4090": "rtx4090",
    "rtx-5090": "rtx5090",
    "a100": "a100-80gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "rtxa6000": "a6000",
    "rtx-a6000": "a6000",
    "h100-80gb": "h100",
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
    "k": KiB,
    "m": MiB,
    "g": GiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def known_gpus() -> dict[str, GPU]:
    return dict(_GPUS)


def parse_bytes(text: str | int, *, what: str = "size") -> int:
    """'24GiB' -> 25769803776; '24GB' -> 24000000000; '17.8GB'; '1024' (bytes). Raises UsageError."""
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"{what} must not be negative (got {text})")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(
            f"cannot read {what} {text!r}; write a number with a unit such as 24GiB, 22.5GB, 512MiB, or plain bytes"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return int(round(value))


def resolve_gpu(spec: str) -> GPU:
    """A card name (rtx4090, a10g, ...) or a size ('24GiB', '24GB', bytes)."""
    key = str(spec).strip().lower().replace("_", "-").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key in _GPUS:
        return _GPUS[key]
    if (m := _SIZE_RE.match(key)) and m.group(2).lower() in _UNITS:
        total = parse_bytes(key, what="GPU memory")
        if total <= 0:
            raise UsageError(f"GPU memory must be positive (got {spec!r})")
        return GPU(str(spec).strip(), total, f"{total / GiB:.2f} GiB (given)")
    names = ", ".join(sorted(_GPUS))
    raise UsageError(f"unknown GPU {spec!r}; use one of {names}, or a size such as 24GiB")


def fmt_bytes(n: int | float | None) -> str:
    """Binary units, 2 decimals: 1.39 GiB, 144.00 KiB."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
