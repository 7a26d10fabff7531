"""Generate the report schemas of docs/artifact.md from the classes in artifact.reports.

`python -m dflash_quant.artifact.docgen` rewrites the part between the markers; tests/test_artifact_contract.py
fails when the committed doc differs from what this produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_quant.artifact.reports import REPORT_FILES, Budget, Check
from dflash_quant.artifact.schema import Record, ReportFile, type_name

BEGIN = "<!-- BEGIN GENERATED: python -m dflash_quant.artifact.docgen -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "artifact.md"


def _nested(tp) -> type[Record] | None:
    import typing

    if isinstance(tp, type) and issubclass(tp, Record):
        return tp
    for arg in typing.get_args(tp):
        inner = _nested(arg)
        if inner:
            return inner
    return None


def _table(cls: type[Record]) -> tuple[list[str], list[type[Record]]]:
    lines = ["| key | type | what |", "|---|---|---|"]
    children: list[type[Record]] = []
    for name, tp, meta in cls.fields():
        child = _nested(tp)
        kind = type_name(tp)
        if child is not None:
            kind = kind.replace("an object", f"`{child.__name__}`").replace("objects", f"`{child.__name__}`s")
            children.append(child)
        text = meta.get("doc", "") + (" (required)" if meta.get("required") else "")
        lines.append(f"| `{name}` | {kind} | {text} |")
    return lines, children


def render() -> str:
    out = [
        BEGIN,
        "",
        "Every key below is a field of the class named in the heading (`dflash_quant.artifact.reports`); a key "
        "that is absent or null means not recorded. Keys a reader does not know are kept and written back "
        "unchanged. Each report has one reader (`Class.read(dir)`, a one-line error naming the file and the "
        "fix when malformed) and one writer (`report.write(dir)`, an atomic JSON write).",
        "",
    ]
    seen: set[type[Record]] = set()
    queue: list[type[Record]] = [*REPORT_FILES]
    for extra in (Check, Budget):
        if extra not in queue:
            queue.append(extra)
    while queue:
        cls = queue.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        head = (
            f"### `{cls.FILE}`: `{cls.__name__}` (written by {cls.WRITER})"
            if issubclass(cls, ReportFile) and hasattr(cls, "FILE")
            else f"### `{cls.__name__}`"
        )
        out += [head, ""]
        if cls.__doc__ and not hasattr(cls, "FILE") and not cls.__doc__.startswith(cls.__name__ + "("):
            out += [cls.__doc__.strip(), ""]
        lines, children = _table(cls)
        out += lines + [""]
        queue = [c for c in children if c not in seen] + queue
    out.append(END)
    return "\n".join(out)


def updated(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render() + text[end:]


def main() -> None:
    text = DOC.read_text(encoding="utf-8")
    new = updated(text)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == text else f"{DOC} is out of date; run python -m dflash_quant.artifact.docgen")
    DOC.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
