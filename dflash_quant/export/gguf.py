"""GGUF for llama.cpp's DFlash drafter support, from the GPTQ codes (the file codec: io.gguf, io.gguf_names).

Grids (ggml block layouts, 32 weights per block, fp16 `d`):
  Q4_0 = d * (q - 8), q 4-bit        <- GPTQ 4-bit symmetric group 32 (zero 8): exact
  Q8_0 = d * q, q int8               <- GPTQ 8-bit symmetric group 32 (zero 128), q = code - 128: exact
  Q4_1 = d * q + m, fp16 m           <- GPTQ 4-bit asymmetric group 32, m = fp16(-scale * zero): exact up to m's rounding
Other GPTQ settings (group 128, act-order, 2/3 bits) have no GGUF type; they are refused, or requantized
from the dequantized GPTQ weights with gguf's own round-to-nearest when --requantize is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_quant import __version__
from dflash_quant.artifact.reports import Provenance, QuantReport
from dflash_quant.calibration.capture import CalibrationStats
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.export.gptq_v1 import GptqArtifact
from dflash_quant.export.imatrix import FILE as IMATRIX_FILE
from dflash_quant.export.imatrix import write_for_stats
from dflash_quant.export.writer import whole_drafter_bytes
from dflash_quant.io.gguf import (
    BLOCK,
    DFLASH2_KEYS,
    FILE_TYPES,
    K_FILE_TYPES,
    LLAMA_CPP_REVISION,
    DrafterHeader,
    pack_kquant,
    pack_q4_0,
    pack_q4_1,
    pack_q8_0,
    tensor_order,
    write_file,
)
from dflash_quant.io.gguf_names import gguf_name, hf_name
from dflash_quant.io.weights import tensor_entries
from dflash_quant.models.config import parse_draft_config
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.quantize.drafter import QuantOutcome
from dflash_quant.quantize.grid import columns_in_order
from dflash_quant.quantize.kmix import file_type as kmix_file_type
from dflash_quant.quantize.kquant import KQuantWeight, grid_for

EXACT_TYPES = {(4, True): "Q4_0", (8, True): "Q8_0", (4, False): "Q4_1"}
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


def dflash2_problem(config: dict[str, Any]) -> str | None:
    """Why llama.cpp's loader refuses this DFlash2 drafter (None: it loads it, or it is a v1 drafter).
    `src/models/dflash.cpp` needs hidden_size >= top_k * (top_k + 1) (its selector packs each block position's
    top-k candidate ids and top-k x top-k transition scores into one hidden-size output row) and hidden_size % conv_group_size == 0 (parse_draft_config refuses
    that already)."""
    cfg = parse_draft_config(config)
    if not cfg.is_dflash2:
        return None
    hidden, top_k = int(cfg.hidden_size), int(cfg.selector_top_k)
    if hidden < top_k * (top_k + 1):
        return (
            f"llama.cpp refuses this DFlash2 drafter: hidden size {hidden} is below selector_top_k x (selector_top_k + 1) "
            f"= {top_k * (top_k + 1)} (its 'selector lattice' check), so llama-server cannot load the GGUF; "
            "export this drafter as gptq, compressed-tensors or mlx instead"
        )
    return None


def pairing_problem(config: dict[str, Any], target: Path | None) -> str | None:
    """Why llama.cpp cannot run this drafter with this target (None: it can). llama.cpp taps layer *inputs*
    (ids + 1), so a tap on the target's last layer has no input tensor and llama-server aborts; a DFlash2
    drafter must also pass the loader's size checks (dflash2_problem)."""
    if problem := dflash2_problem(config):
        return problem
    ids = [int(i) for i in parse_draft_config(config).target_layer_ids]
    depth = target_depth(target, config)
    if depth is not None and ids and max(ids) >= depth - 1:
        return (
            f"the drafter taps target layer {max(ids)}, the last of {depth}: llama.cpp reads layer inputs "
            f"(id + 1) and has none after the last layer, so llama-server would abort; GGUF needs taps below {depth - 1}"
        )
    return None


# DFlash2 Linears that GGUF keeps unquantized, as llama.cpp's converter writes them and every engine runs them
KEPT_LINEARS = ("kernel_projection", "hidden_projection")


def kept_problem(names: Iterable[str]) -> str | None:
    """The DFlash2 convolution / selector projections stay BF16 in GGUF: refuse an artifact that quantized them."""
    packed = sorted(n for n in names if n.rsplit(".", 1)[-1] in KEPT_LINEARS)
    if not packed:
        return None
    return (
        f"GGUF keeps DFlash2's convolution and selector projections BF16 (as llama.cpp's converter writes them), but "
        f"{packed[0]}{f' and {len(packed) - 1} more' if len(packed) > 1 else ''} are quantized; re-run gptq without "
        "--quantize-conv / --quantize-selector"
    )


# ------------------------------------------------------------------------------------------- block codecs


