"""Dataclass <-> JSON with type checks, for the report classes.

A record's fields are its documented keys (metadata "doc"); keys it does not know are kept in `extra` and
written back unchanged, so a report written by a newer version survives a read-modify-write by an older one.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import loads_json, read_json, write_json_atomic


def doc(text: str, *, required: bool = False, default: Any = None, factory: Any = None, omit_none: bool = False) -> Any:
    """A documented field; optional ones default to None (absent from older artifacts). `omit_none`: not
    written when None (rarely set keys)."""
    meta = {"doc": text, "required": required, "omit_none": omit_none}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Malformed(ValueError):
    """A value that does not have its documented type; `where` is the dotted key."""

    def __init__(self, where: str, expected: str):
        super().__init__(f"field {where!r} must be {expected}")


_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


def _plural(name: str) -> str:
    # "a list of numbers" -> "lists of numbers"; "an integer" -> "integers"
    head, _, rest = name.removeprefix("a ").removeprefix("an ").partition(" of ")
    return f"{head}s of {rest}" if rest else f"{head}s"


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in parts) + (" or null" if len(parts) < len(typing.get_args(tp)) else "")
    if origin is list:
        return f"a list of {_plural(type_name(typing.get_args(tp)[0]))}"
    if origin is dict:
        return f"an object of {_plural(type_name(typing.get_args(tp)[1]))}"
    if tp is Any:
        return "any JSON value"
    if isinstance(tp, type) and issubclass(tp, Record):
        return "an object"
    return _NAMES.get(tp, str(tp))


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:  # Optional[X]: X's own message names the deepest bad key
            return _convert(value, real[0], where)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except Malformed:
                continue
        raise Malformed(where, type_name(tp))
    if origin is list:
        if not isinstance(value, list):
            raise Malformed(where, type_name(tp))
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise Malformed(where, type_name(tp))
        _, item = typing.get_args(tp)
        return {str(k): _convert(v, item, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp._from(value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Malformed(where, "a number")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Malformed(where, "an integer")
        return value
    if not isinstance(value, tp):
        raise Malformed(where, type_name(tp))
    return value


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


class Record:
    """Base of every report part: typed fields from docs, unknown keys kept in `extra`."""

    @classmethod
    def fields(cls) -> list[tuple[str, Any, dict]]:
        hints = typing.get_type_hints(cls)
        return [
            (f.name, hints[f.name], dict(f.metadata))
            for f in dataclasses.fields(typing.cast(Any, cls))
            if f.name != "extra"
        ]

    @classmethod
    def _from(cls, data: Any, where: str = ""):
        if not isinstance(data, dict):
            raise Malformed(where or "(top level)", "an object")
        kwargs: dict[str, Any] = {}
        for name, tp, meta in cls.fields():
            key = f"{where}.{name}" if where else name
            if name not in data:
                if meta.get("required"):
                    raise Malformed(key, f"present ({type_name(tp)})")
                continue
            kwargs[name] = _convert(data[name], tp, key)
        known = {name for name, _, _ in cls.fields()}
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs)

    @classmethod
    def from_dict(cls, data: Any):
        """Parse a JSON object; raises Malformed naming the first bad key."""
        return cls._from(data)

    def to_dict(self) -> dict[str, Any]:
        out = {
            name: _dump(getattr(self, name))
            for name, _, meta in self.fields()
            if not (meta.get("omit_none") and getattr(self, name) is None)
        }
        out.update(getattr(self, "extra", {}) or {})
        return out


class ReportFile(Record):
    """A record stored as one JSON file of the artifact: one reader (`read`) and one writer (`write`)."""

    FILE: ClassVar[str]
    WRITER: ClassVar[str]  # which stage writes it (docs and error messages)
    FIX: ClassVar[str]  # what to run when it is malformed

    @classmethod
    def load_json(cls, directory: Path) -> tuple[Any, str | None]:
        """(parsed JSON, None) or (None, why not): the only place these files are parsed."""
        return read_json(Path(directory) / cls.FILE)

    @classmethod
    def loads(cls, raw: bytes) -> tuple[Any, str | None]:
        """(parsed JSON, None) or (None, why not) for bytes already read (push hashes what it parses)."""
        return loads_json(raw)

    @classmethod
    def problem(cls, directory: Path) -> tuple[Any, str | None]:
        """(report, None) or (None, why it cannot be used), never raising: for stages that report absence."""
        data, problem = cls.load_json(directory)
        if problem:
            return None, problem
        try:
            return cls.from_dict(data), None
        except Malformed as exc:
            return None, str(exc)

    @classmethod
    def read(cls, directory: Path, *, optional: bool = False):
        """The report, or a one-line DFlashQuantError naming the file and the fix (None if optional and absent)."""
        report, problem = cls.problem(directory)
        if problem == "is missing" and optional:
            return None
        if problem:
            raise DFlashQuantError(f"{Path(directory) / cls.FILE} {problem}; {cls.FIX}")
        return report

    def write(self, directory: Path) -> Path:
        return write_json_atomic(Path(directory) / self.FILE, self.to_dict())
