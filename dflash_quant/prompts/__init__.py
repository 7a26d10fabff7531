"""Prompt sets for calibration and the acceptance check.

Specs understood by :func:`load_prompts`:

- ``builtin`` / ``builtin:calib`` / ``builtin:heldout``: the project's own mix (``builtin.jsonl``:
  code, math, chat and "reproduce" prompts, split into disjoint calibration and held-out halves);
- ``reference:calib`` / ``reference:heldout``: the shipped reference pair's prompt files;
  ``reference-dflash2:calib`` / ``reference-dflash2:heldout``: the second (DFlash2) pair's;
- a path to a ``.txt`` file (one prompt per line, blank lines skipped) or a ``.jsonl`` file (one object a
  line with a ``prompt`` string or a ``messages`` list of ``{role, content}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_quant.errors import UsageError

BUILTIN = Path(__file__).resolve().parent / "builtin.jsonl"
SPLITS = ("calib", "heldout")
CATEGORIES = ("code", "math", "chat", "reproduce")
REFERENCE_PAIR_DIR = Path(__file__).resolve().parent.parent / "reference" / "pair"
REFERENCE_DFLASH2_DIR = Path(__file__).resolve().parent.parent / "reference" / "dflash2_pair"
REFERENCE_FILES = {"calib": "calibration_prompts.jsonl", "heldout": "heldout_prompts.jsonl"}


@dataclass(frozen=True)
class Prompt:
    """One prompt: raw ``text`` or chat ``messages`` (a list of {role, content}); exactly one is set."""

    id: str
    category: str | None = None
    split: str | None = None
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a Prompt needs exactly one of text or messages")

    def as_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text or ""}]

    def as_text(self) -> str:
        """The prompt as plain text (messages' contents joined by blank lines)."""
        if self.text is not None:
            return self.text
        return "\n\n".join(m["content"] for m in self.messages or ())


def _parse_messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"{where}: messages[{i}] must be an object with string `role` and `content`")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _read_text(path: Path) -> str:
    """A prompt file's text; binary or non-UTF-8 content is refused naming the first bad byte."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{path} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "save it as UTF-8 (one prompt per line, or JSON lines)"
        ) from exc
    if "\0" in text:
        raise UsageError(f"{path} is binary (NUL at byte {data.index(0)}); pass a UTF-8 .txt or .jsonl prompt file")
    return text


def _read_jsonl(path: Path, default_split: str | None = None) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        if not isinstance(row, dict):
            raise UsageError(f"{where}: expected a JSON object with `prompt` or `messages`")
        text, messages = row.get("prompt"), row.get("messages")
        if (text is None) == (messages is None):
            raise UsageError(f"{where}: give exactly one of `prompt` (a string) or `messages` (a list)")
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise UsageError(f"{where}: `prompt` must be a non-empty string")
        prompts.append(
            Prompt(
                id=str(row.get("id", f"{path.stem}-{n}")),
                category=row.get("category"),
                split=row.get("split", default_split),
                text=text,
                messages=_parse_messages(messages, where) if messages is not None else None,
            )
        )
    return prompts


def _read_txt(path: Path) -> list[Prompt]:
    lines = _read_text(path).splitlines()
    return [Prompt(id=f"{path.stem}-{n}", text=line) for n, line in enumerate(lines, 1) if line.strip()]


def _split_of(spec: str, name: str) -> str | None:
    _, _, split = spec.partition(":")
    if not split:
        return None
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r} in prompt set {spec!r}; use {name}, {name}:calib or {name}:heldout")
    return split


def load_prompts(spec: str | Path) -> list[Prompt]:
    """Prompts for a spec (see the module docstring); raises UsageError with the fix on any problem."""
    text = str(spec).strip()
    if text == "builtin" or text.startswith("builtin:"):
        split = _split_of(text, "builtin")
        prompts = [p for p in _read_jsonl(BUILTIN) if split is None or p.split == split]
    elif text.partition(":")[0] in ("reference", "reference-dflash2"):
        name = text.partition(":")[0]
        split = _split_of(text, name)
        if split is None:
            raise UsageError(f"use {name}:calib or {name}:heldout (the reference pair keeps them apart)")
        path = (REFERENCE_PAIR_DIR if name == "reference" else REFERENCE_DFLASH2_DIR) / REFERENCE_FILES[split]
        if not path.is_file():
            raise UsageError(
                f"the reference pair's prompt file {path} is missing; build the reference pair first "
                "(scripts/reference_pair/train.py) or pass builtin / a prompt file"
            )
        prompts = _read_jsonl(path, default_split=split)
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            raise UsageError(f"prompt set {text!r} is a directory; pass a .txt or .jsonl prompt file")
        if not path.is_file():
            raise UsageError(
                f"prompt set {text!r} is neither builtin[:calib|:heldout], reference[-dflash2]:calib|heldout, "
                "nor an existing .txt/.jsonl file"
            )
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            prompts = _read_jsonl(path)
        elif suffix == ".txt":
            prompts = _read_txt(path)
        else:
            raise UsageError(
                f"{path}: unknown prompt file type {suffix or '(none)'!r}; use .txt (one per line) or .jsonl"
            )
    if not prompts:
        raise UsageError(f"prompt set {text!r} is empty; add prompts or pick another set")
    return prompts


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt | str, chat_template: bool = True) -> list[int]:
    """Token ids for a prompt: through the tokenizer's chat template (with the generation prompt) when it
    has one and ``chat_template`` is true, else the plain encoding of the text (default special tokens)."""
    if isinstance(prompt, str):
        prompt = Prompt(id="inline", text=prompt)
    if chat_template and has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(prompt.as_messages(), add_generation_prompt=True, tokenize=False)
        # the template already holds any BOS / special tokens it wants
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.as_text())["input_ids"])


__all__ = ["BUILTIN", "CATEGORIES", "Prompt", "SPLITS", "encode_prompt", "has_chat_template", "load_prompts"]
