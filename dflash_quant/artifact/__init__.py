"""The artifact's reports as typed classes, each with one reader and one writer (contract: docs/artifact.md), the
manifest that hashes every file, and how sources are recorded in them (never an absolute path).

Every stage that writes or reads provenance.json, quant_report.json, parity.json, memory.json (and the
budget inside it) or manifest.json goes through this package; nothing else parses those files.
"""