def encode_weight(qw, requantize: bool = False) -> tuple[np.ndarray, str]:
    """(bytes [out, row_bytes], GGUF type name) of one quantized Linear."""
    import gguf

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
    cfg = parse_draft_config(config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return {"cfg": cfg, "rope_theta": theta}


def _dflash2_fields(cfg) -> tuple[int, int, int, int]:
    k, g, r, t = (int(getattr(cfg, key)) for key in DFLASH2_KEYS)
    return k, g, r, t


def header(art: GptqArtifact, file_type: int) -> DrafterHeader:
    """The GGUF metadata of a drafter from its config.json, as llama.cpp's converter derives it."""
    hp = _hparams(art.config)
    cfg = hp["cfg"]
    raw_causal = art.config.get("is_causal")
    if raw_causal is None:
        raw_causal = (art.config.get("dflash_config") or {}).get("causal")
    sliding = getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    return DrafterHeader(
        name=Path(str(art.config.get("_name_or_path") or art.path.name)).name or "dflash-drafter",
        block_count=cfg.num_hidden_layers,
        context_length=cfg.max_position_embeddings,
        embedding_length=cfg.hidden_size,
        feed_forward_length=cfg.intermediate_size,
        head_count=cfg.num_attention_heads,
        head_count_kv=cfg.num_key_value_heads,
        rope_freq_base=float(hp["rope_theta"]) if hp["rope_theta"] is not None else None,
        rms_eps=float(cfg.rms_norm_eps),
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        file_type=file_type,
        block_size=int(cfg.block_size),
        target_layers=[int(i) for i in cfg.target_layer_ids],
        causal=bool(raw_causal) if raw_causal is not None else None,
        sliding_window=int(cfg.sliding_window) if sliding else None,
        sliding_pattern=[t == "sliding_attention" for t in (cfg.layer_types or [])] if sliding else [],
        vocab_size=int(cfg.vocab_size),
        mask_token_id=int(cfg.mask_token_id),
        version=__version__,
        dflash2=_dflash2_fields(cfg) if cfg.is_dflash2 else None,
    )


def write_gguf(
    dst: Path,
    art: GptqArtifact,
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
    if target is None:
        raise UsageError(
            "GGUF needs the target's tokenizer (llama.cpp checks draft and target vocabularies); pass --target TARGET"
        )
    if problem := pairing_problem(art.config, Path(target)) or kept_problem(
        [*art.quantized, *(hf_name(k).removesuffix(".weight") for k in encoded or {})]
    ):
        raise UsageError(problem)
    written: dict[str, tuple[np.ndarray, str]] = dict(encoded or {})
    for name, qw in art.quantized.items():
        written[gguf_name(f"{name}.weight")] = encode_weight(qw, requantize)
    kinds = sorted({k for _, k in written.values()})
    main = max(kinds, key=lambda k: sum(1 for _, kk in written.values() if kk == k)) if kinds else "BF16"
    fname = f"drafter-{label or main}.gguf"
    if file_type is None:
        file_type = FILE_TYPES.get(main, K_FILE_TYPES.get(main, 32))  # 32: MOSTLY_BF16
    tensors: list[tuple[str, np.ndarray, str | None]] = []
    qbytes = 0
    for key in sorted(set(written) | {gguf_name(k) for k in art.dense}, key=tensor_order):
        if key in written:
            data, kind = written[key]
            tensors.append((key, data, kind))
            qbytes += data.nbytes
            continue
        value = art.dense[hf_name(key)]
        if value.dim() <= 1 or key.endswith("_norm.weight") or not key.endswith(".weight"):
            # F32 as llama.cpp's converter forces: norms, 1-D tensors and names without `.weight` (base_kernel)
            tensors.append((key, value.float().numpy(), None))
        else:  # a Linear kept unquantized: its stored bf16 bits, untouched
            bits = value.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
            tensors.append((key, bits.reshape(value.shape[0], -1), "BF16"))
    write_file(dst / fname, header(art, file_type), tensors, target=Path(target), pre=pre)
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
    return (qw.spec.bits, qw.spec.sym) in EXACT_TYPES and qw.n_groups * BLOCK == qw.in_features and columns_in_order(qw)


def encode_kquant(qw: KQuantWeight) -> np.ndarray:
    """ggml's blocks of one Linear quantized on a llama.cpp grid (quantize.kquant): exactly what the grid chose."""
    return pack_kquant(qw.grid.name, qw.codes, qw.d, qw.dmin, qw.sc, qw.m)


def write_kquant_gguf(
    out: Path,
    model: DFlashDrafter,
    raw_config: dict[str, Any],
    source_path: Path,
    outcome: QuantOutcome,
    gguf_type: str,
    target: Path,
    provenance: Provenance,
    quant_report: QuantReport,
    stats: CalibrationStats | None = None,
) -> dict:
    """The GGUF artifact of a k-quant GPTQ run (plus provenance, quant report, and the drafter imatrix)."""
    out = Path(out)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    encoded = {}
    for name, qw in outcome.weights.items():
        state.pop(f"{name}.weight")
        encoded[gguf_name(f"{name}.weight")] = (encode_kquant(qw), qw.grid.name)
    grid = grid_for(gguf_type)
    art = GptqArtifact(
        path=Path(source_path),
        config=dict(raw_config),
        qcfg={"bits": grid.code_bits, "group_size": grid.sub, "sym": not grid.has_min},
        dense={k: v.to(torch.bfloat16) for k, v in state.items()},
    )
    summary = write_gguf(
        out, art, target=Path(target), encoded=encoded, file_type=kmix_file_type(gguf_type), label=gguf_type
    )
    provenance.write(out)
    quant_report.quantized_bytes = summary["quantized_bytes"]
    written = {name: e.nbytes for name, e in tensor_entries(out).items()}
    whole = whole_drafter_bytes(model.state_dict(), written)
    quant_report.drafter_bytes_bf16 = whole["drafter_bytes_bf16"]
    quant_report.drafter_bytes_quantized = whole["drafter_bytes_quantized"]
    quant_report.by_part = whole["by_part"]
    quant_report.write(out)
    if stats is not None:
        prompts = provenance.calibration.prompts if provenance.calibration is not None else None
        write_for_stats(out / IMATRIX_FILE, stats, model.linear_names(), prompts or "calibration")
    return summary
