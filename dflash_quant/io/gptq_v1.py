"""The GPTQ v1 tensor codec (AutoGPTQ / GPTQModel / vLLM `gptq` and `gptq_marlin`).

Per quantized Linear with `out` outputs, `in` inputs and G groups:
  qweight int32 [in*bits/32, out]  codes packed along the input dim, value i of a column at bit bits*i
                                   of that column's little-endian word stream (3-bit values straddle words:
                                   32 values fill exactly 3 words, GPTQModel's 10|1|10|1|10 layout);
  qzeros  int32 [G, out*bits/32]   zero-1 per field, packed the same way along the output dim;
  scales  fp16  [G, out];
  g_idx   int32 [in]               group of each input column.
"""

from __future__ import annotations

import torch

from dflash_quant.errors import DFlashQuantError, UsageError

BITS = (2, 3, 4, 8)  # the widths the format packs (32 values fill a whole number of words)


MASK32 = (1 << 32) - 1


def pack_dim0(values: torch.Tensor, bits: int) -> torch.Tensor:
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
        words[:, word] |= (v[:, i] << shift) & MASK32
        if shift + bits > 32:  # the value's high bits spill into the next word
            words[:, word + 1] |= v[:, i] >> (32 - shift)
    words = words.reshape(-1, m)[: n * bits // 32]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_dim0(words: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of pack_dim0: int32 [w, m] -> int64 [w*32/bits, m] (or the first n rows)."""
    w, m = words.shape
    total = w * 32 // bits
    x = words.to(torch.int64) & MASK32
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
    if bits not in BITS:
        raise UsageError(f"bits={bits} is not supported; use one of {list(BITS)}")
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in tensors]
    if missing:
        raise DFlashQuantError(f"GPTQ v1 tensors lack {missing}; is this a GPTQ checkpoint?")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    device = qweight.device
    in_features = qweight.shape[0] * 32 // bits
    out_features = qweight.shape[1]
    codes = unpack_dim0(qweight, bits).T  # [out, in]
    zeros = unpack_dim0(qzeros.T.contiguous(), bits, out_features).T + 1  # [G, out]
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


def pack_tensors(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int, name: str = ""
) -> dict[str, torch.Tensor]:
    """The four GPTQ v1 tensors of one Linear from codes [out, in], zeros [G, out] (>= 1: stored as zero-1),
    scales [G, out] and g_idx [in] (on CPU)."""
    out_features, in_features = codes.shape
    where = f"layer {name!r}" if name else "this layer"
    if (in_features * bits) % 32 or (out_features * bits) % 32:
        raise DFlashQuantError(
            f"{where} [{out_features}, {in_features}] cannot be packed at {bits} bits: "
            "in*bits and out*bits must be multiples of 32; keep it unquantized"
        )
    zeros = zeros.to(torch.int64).cpu()
    maxq = (1 << bits) - 1
    if torch.any(zeros < 1) or torch.any(zeros > maxq):
        raise DFlashQuantError(
            f"{where} has zero points outside [1, {maxq}], which GPTQ v1 (stores zero-1) cannot hold; "
            "quantize with QuantSpec(v1_zeros=True)"
        )
    return {
        "qweight": pack_dim0(codes.cpu().T, bits),
        "qzeros": pack_dim0((zeros - 1).T, bits).T.contiguous(),
        "scales": scales.cpu().to(torch.float16).contiguous(),
        "g_idx": g_idx.cpu().to(torch.int32).contiguous(),
    }
