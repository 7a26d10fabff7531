"""The one place that knows where each artifact format keeps its weights.

Every command that hashes, sizes or reads the weights of a model directory goes through here: a bf16 model
or a GPTQ v1 / compressed-tensors / MLX artifact keeps them in safetensors files (sharded by an index or
not), a GGUF export in one `.gguf` file. From the files' headers alone (no tensor is loaded) this module
gives each tensor's stored dtype, shape and bytes under its Hugging Face name, and which tensors make up
each quantized Linear with its logical (out, in) shape.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from safetensors import SafetensorError, safe_open

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.gguf_names import ARCH, hf_name

if TYPE_CHECKING:
    import torch

DENSE, GPTQ, COMPRESSED, MLX, GGUF = "dense", "gptq", "compressed-tensors", "mlx", "gguf"
FORMATS = (DENSE, GPTQ, COMPRESSED, MLX, GGUF)

ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
ST_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# The tensors that store one quantized Linear, by format (GGUF: the one `.weight` tensor of a quantized type).
PACKED_SUFFIXES = {
    GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    COMPRESSED: ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"),
    MLX: ("weight", "scales", "biases"),
    GGUF: ("weight",),
}
IMATRIX_SUFFIX = ".imatrix.gguf"  # llama.cpp importance data that may sit beside the weights: not weights


@dataclass(frozen=True)
class Entry:
    """One stored tensor: its dtype as the file names it (safetensors `BF16`, GGUF `Q4_0`), its shape (GGUF:
    the logical element shape, out x in), and its bytes in the file."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class QuantizedLinear:
    out_features: int
    in_features: int
    tensors: tuple[str, ...]  # the stored tensors that make it up


# ------------------------------------------------------------------------------------------- formats


def config_format(raw: dict[str, Any]) -> str:
    """The artifact format a config.json declares (mlx-lm writes `quantization`, the others
    `quantization_config.quant_method`); `dense` when it declares none."""
    qcfg = raw.get("quantization_config")
    if isinstance(qcfg, dict) and qcfg.get("quant_method"):
        return str(qcfg["quant_method"])
    if isinstance(raw.get("quantization"), dict):
        return MLX
    return DENSE


def read_raw_config(root: Path) -> dict[str, Any]:
    """config.json as a dict, or {} when absent or unreadable (its loader reports those problems itself)."""
    path = Path(root) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def format_of(root: Path) -> str:
    return config_format(read_raw_config(root))


# ------------------------------------------------------------------------------------------- files


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


def gguf_files(root: Path) -> list[Path]:
    """The drafter GGUF of a directory: the file config.json names, else every `.gguf` but imatrix data."""
    root = Path(root)
    qcfg = read_raw_config(root).get("quantization_config")
    named = qcfg.get("file") if isinstance(qcfg, dict) and qcfg.get("quant_method") == GGUF else None
    if isinstance(named, str):
        return [confined(root, named)]
    return [confined(root, f.name) for f in sorted(root.glob("*.gguf")) if not f.name.endswith(IMATRIX_SUFFIX)]


def safetensors_files(root: Path) -> list[Path]:
    """Index shards, or every *.safetensors; each stays inside the directory (see confined)."""
    root = Path(root)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        confined(root, index.name)
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise DFlashQuantError(f"{index} is not a valid safetensors index; re-download the model") from exc
        return [confined(root, s) for s in shards]
    return [confined(root, f.name) for f in sorted(root.glob("*.safetensors"))]


def weight_files(root: Path, required: bool = True) -> list[Path]:
    """The files that hold a model directory's weights, in its own format; pickle-only dirs are refused.

    Every file returned (and the index) stays inside the directory: a shard named `../x` or `/x`, or a
    symlink leading out, is refused (an HF cache snapshot's links into its own blobs/ are fine).
    """
    root = Path(root)
    files = gguf_files(root) if format_of(root) == GGUF else safetensors_files(root)
    if files or not required:
        return files
    if any(root.glob("*.bin")) or any(root.glob("*.pt")):
        raise DFlashQuantError(
            f"{root} holds only pickle checkpoints (.bin/.pt), which are never loaded; convert them to safetensors"
        )
    raise DFlashQuantError(
        f"no weights in {root} (no *.safetensors, no drafter .gguf); point at a model or artifact directory"
    )


