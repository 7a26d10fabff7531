"""The artifact's reports as typed classes, each with one reader and one writer (contract: docs/artifact.md).

Every stage that writes or reads provenance.json, quant_report.json, parity.json, memory.json (and the
budget inside it) or manifest.json goes through this package; nothing else parses those files.
"""

from dflash_quant.artifact.files import (
    portable_path,
    replace_atomic,
    sha256_file,
    sha256_files,
    write_json_atomic,
)
from dflash_quant.artifact.reports import (
    Budget,
    BudgetForm,
    Check,
    LayerReport,
    Manifest,
    MemoryReport,
    Parity,
    Provenance,
    QuantReport,
    SourceRef,
)

__all__ = [
    "Budget",
    "BudgetForm",
    "Check",
    "LayerReport",
    "Manifest",
    "MemoryReport",
    "Parity",
    "Provenance",
    "QuantReport",
    "SourceRef",
    "portable_path",
    "replace_atomic",
    "sha256_file",
    "sha256_files",
    "write_json_atomic",
]
