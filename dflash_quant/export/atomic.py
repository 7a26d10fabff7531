"""Write an output directory atomically: build it beside the target, rename at the end."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from dflash_quant.errors import UsageError


def check_output_dir(final: Path, overwrite: bool) -> None:
    final = Path(final)
    if final.exists() and not overwrite:
        raise UsageError(f"output directory {final} already exists; pass --overwrite or choose another --output")
    if final.exists() and not final.is_dir():
        raise UsageError(f"output path {final} exists and is not a directory; choose another --output")


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir in final's parent; on success it replaces final, on any error (Ctrl-C too) it is removed."""
    final = Path(final)
    check_output_dir(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{tmp.name[-8:]}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
