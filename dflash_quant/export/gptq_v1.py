"""GPTQ v1 checkpoint tensors (AutoGPTQ / GPTQModel / vLLM `gptq` and `gptq_marlin`).

Per quantized Linear with `out` outputs, `in` inputs and G groups:
  qweight int32 [in*bits/32, out]  codes packed along the input dim, value i of a column at bit bits*i
                                   of that column's little-endian word stream (3-bit values straddle words:
                                   32 values fill exactly 3 words, GPTQModel's 10|1|10|1|10 layout);
  qzeros  int32 [G, out*bits/32]   zero-1 per field, packed the same way along the output dim;
  scales  fp16  [G, out];
  g_idx   int32 [in]               group of each input column.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.quantize.grid import SUPPORTED_BITS, QuantizedWeight

_MASK32 = (1 << 32) - 1


def _pack_dim0(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative ints [n, m] (< 2**bits) into int32 [n*bits/32, m], value i at bit offset bits*i."""
    n, m = values.shape
    if (n * bits) % 32:
        raise DFlashQuantError(f"cannot pack {n} values of {bits} bits into whole int32 words (need n*bits % 32 == 0)")
    pad = (-n) % 32
    v = values.to(torch.int64)
    if pad:
        v = torch.cat([v, v.new_zeros(pad, m)])
    v = v.reshape(-1, 32, m)  # 32 values always fill exactly `bits` words
    words = v.new_zeros(v.shape[0], bits, m)
    for i in range(32):
        word, shift = divmod(bits * i, 32)
        words[:, word] |= (v[:, i] << shift) & _MASK32
        if shift + bits > 32:  # the value's high bits spill into the next word
            words[:, word + 1] |= v[:, i] >> (32 - shift)
    words = words.reshape(-1, m)[: n * bits // 32]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unpack_dim0(words: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of _pack_dim0: int32 [w, m] -> int64 [w*32/bits, m] (or the first n rows)."""
    w, m = words.shape
    total = w * 32 // bits
    x = words.to(torch.int64) & _MASK32
    pad = (-w) % bits
    if pad:
        x = torch.cat([x, x.new_zeros(pad, m)])
    x = x.reshape(-1, bits, m)
    mask = (1 << bits) - 1
    out = x.new_empty(x.shape[0], 32, m)
    for i in range(32):
        word, shift = divmod(bits * i, 32)
        val = x[:, word] >> shift
        if shift + bits > 32:
            val = val | (x[:, word + 1] << (32 - shift))
        out[:, i] = val & mask
    return out.reshape(-1, m)[: total if n is None else n]


def pack_gptq_v1(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The four GPTQ v1 tensors for one quantized Linear (on CPU)."""
    bits = qw.spec.bits
    out_features, in_features = qw.codes.shape
    where = f"layer {qw.name!r}" if qw.name else "this layer"
    if (in_features * bits) % 32 or (out_features * bits) % 32:
        raise DFlashQuantError(
            f"{where} [{out_features}, {in_features}] cannot be packed at {bits} bits: "
            "in*bits and out*bits must be multiples of 32; keep it unquantized"
        )
    zeros = qw.zeros.to(torch.int64).cpu()
    if torch.any(zeros < 1) or torch.any(zeros > qw.spec.maxq):
        raise DFlashQuantError(
            f"{where} has zero points outside [1, {qw.spec.maxq}], which GPTQ v1 (stores zero-1) cannot hold; "
            "quantize with QuantSpec(v1_zeros=True)"
        )
    return {
        "qweight": _pack_dim0(qw.codes.cpu().T, bits),
        "qzeros": _pack_dim0((zeros - 1).T, bits).T.contiguous(),
        "scales": qw.scales.cpu().to(torch.float16).contiguous(),
        "g_idx": qw.g_idx.cpu().to(torch.int32).contiguous(),
    }


def unpack_gptq_v1(tensors: dict[str, torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    """fp32 [out, in] weight a GPTQ v1 reader (GPTQModel, vLLM's gptq) decodes from the tensors.

    Each zero field is read as (stored & mask) + 1, and w = scale[g] * (q - zero[g]) with g = g_idx[i].
    Readers compute this product in fp16; ours is the exact fp32 value (theirs equals ours rounded to fp16).
    """
    codes, zeros, scales, g = decode_gptq_v1(tensors, bits, group_size)
    scale = scales.to(dtype=torch.float32)[g].T
    zero = zeros.to(dtype=torch.float32)[g].T
    return scale * (codes.float() - zero)


def decode_gptq_v1(
    tensors: dict[str, torch.Tensor], bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in], zeros [G, out], scales [G, out] as stored, g_idx [in] long) of one GPTQ v1 Linear."""
    if bits not in SUPPORTED_BITS:
        raise UsageError(f"bits={bits} is not supported; use one of {list(SUPPORTED_BITS)}")
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in tensors]
    if missing:
        raise DFlashQuantError(f"GPTQ v1 tensors lack {missing}; is this a GPTQ checkpoint?")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    device = qweight.device
    in_features = qweight.shape[0] * 32 // bits
    out_features = qweight.shape[1]
    codes = _unpack_dim0(qweight, bits).T  # [out, in]
    zeros = _unpack_dim0(qzeros.T.contiguous(), bits, out_features).T + 1  # [G, out]
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        width = in_features if group_size == -1 else group_size
        g_idx = torch.arange(in_features, device=device) // width
    g = g_idx.to(device=device, dtype=torch.long)
    if g.numel() != in_features or int(g.max()) >= scales.shape[0]:
        raise DFlashQuantError(
            f"g_idx (length {g.numel()}, max {int(g.max())}) does not fit qweight ({in_features} inputs) "
            f"and scales ({scales.shape[0]} groups)"
        )
    return codes, zeros, scales.to(device), g


def gptq_quantization_config(
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool,
    static_groups: bool = False,
    damp_percent: float = 0.01,
    *,
    true_sequential: bool = True,
    modules_in_block_to_quantize: list[list[str]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`quantization_config` for config.json (also the whole quantize_config.json), GPTQ v1 checkpoint."""
    if bits not in SUPPORTED_BITS:
        raise UsageError(f"bits={bits} is not supported; use one of {list(SUPPORTED_BITS)}")
    cfg: dict[str, Any] = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "static_groups": static_groups,
        "damp_percent": damp_percent,
        "true_sequential": true_sequential,
        "pack_dtype": "int32",
        "lm_head": False,
    }
    if modules_in_block_to_quantize is not None:
        cfg["modules_in_block_to_quantize"] = modules_in_block_to_quantize
    if extra:
        clash = set(extra) & set(cfg)
        if clash:
            raise UsageError(f"extra quantization_config keys {sorted(clash)} would overwrite standard keys")
        cfg.update(extra)
    return cfg


# vLLM's rules for running a GPTQ checkpoint on Marlin, as read in vLLM's source:
# vllm/model_executor/layers/quantization/gptq_marlin.py (GPTQMarlinConfig.TYPE_MAP,
# is_gptq_marlin_compatible) and vllm/model_executor/layers/quantization/utils/marlin_utils.py
# (MARLIN_SUPPORTED_GROUP_SIZES). A config that fails them is served by the slower `gptq` (exllama) path.
MARLIN_BITS_SYM = {(4, True), (8, True)}
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
MARLIN_REQUIRED_KEYS = ("bits", "group_size", "sym", "desc_act")


def marlin_problems(quant_config: dict[str, Any], shapes: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """Why vLLM's gptq_marlin would refuse this config (empty list: it accepts). `shapes`: name -> (out, in)."""
    problems = []
    method = str(quant_config.get("quant_method", "")).lower()
    if method != "gptq":
        problems.append(f"quant_method is {quant_config.get('quant_method')!r}, gptq_marlin needs 'gptq'")
    fmt = quant_config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", None):
        problems.append(f"checkpoint_format is {fmt!r}; vLLM's gptq_marlin loads the v1 'gptq' format")
    missing = [k for k in MARLIN_REQUIRED_KEYS if quant_config.get(k) is None]
    if missing:
        problems.append(f"missing required keys {missing}")
    bits, sym, group = quant_config.get("bits"), quant_config.get("sym"), quant_config.get("group_size")
    if bits is not None and bits not in (4, 8):
        problems.append(f"bits={bits}: gptq_marlin supports only 4 and 8")
    if sym is not None and not sym:
        problems.append("sym=False: gptq_marlin supports only symmetric GPTQ (no zero points)")
    if group is not None and group not in MARLIN_GROUP_SIZES:
        problems.append(f"group_size={group}: gptq_marlin supports {list(MARLIN_GROUP_SIZES)}")
    if shapes and group not in (None, -1):
        for name, (_, in_features) in shapes.items():
            if in_features % group:
                problems.append(f"{name}: input width {in_features} is not a multiple of group_size {group}")
    return problems
