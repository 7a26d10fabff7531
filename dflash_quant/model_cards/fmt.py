"""How the card writes values: a missing one is "not measured", never an invented number."""

from __future__ import annotations

from typing import Any

NOT_MEASURED = "not measured"


def fmt_float(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    return f"{float(value):.{digits}f}"


def fmt_pct(value: Any, digits: int = 1) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    return f"{float(value) * 100:.{digits}f}%"


def fmt_bytes(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    n = int(value)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def fmt_bool(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "**no**"
    return NOT_MEASURED


def fmt_any(value: Any) -> str:
    if value is None:
        return NOT_MEASURED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) if value else "none"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def missing(name: str, problem: str, how: str) -> str:
    return f"_{NOT_MEASURED}: `{name}` is {problem} in this artifact ({how})._"
