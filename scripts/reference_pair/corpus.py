"""The reference pair's training corpus: Python standard-library sources.

Every machine that runs the package has a Python standard library, so the corpus needs no download. The
files are split into train and held-out parts by a hash of their path relative to the corpus root, so the
split is the same on every machine and does not depend on the file-system order.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names skipped anywhere in the tree: installed
# third-party packages, generated data modules and the codec tables of encodings/ (long, trivially predictable).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data", "ensurepip", "encodings"})
MAX_FILE_BYTES = 300_000
HELDOUT_PERCENT = 5


@dataclass(frozen=True)
class Document:
    relpath: str
    text: str

    @property
    def split(self) -> str:
        return split_of(self.relpath)


def default_corpus_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'heldout' for about HELDOUT_PERCENT % of the files, chosen by a hash of the relative path; else 'train'."""
    digest = hashlib.sha256(relpath.replace("\\", "/").encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT else "train"


def iter_source_files(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size < 200:
            continue
        out.append(path)
    return out


def load_corpus(root: Path | None = None) -> list[Document]:
    """All usable documents under ``root`` (default: the stdlib), sorted by relative path."""
    root = Path(root) if root is not None else default_corpus_dir()
    docs = []
    for path in iter_source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n")
        docs.append(Document(path.relative_to(root).as_posix(), text))
    if not docs:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return docs


def split_corpus(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if d.split == "train"]
    heldout = [d for d in docs if d.split == "heldout"]
    return train, heldout
