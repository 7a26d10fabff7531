"""The files that hold a model's weights, read without building the model: which files (safetensors shards, each
confined to the model directory), their headers (dtype, shape, byte offsets; nothing loaded), their tensors,
and their sha256."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from safetensors import SafetensorError, safe_open

from dflash_quant.errors import DFlashQuantError

if TYPE_CHECKING:
    import torch

ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


ST_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip


def read_header(path: Path) -> dict:
    """The JSON header of one .safetensors file (8-byte little-endian length + JSON), checked against the
    file's size: a header whose tensors lie beyond the end of the file (a truncated download, or a header
    claiming terabytes for a 4 MB file) is refused before anything trusts its byte counts."""
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * (1 << 20)):
                raise ValueError(f"header length {n} exceeds the file's {size} bytes")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        _check_offsets(header, size - 8 - n)
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DFlashQuantError(f"{path} is truncated or corrupt ({exc}); re-download or re-export it") from exc
    return header


def _check_offsets(header: dict, data_bytes: int) -> None:
    for name, info in header.items():
        if not isinstance(info, dict):
            raise ValueError(f"entry {name!r} is not an object")
        offsets, shape, dt = info.get("data_offsets"), info.get("shape"), info.get("dtype")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name} has bad data_offsets {offsets!r}")
        if offsets[1] > data_bytes:
            raise ValueError(f"tensor {name} ends at byte {offsets[1]:,} of the data but the file holds {data_bytes:,}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name} has bad shape {shape!r}")
        numel = 1
        for d in shape:
            numel *= d
        if dt in ST_DTYPE_BYTES and offsets[1] - offsets[0] != numel * ST_DTYPE_BYTES[dt]:
            raise ValueError(
                f"tensor {name} {dt}{shape} needs {int(numel * ST_DTYPE_BYTES[dt]):,} bytes, "
                f"its offsets span {offsets[1] - offsets[0]:,}"
            )


def _cache_repo(root: Path) -> Path | None:
    """`<cache>/models--org--name` when root is one of its `snapshots/<rev>` folders (files link to ../../blobs)."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return None


def confined(root: Path, name: str) -> Path:
    """root/name, refused unless it stays inside root (or, for an HF cache snapshot, inside its repo folder)."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or re.match(r"^[A-Za-z]:", name)
        or any(p in ("", ".", "..") for p in name.split("/"))
    ):
        raise DFlashQuantError(
            f"{root}: file name {name!r} points outside the model directory; only plain "
            "relative names are read (fix the index or re-download the model)"
        )
    real_root = Path(root).resolve()
    allowed = _cache_repo(real_root) or real_root
    real = (Path(root) / name).resolve()
    if not real.is_relative_to(allowed):
        raise DFlashQuantError(
            f"{Path(root) / name} resolves to {real}, outside the model directory {root}; "
            "copy the file into the model directory instead of linking to it"
        )
    return Path(root) / name


def weight_files(path: Path, required: bool = True) -> list[Path]:
    """The safetensors files of a model dir (index shards or *.safetensors); pickle-only dirs are refused.

    Every file returned (and the index) stays inside the model directory: a shard named `../x` or `/x`,
    or a symlink leading out, is refused (an HF cache snapshot's links into its own blobs/ are fine).
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        confined(path, index.name)
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise DFlashQuantError(f"{index} is not a valid safetensors index; re-download the model") from exc
        return [confined(path, s) for s in shards]
    files = [confined(path, f.name) for f in sorted(path.glob("*.safetensors"))]
    if files or not required:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise DFlashQuantError(
            f"{path} holds only pickle checkpoints (.bin/.pt), which are never loaded; convert them to safetensors"
        )
    raise DFlashQuantError(f"no *.safetensors weights in {path}; point at a model directory")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (shards merged), with a clear error on corrupt files."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        if not file.is_file():
            raise DFlashQuantError(f"{file} is missing (listed in the index); re-download the model")
        try:
            with safe_open(file, framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as exc:
            raise DFlashQuantError(
                f"{file} is not a readable safetensors file ({exc}); re-download or re-export it"
            ) from exc
    return tensors


def read_headers(path: Path, required: bool = True) -> dict[str, dict]:
    """Every tensor's header entry (dtype, shape, offsets) across a model dir's files; nothing is loaded.

    Each file's header is checked against its size (read_header)."""
    out: dict[str, dict] = {}
    for file in weight_files(path, required=required):
        if not file.is_file():
            raise DFlashQuantError(f"{file} is missing (listed in the index); re-download the model")
        out.update(read_header(file))
    return out


def weights_sha256(path: Path) -> str:
    """sha256 of a model's safetensors files, concatenated in index order."""
    return sha256_files(weight_files(path))


def _update(digest, fh: BinaryIO, chunk: int = 1 << 20) -> None:
    while block := fh.read(chunk):
        digest.update(block)


def sha256_fileobj(fh: BinaryIO) -> str:
    """sha256 of what is left to read from an open binary file."""
    digest = hashlib.sha256()
    _update(digest, fh)
    return digest.hexdigest()


def sha256_files(paths: Iterable[Path]) -> str:
    """sha256 of the files' bytes, concatenated in the given order (one file: its plain sha256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            _update(digest, fh)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_files([path])
