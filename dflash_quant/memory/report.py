"""`memory.json` for an artifact (schema in docs/artifact.md): weights by module/dtype, disk bytes, the bf16
baseline comparison, resident memory measured on a device, the drafter's context KV per token, and
optionally a 24 GB budget."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_quant.artifact.manifest import has_manifest, record_files, require_intact, updating
from dflash_quant.artifact.reports import Budget, MemoryReport
from dflash_quant.artifact.sources import model_label, portable_path
from dflash_quant.io.atomic import signals_raise, write_json_atomic
from dflash_quant.memory.kv import kv_per_token, parse_shape, read_config
from dflash_quant.memory.weights import WeightReport, disk_bytes, weights_from_files

MEMORY_JSON = MemoryReport.FILE


def build_memory_report(
    artifact: Path,
    *,
    baseline: Path | None = None,
    resident: Callable[[], dict[str, Any]] | None = None,
    budget_24gb: Budget | None = None,
    artifact_name: str | None = None,
    baseline_name: str | None = None,
) -> MemoryReport:
    """`resident`: measures what loading it holds (loading.drafter.measure_resident), called once the files are
    read; None: not measured.
    `artifact_name` / `baseline_name`: how to record them (default: their portable form, never absolute)."""

    artifact = Path(artifact)
    rep = weights_from_files(artifact)
    shape = parse_shape(read_config(artifact))
    kv = kv_per_token(shape, "bfloat16")
    report: dict[str, Any] = {
        "artifact": artifact_name or portable_path(artifact),
        "weights": weights_section(rep),
        "disk_bytes": disk_bytes(artifact),
        "baseline": None,
        "resident": None,
        "context_kv_bytes_per_token": kv.uncapped_bytes,
        "context_kv": {
            "dtype": "bfloat16",
            "full_attention_bytes_per_token": kv.full_bytes,
            "sliding_bytes_per_token": kv.sliding_bytes,
            "sliding_window": kv.window,
            "layers": len(shape.layer_types),
        },
        "budget_24gb": budget_24gb.to_dict() if budget_24gb is not None else None,
    }
    if baseline is not None:
        base = weights_from_files(Path(baseline))
        report["baseline"] = {
            "path": baseline_name or model_label(baseline),
            "total_bytes": base.total_bytes,
            "disk_bytes": disk_bytes(Path(baseline)),
            "ratio": round(rep.total_bytes / base.total_bytes, 4) if base.total_bytes else None,
            "saved_bytes": base.total_bytes - rep.total_bytes,
            "by_part": base.by_part,
        }
    if resident is not None:
        res = resident()
        res["packed_bytes"] = rep.total_bytes
        report["resident"] = res
    return MemoryReport.from_dict(report)


def weights_section(rep: WeightReport) -> dict[str, Any]:
    return {
        "total_bytes": rep.total_bytes,
        "by_module": rep.by_module,
        "by_dtype": rep.by_dtype,
        "num_tensors": rep.num_tensors,
        "params": rep.params,
        "quantized_linears": rep.quantized_linears,
        "packed_quantized_bytes": rep.packed_quantized_bytes,
        "dequantized_bf16_bytes": rep.dequantized_bf16_bytes,
        "by_part": rep.by_part,
    }


def restate_for(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """A memory report of the same drafter restated for the files now in `root` (another format of the same
    codes): stored weights, disk bytes, the baseline ratio and the resident packed bytes are this format's;
    the measured resident form, the KV and the budget do not depend on the file format and are kept."""
    rep = weights_from_files(root)
    out = {**data, "weights": weights_section(rep), "disk_bytes": disk_bytes(root)}
    base = out.get("baseline")
    if isinstance(base, dict) and base.get("total_bytes"):
        out["baseline"] = {
            **base,
            "ratio": round(rep.total_bytes / base["total_bytes"], 4),
            "saved_bytes": base["total_bytes"] - rep.total_bytes,
        }
    if isinstance(out.get("resident"), dict):
        out["resident"] = {**out["resident"], "packed_bytes": rep.total_bytes}
    return out


def is_memory_report(path: Path) -> bool:
    """A file `memory --out` may replace: a previous report (JSON with its weights and disk bytes), nothing else."""
    if Path(path).is_symlink() or not Path(path).is_file():
        return False
    data, problem = MemoryReport.loads(Path(path).read_bytes())
    return not problem and isinstance(data, dict) and {"weights", "disk_bytes"} <= data.keys()


def write_memory_json(report: MemoryReport, artifact: Path, out: Path | None = None) -> Path:
    """Write memory.json (into the artifact by default).

    Into an artifact with a manifest: its recorded files are checked first (a mismatch is refused) and
    only memory.json's entry is updated; weights are never re-hashed into the manifest here.
    """

    own = Path(artifact) / MEMORY_JSON
    target = Path(out) if out else own
    in_artifact = target.resolve() == own.resolve()
    manifest = in_artifact and has_manifest(artifact)
    with signals_raise(), updating(Path(artifact)) if manifest else contextlib.nullcontext():
        if manifest:
            require_intact(Path(artifact), stage="memory", skip=(MEMORY_JSON,))
        if in_artifact:
            report.write(artifact)
        else:
            write_json_atomic(target, report.to_dict())
        if manifest:
            record_files(Path(artifact), (MEMORY_JSON,))
    return target
