"""Shape check of an artifact's provenance.json before `card` or `push` rely on it (artifact.reports.Provenance)."""

from __future__ import annotations

from pathlib import Path

from dflash_quant.artifact.reports import Provenance
from dflash_quant.errors import DFlashQuantError

PROVENANCE = Provenance.FILE


def provenance_problem(root: Path) -> str | None:
    """Why provenance.json cannot be used (None when it is absent or well formed)."""
    _, problem = Provenance.problem(Path(root))
    return None if problem == "is missing" else problem


def check_provenance(root: Path) -> None:
    problem = provenance_problem(root)
    if problem:
        raise DFlashQuantError(f"{Path(root) / PROVENANCE} {problem}; {Provenance.FIX}")
