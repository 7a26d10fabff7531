"""Weight bytes: read from safetensors headers (no tensor is loaded), or counted from a config.

From files: every tensor's bytes by module and by dtype, the packed GPTQ bytes, and what the same
weights take once dequantized to bf16 (what our loader and checker hold resident).

From a config: the Linear matrices and other parameters of a Qwen3-style dense/MoE model, a Qwen3.5-style
hybrid (Gated DeltaNet + gated full attention), or a DFlash drafter (fc + layers, no embedding/head), priced
at bf16, fp8 (1 byte + one fp32 scale per output channel), or GPTQ v1 int8/int4 (qweight + qzeros + fp16 scales
per group + int32 g_idx). Embeddings, lm_head, norms, convolutions and small gate projections stay bf16.
Vision towers and MTP heads are not counted (text-only serving; pass --target-weights BYTES otherwise).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.weights import (
    ST_DTYPE_BYTES,
    dtype_name,
    quantized_linears,
    tensor_entries,
    weight_files,
)
from dflash_quant.memory.kv import FULL, LINEAR, MAMBA, SLIDING, ModelShape

_LAYER_RE = re.compile(r"^(.*?\blayers\.\d+\.[^.]+)")
# What a drafter is made of, for whole-drafter byte counts (quant_report.json, memory.json, budget).
DRAFTER_PARTS = ("backbone_linears", "fc", "norms", "conv", "selector_codebooks", "selector_projection")


def part_of(name: str) -> str:
    """The drafter part a tensor belongs to (one of DRAFTER_PARTS, else 'other').

    'layers.0.attention_conv.base_kernel' -> conv; 'candidate_selector.successor_codebook' -> selector_codebooks;
    'layers.1.self_attn.q_norm.weight' -> norms; 'layers.1.mlp.down_proj.qweight' -> backbone_linears.
    """
    parts = name.split(".")
    if any(p.endswith("_conv") for p in parts):
        return "conv"
    if "candidate_selector" in parts:
        return "selector_codebooks" if parts[-1].endswith("_codebook") else "selector_projection"
    if any(p == "norm" or p.endswith("_norm") or p.endswith("layernorm") for p in parts):
        return "norms"
    if "fc" in parts:
        return "fc"
    if "self_attn" in parts or "mlp" in parts:
        return "backbone_linears"
    return "other"


def bytes_by_part(sizes: dict[str, int]) -> dict[str, int]:
    """{tensor name: bytes} -> bytes per drafter part (every part listed, 'other' only when non-zero)."""
    out = dict.fromkeys(DRAFTER_PARTS, 0)
    for name, nbytes in sizes.items():
        part = part_of(name)
        out[part] = out.get(part, 0) + nbytes
    return out


def module_of(name: str) -> str:
    """'layers.0.self_attn.q_proj.qweight' -> 'layers.0.self_attn'; 'fc.weight' -> 'fc'."""
    m = _LAYER_RE.match(name)
    if m:
        return m.group(1)
    if name.endswith("_codebook"):  # DFlash2 selector codebooks are stored without `.weight`
        return name
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass
class WeightReport:
    total_bytes: int
    by_module: dict[str, int]
    by_dtype: dict[str, int]
    num_tensors: int
    files: list[str]
    packed_quantized_bytes: int = 0  # bytes of qweight/qzeros/scales/g_idx
    dequantized_bf16_bytes: int = 0  # all weights with quantized Linears expanded to bf16
    quantized_linears: int = 0
    params: int = 0  # logical parameters (a packed int4 weight counts out*in)
    by_part: dict[str, int] = field(default_factory=dict)  # drafter parts (DRAFTER_PARTS); meaningful for drafters

    def as_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "by_module": self.by_module,
            "by_dtype": self.by_dtype,
            "num_tensors": self.num_tensors,
            "packed_quantized_bytes": self.packed_quantized_bytes,
            "dequantized_bf16_bytes": self.dequantized_bf16_bytes,
            "quantized_linears": self.quantized_linears,
            "params": self.params,
            "by_part": self.by_part,
        }


def weights_from_files(root: Path) -> WeightReport:
    """Bytes of every weight tensor of root in its own format (safetensors or GGUF), from the headers.

    A quantized Linear counts its stored tensors as packed bytes and out x in logical parameters, whatever
    the format (GPTQ v1, compressed-tensors, MLX affine, a GGUF quantized type)."""
    files = weight_files(root, required=False)
    if not files:
        raise DFlashQuantError(
            f"no weights in {root} (no *.safetensors, no drafter .gguf); point at a model or artifact directory"
        )
    entries = tensor_entries(root)
    gguf = files[0].suffix == ".gguf"
    linears = quantized_linears(root, entries)
    packed_names = {name: base for base, q in linears.items() for name in q.tensors}
    by_module: dict[str, int] = defaultdict(int)
    by_dtype: dict[str, int] = defaultdict(int)
    packed = dequant = params = 0
    for name, e in entries.items():
        if not gguf and e.dtype not in ST_DTYPE_BYTES:
            raise DFlashQuantError(f"{root}: tensor {name} has unknown dtype {e.dtype!r}")
        by_module[module_of(name)] += e.nbytes
        by_dtype[dtype_name(e.dtype)] += e.nbytes
        if name in packed_names:
            packed += e.nbytes
            continue
        dequant += e.nbytes
        params += prod(e.shape)
    for q in linears.values():
        dequant += q.in_features * q.out_features * 2
        params += q.in_features * q.out_features
    return WeightReport(
        total_bytes=sum(by_dtype.values()),
        by_module=dict(sorted(by_module.items(), key=_natural)),
        by_dtype=dict(sorted(by_dtype.items())),
        num_tensors=len(entries),
        files=[f.name for f in files],
        packed_quantized_bytes=packed,
        dequantized_bf16_bytes=dequant,
        quantized_linears=len(linears),
        params=params,
        by_part=bytes_by_part({name: e.nbytes for name, e in entries.items()}),
    )


def _natural(item: tuple[str, int]) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", item[0])]


def disk_bytes(root: Path) -> int:
    """Every file under root (what a download costs)."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------- from a config