def existing(files: list[Path]) -> list[Path]:
    for f in files:
        if not f.is_file():
            raise DFlashQuantError(f"{f} is missing (listed in the index or config.json); re-download or re-export it")
    return files


def _update(digest, fh: BinaryIO, chunk: int = 1 << 20) -> None:
    while block := fh.read(chunk):
        digest.update(block)


def sha256_fileobj(fh: BinaryIO) -> str:
    """sha256 of what is left to read from an open binary file."""
    digest = hashlib.sha256()
    _update(digest, fh)
    return digest.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """sha256 over the concatenated bytes of `paths`, in order (one file: its plain sha256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            _update(digest, fh)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_files([path])


def weights_sha256(root: Path) -> str:
    """sha256 of a model's weight files (any format), concatenated in index order."""
    return sha256_files(existing(weight_files(root)))


class BackgroundSha256:
    """weights_sha256(root) computed in a thread while the caller goes on (a 27B target's 54 GB take tens of
    seconds; hashlib releases the GIL on large blocks, so it overlaps loading). A daemon thread: Ctrl-C or an
    error exits without waiting for it. `result()` waits, and raises what the hashing raised."""

    def __init__(self, root: Path):
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(root,), name="dflash-quant-sha256", daemon=True)
        self._thread.start()

    def _run(self, root: Path) -> None:
        try:
            self._value = weights_sha256(root)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._error = exc

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (shards merged), with a clear error on corrupt files."""
    tensors: dict[str, torch.Tensor] = {}
    for file in existing(weight_files(path)):
        try:
            with safe_open(file, framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as exc:
            raise DFlashQuantError(
                f"{file} is not a readable safetensors file ({exc}); re-download or re-export it"
            ) from exc
    return tensors


# ------------------------------------------------------------------------------------------- headers


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the same bytes for the same tensors: safetensors writes the metadata in hash
    order, which changes from run to run, so the header's metadata object is rewritten in sorted key order (same
    length, in place). Reproducible files keep their sha256 across runs (check caches, Hub uploads)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = fh.read(n)
        stored = json.loads(header, object_pairs_hook=lambda pairs: pairs)
        meta = dict(next((v for k, v in stored if k == "__metadata__"), []))  # in the order the file has it
        written = json.dumps(meta, separators=(",", ":"), ensure_ascii=False)
        wanted = json.dumps(dict(sorted(meta.items())), separators=(",", ":"), ensure_ascii=False)
        at = header.find(written.encode())
        if at >= 0:  # same keys and values in another order: same length, rewritten in place
            fh.seek(8 + at)
            fh.write(wanted.encode())


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


def open_gguf(path: Path):
    """gguf-py's reader over a DFlash drafter GGUF, refused in one line when the file is not one or is cut
    short (the reader maps the file and would otherwise hand out tensors past its end)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, struct.error) as exc:
        raise DFlashQuantError(f"{path} is not a readable GGUF file ({exc}); re-export it") from exc
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != ARCH:
        raise DFlashQuantError(f"{path} is not a DFlash drafter GGUF (general.architecture is not {ARCH!r})")
    size = Path(path).stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise DFlashQuantError(
                f"{path} is truncated: tensor {t.name} ends past the file's {size:,} bytes; re-export it"
            )
    return reader


def gguf_entries(path: Path) -> dict[str, Entry]:
    return {
        hf_name(t.name): Entry(t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.n_bytes))
        for t in open_gguf(path).tensors
    }


