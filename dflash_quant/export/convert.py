"""Convert a GPTQ v1 artifact into another engine's format from the same integer codes (no recalibration).

Every format starts from what the GPTQ artifact holds (codes, fp16 scales, zero points, g_idx) and either
maps it exactly onto the format's grid or refuses, naming the `gptq` settings that map. The reports
(provenance, quant_report, parity, memory) travel with the weights; the caller writes card and manifest.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from dflash_quant import __version__
from dflash_quant.artifact.reports import MemoryReport, Parity, Provenance, QuantReport
from dflash_quant.artifact.sources import portable_path
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.export.compressed_tensors import grid_problem as ct_grid_problem
from dflash_quant.export.compressed_tensors import write_compressed_tensors
from dflash_quant.export.gguf import dflash2_problem, kept_problem, write_gguf
from dflash_quant.export.gguf import grid_problem as gguf_grid_problem
from dflash_quant.export.gptq_v1 import read_gptq_artifact
from dflash_quant.export.mlx import grid_problem as mlx_grid_problem
from dflash_quant.export.mlx import write_mlx
from dflash_quant.io.source import resolve
from dflash_quant.io.weights import tensor_entries
from dflash_quant.memory.report import restate_for
from dflash_quant.memory.weights import bytes_by_part

FORMATS = ("gptq", "compressed-tensors", "gguf", "mlx")
REPORT_CLASSES = (Provenance, QuantReport, Parity, MemoryReport)
GPTQ_FILES = ("model.safetensors", "quantize_config.json")


def format_problem(
    fmt: str, bits: int, group_size: int, sym: bool, desc_act: bool, requantize: bool = False
) -> str | None:
    """Why `gptq` settings cannot be written in `fmt` without requantizing (None: they can). Checked before calibrating.

    desc_act means a permuted g_idx: act-order *with* static groups keeps groups in column order and maps."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if fmt == "compressed-tensors":
        return ct_grid_problem(desc_act)
    if fmt == "gguf":
        return gguf_grid_problem(bits, group_size, sym, desc_act, requantize)
    if fmt == "mlx":
        return mlx_grid_problem(bits, group_size, desc_act)
    return None


def convert_artifact(
    src: Path,
    dst: Path,
    fmt: str,
    *,
    target: str | Path | None = None,
    requantize: bool = False,
    command: list[str] | None = None,
    gguf_pre: str | None = None,
) -> dict[str, Any]:
    """Write `fmt` into `dst` from the GPTQ v1 artifact `src` (dst may be src: the GPTQ files are replaced).

    Returns the format's summary (what was written, what is exact). Card and manifest are the caller's.
    """
    if fmt not in FORMATS[1:]:
        what = "is the source format already" if fmt == "gptq" else "is unknown"
        raise UsageError(f"--format {fmt!r} {what}; use one of {', '.join(FORMATS[1:])}")
    src, dst = Path(src), Path(dst)
    art = read_gptq_artifact(src)
    permuted = bool(art.qcfg.get("desc_act")) and not art.qcfg.get("static_groups")
    settings = {(qw.spec.bits, qw.spec.group_size) for qw in art.quantized.values()}
    if len(settings) > 1 and fmt != "compressed-tensors":
        top = max(settings)
        raise UsageError(
            f"{src} is a per-Linear mixed-precision drafter and {fmt} holds one setting for all Linears; "
            f"export compressed-tensors or GPTQ, or re-run gptq uniform (nearest: --bits {top[0]} --group-size {top[1]})"
        )
    problem = format_problem(fmt, art.bits, art.group_size, art.sym, permuted, requantize)
    if fmt == "gguf":  # what llama.cpp cannot load, before anything is written
        problem = problem or dflash2_problem(art.config) or kept_problem(art.quantized)
    if problem:
        raise UsageError(problem)
    # the source's reports, through their typed readers (one-line errors when malformed)
    reports = {}
    for cls in REPORT_CLASSES:
        report = cls.read(src, optional=True)
        if report is not None:
            reports[cls.FILE] = report.to_dict()
    dst.mkdir(parents=True, exist_ok=True)
    if src.resolve() == dst.resolve():
        for name in GPTQ_FILES:
            (dst / name).unlink(missing_ok=True)
    if fmt == "compressed-tensors":
        summary = write_compressed_tensors(dst, art)
    elif fmt == "gguf":
        summary = write_gguf(
            dst, art, target=_target_dir(target, reports.get("provenance.json")), requantize=requantize, pre=gguf_pre
        )
    else:
        summary = write_mlx(dst, art)
    for name, data in reports.items():
        if name == "provenance.json":
            data = dict(data)
            data["export"] = {
                "format": fmt,
                "from": None if src.resolve() == dst.resolve() else portable_path(src),
                "from_quant_method": "gptq",
                "tool_version": __version__,
                "created_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "command": command or [],
                "exact": summary["exact"],
                "requantized": summary.get("requantized", False),
            }
        if name == "quant_report.json":
            data = dict(data)
            data["gptq_quantized_bytes"] = data.get("gptq_quantized_bytes", data.get("quantized_bytes"))
            data["quantized_bytes"] = summary["quantized_bytes"]
            data["format"] = fmt
            _whole_drafter_bytes(data, dst)
        if name == "memory.json":
            data = restate_for(data, dst)
        if name == "parity.json" and src.resolve() != dst.resolve():
            data = dict(data)
            notes = list(data.get("notes") or [])
            notes.append(
                f"measured on the GPTQ v1 artifact this {fmt} export was converted from; "
                "`dflash-quant verify` on this directory measures these exact weights"
            )
            data["notes"] = notes
            data["measured_on"] = "gptq"
        next(c for c in REPORT_CLASSES if c.FILE == name).from_dict(data).write(dst)
    return summary


def _whole_drafter_bytes(data: dict, dst: Path) -> None:
    """Whole-drafter bytes of the converted files (any format); the GPTQ figures are kept beside them."""
    if "drafter_bytes_quantized" not in data:
        return
    data.setdefault("gptq_drafter_bytes_quantized", data["drafter_bytes_quantized"])
    by_part = dict(data.get("by_part") or {})
    by_part.setdefault("gptq", by_part.get("quantized"))
    sizes = {name: e.nbytes for name, e in tensor_entries(dst).items()}
    data["drafter_bytes_quantized"] = sum(sizes.values())
    by_part["quantized"] = bytes_by_part(sizes)
    data["by_part"] = by_part


def _target_dir(target: str | Path | None, provenance: dict | None) -> Path | None:
    """The target model directory (the GGUF vocabulary comes from its tokenizer)."""
    if target is not None:
        return resolve(str(target)).path
    rec = (provenance or {}).get("target") or {}
    for key in ("path", "id"):
        value = rec.get(key)
        if value:
            try:
                return resolve(str(value)).path
            except DFlashQuantError:
                continue
    return None