@dataclass
class ParamCount:
    linears: list[tuple[str, int, int]] = field(default_factory=list)  # (group, in, out) for quantizable matrices
    other: dict[str, int] = field(default_factory=dict)  # group -> params kept in bf16 (embeddings, norms, ...)

    @property
    def linear_params(self) -> int:
        return sum(i * o for _, i, o in self.linears)

    @property
    def total_params(self) -> int:
        return self.linear_params + sum(self.other.values())


def count_params(shape: ModelShape) -> ParamCount:
    """Parameters implied by a config (see the module docstring for what is covered)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    pc = ParamCount()
    other: dict[str, int] = defaultdict(int)
    q_out = shape.num_attention_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    if shape.is_drafter:
        pc.linears.append(("fc", shape.num_taps * h, h))
        other["norms"] += 2 * h  # hidden_norm, norm
    else:
        other["embed_tokens"] += shape.vocab_size * h
        if not shape.tie_word_embeddings:
            other["lm_head"] += shape.vocab_size * h
        other["norms"] += h
    r = shape.recurrent
    for kind in shape.layer_types:
        if kind in (FULL, SLIDING):
            pc.linears += [
                ("attention", h, q_out * (2 if shape.attn_output_gate else 1)),
                ("attention", h, kv_out),
                ("attention", h, kv_out),
                ("attention", q_out, h),
            ]
            other["norms"] += 2 * shape.head_dim  # q_norm, k_norm
        elif kind == LINEAR and r is not None:
            vd = r.v_heads * r.v_dim
            pc.linears += [
                ("linear_attention", h, r.conv_dim),
                ("linear_attention", h, vd),
                ("linear_attention", vd, h),
            ]
            other["linear_attention_small"] += 2 * h * r.v_heads  # in_proj_a, in_proj_b
            other["linear_attention_small"] += r.conv_dim * r.conv_kernel + 2 * r.v_heads + r.v_dim
        elif kind == MAMBA and r is not None:
            d_inner = r.v_heads * r.v_dim
            pc.linears += [("mamba", h, 2 * d_inner + (r.conv_dim - d_inner) + r.v_heads), ("mamba", d_inner, h)]
            other["mamba_small"] += r.conv_dim * r.conv_kernel + 3 * r.v_heads + d_inner
        if shape.num_experts and shape.moe_intermediate_size:
            e, mi = shape.num_experts, shape.moe_intermediate_size
            pc.linears += [("moe_experts", h, 2 * mi)] * e + [("moe_experts", mi, h)] * e
            other["router"] += h * e
            if shape.shared_expert_intermediate_size:
                si = shape.shared_expert_intermediate_size
                pc.linears += [("mlp", h, 2 * si), ("mlp", si, h)]
                other["router"] += h
        elif not (kind == MAMBA and "hybrid_override_pattern" in shape.raw):  # NemotronH: mamba layers have no MLP
            pc.linears += [("mlp", h, 2 * inter), ("mlp", inter, h)]
        other["norms"] += 2 * h
    _dflash2_params(shape, other)
    pc.other = dict(other)
    return pc


def _dflash2_params(shape: ModelShape, other: dict[str, int]) -> None:
    """DFlash2 parts, kept bf16: the convolutions around every sublayer and the candidate selector."""
    if not shape.is_drafter:
        return
    nested = d if isinstance(d := shape.raw.get("dflash_config"), dict) else {}
    keys: dict[str, Any] = {
        k: nested.get(k, shape.raw.get(k)) for k in ("conv_kernel_size", "conv_group_size", "selector_rank")
    }
    if any(not isinstance(v, int) or v < 1 for v in keys.values()):
        return
    h, kernel, rank = shape.hidden_size, keys["conv_kernel_size"], keys["selector_rank"]
    groups = h // keys["conv_group_size"]
    # per layer: attention_conv + mlp_conv, each base_kernel [2, K, H] + kernel_projection H -> 2*K*groups
    other["dflash2_conv"] += shape.num_layers * 2 * (2 * kernel * h + h * 2 * kernel * groups)
    other["dflash2_selector_codebooks"] += 2 * shape.vocab_size * rank
    other["dflash2_selector_projection"] += h * rank


WEIGHT_FORMATS = ("bf16", "fp16", "fp8", "int8", "int4")


def gptq_matrix_bytes(n_in: int, n_out: int, bits: int, group_size: int = 128) -> int:
    """GPTQ v1 bytes of one Linear: qweight + qzeros + fp16 scales + int32 g_idx."""
    groups = -(-n_in // group_size) if group_size > 0 else 1
    qweight = -(-n_in * bits // 32) * n_out * 4
    qzeros = groups * (-(-n_out * bits // 32)) * 4
    scales = groups * n_out * 2
    g_idx = n_in * 4
    return qweight + qzeros + scales + g_idx


def priced_bytes(pc: ParamCount, fmt: str, group_size: int = 128) -> int:
    """Bytes of the counted parameters stored in `fmt` (non-Linear parameters stay bf16)."""
    fmt = fmt.lower()
    if fmt not in WEIGHT_FORMATS:
        raise UsageError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)} or a size like 17.8GB")
    rest = 2 * sum(pc.other.values())
    if fmt in ("bf16", "fp16"):
        return 2 * pc.linear_params + rest
    if fmt == "fp8":
        return sum(i * o + 4 * o for _, i, o in pc.linears) + rest
    bits = 8 if fmt == "int8" else 4
    return sum(gptq_matrix_bytes(i, o, bits, group_size) for _, i, o in pc.linears) + rest


# count_params groups -> drafter parts (the DFlash2 parts are never quantized by the config-based estimate,
# as every engine keeps them bf16: field-notes section 3)
_PART_OF_GROUP = {
    "fc": "fc", "attention": "backbone_linears", "mlp": "backbone_linears", "norms": "norms",
    "dflash2_conv": "conv", "dflash2_selector_codebooks": "selector_codebooks",
    "dflash2_selector_projection": "selector_projection",
}  # fmt: skip


def priced_drafter_parts(pc: ParamCount, fmt: str, group_size: int = 128) -> dict[str, int]:
    """A drafter's bytes per part (DRAFTER_PARTS) with its Linears in `fmt`; sums to priced_bytes(pc, fmt)."""
    out = dict.fromkeys(DRAFTER_PARTS, 0)
    for group, n_in, n_out in pc.linears:
        one = ParamCount(linears=[(group, n_in, n_out)])
        part = _PART_OF_GROUP.get(group, "other")
        out[part] = out.get(part, 0) + priced_bytes(one, fmt, group_size)
    for group, n in pc.other.items():
        part = _PART_OF_GROUP.get(group, "other")
        out[part] = out.get(part, 0) + 2 * n
    return out