def tensor_entries(root: Path, required: bool = True) -> dict[str, Entry]:
    """Every weight tensor of a model directory (any format) under its Hugging Face name, from headers."""
    out: dict[str, Entry] = {}
    for f in existing(weight_files(root, required=required)):
        if f.suffix == ".gguf":
            out.update(gguf_entries(f))
            continue
        for name, info in read_header(f).items():
            start, end = info["data_offsets"]
            out[name] = Entry(str(info.get("dtype")), tuple(info.get("shape", [])), int(end) - int(start))
    return out


def dtype_name(dtype: str) -> str:
    """`BF16` -> `bfloat16`; a GGUF type `Q4_0` -> `q4_0`."""
    return ST_DTYPE_NAMES.get(dtype, dtype.lower())


# ------------------------------------------------------------------------------------------- Linears


def _shape_values(root: Path, names: list[str]) -> dict[str, list[int]]:
    """compressed-tensors stores each Linear's logical shape as a 2-int tensor: read just those."""
    wanted, out = set(names), {}
    for f in safetensors_files(root):
        with safe_open(f, framework="pt") as fh:
            for key in wanted & set(fh.keys()):
                out[key] = [int(v) for v in fh.get_tensor(key).tolist()]
    return out


def _mlx_bits(raw: dict[str, Any], base: str) -> int:
    quant = raw.get("quantization") or {}
    layer = quant.get(base)
    layer = layer if isinstance(layer, dict) else {}
    return int(layer.get("bits", quant.get("bits", 4)))


def quantized_linears(root: Path, entries: dict[str, Entry] | None = None) -> dict[str, QuantizedLinear]:
    """The quantized Linears of an artifact, each with its logical (out, in) and the tensors storing it."""
    raw = read_raw_config(root)
    fmt = config_format(raw)
    entries = tensor_entries(root, required=False) if entries is None else entries
    suffixes = PACKED_SUFFIXES.get(fmt, ())

    def parts(base: str) -> tuple[str, ...]:
        return tuple(f"{base}.{s}" for s in suffixes if f"{base}.{s}" in entries)

    out: dict[str, QuantizedLinear] = {}
    if fmt == GPTQ:  # qweight [in*bits/32, out]; g_idx [in]
        for name, e in entries.items():
            if name.endswith(".qweight") and f"{name[:-8]}.g_idx" in entries:
                base = name[: -len(".qweight")]
                out[base] = QuantizedLinear(e.shape[1], entries[f"{base}.g_idx"].shape[0], parts(base))
    elif fmt == COMPRESSED:  # weight_shape holds [out, in]
        shapes = _shape_values(root, [n for n in entries if n.endswith(".weight_shape")])
        for name, (n_out, n_in) in shapes.items():
            base = name[: -len(".weight_shape")]
            out[base] = QuantizedLinear(n_out, n_in, parts(base))
    elif fmt == MLX:  # weight uint32 [out, in*bits/32] beside scales and biases
        for name in entries:
            base = name[: -len(".scales")] if name.endswith(".scales") else ""
            if base and f"{base}.biases" in entries and f"{base}.weight" in entries:
                packed = entries[f"{base}.weight"].shape
                out[base] = QuantizedLinear(packed[0], packed[1] * 32 // _mlx_bits(raw, base), parts(base))
    elif fmt == GGUF:
        for name, e in entries.items():
            if e.dtype not in GGUF_FLOAT_TYPES and name.endswith(".weight") and len(e.shape) == 2:
                out[name[: -len(".weight")]] = QuantizedLinear(e.shape[0], e.shape[1], (name,))
    return out


def mlx_packing_problem(root: Path, entries: dict[str, Entry]) -> str | None:
    """MLX-packed Linears (uint32 weight + scales + biases) in a directory whose config.json does not say
    how they were packed: read as dense, they would fail far from the cause."""
    if format_of(root) != DENSE:
        return None
    for name in entries:
        if name.endswith(".scales") and f"{name[:-7]}.biases" in entries:
            return (
                f"{root}: {name[:-7]} is stored MLX-packed (weight + scales + biases) but config.json has no "
                "`quantization` key with bits and group_size; restore config.json from the export"
            )
    return None
