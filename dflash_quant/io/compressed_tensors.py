"""The compressed-tensors `pack-quantized` codec (vLLM's and llm-compressor's W4A16 / WnA16 checkpoints), through
the `compressed_tensors` library's own packer and decompressor.

Per quantized Linear: `weight_packed` int32 (signed codes q - 2**(bits-1), packed along the input dim),
`weight_scale` fp16 [out, groups], `weight_shape` [out, in], and for asymmetric grids `weight_zero_point`
(signed, packed along the output dim).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dflash_quant.errors import DFlashQuantError

FORMAT = "pack-quantized"


def pack_tensors(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, sym: bool, name: str = ""
) -> dict[str, torch.Tensor]:
    """The tensors of one Linear from GPTQ's codes [out, in] (unsigned), scales and zeros [G, out]; a symmetric grid
    must have every zero at 2**(bits-1) (compressed-tensors stores none)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (bits - 1)
    x_q = (codes.to(torch.int16) - offset).to(torch.int8)
    out = {
        "weight_packed": pack_to_int32(x_q, bits),
        "weight_scale": scales.T.contiguous().to(torch.float16),  # [out, groups]
        "weight_shape": torch.tensor([codes.shape[0], codes.shape[1]], dtype=torch.int64),
    }
    if not sym:
        zp = (zeros.T.to(torch.int16) - offset).to(torch.int8).contiguous()  # [out, groups]
        out["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0).contiguous()
    elif not torch.all(zeros == offset):
        raise DFlashQuantError(f"{name}: symmetric GPTQ zero points are not {offset}; re-export the artifact")
    return out


READ_BITS = (2, 3, 4, 8)


def scheme_problem(scheme: Any) -> str | None:
    """What in a config group's weight scheme this reader cannot decode (it would decode it wrongly or crash)."""
    w = scheme.weights
    if w is None:
        return "quantizes no weights"
    kind = getattr(w.type, "value", w.type)
    strategy = getattr(w.strategy, "value", w.strategy)
    if kind != "int":
        return f"has weight type {kind!r}"
    if w.num_bits not in READ_BITS:
        return f"has num_bits {w.num_bits} (readable: {', '.join(map(str, READ_BITS))})"
    if strategy not in ("group", "channel"):
        return f"has strategy {strategy!r} (readable: group, channel)"
    if scheme.input_activations is not None:
        return "quantizes activations"
    return None


def read_compressed_tensors(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dense fp32 weights through the library's own decompressor (scales upcast first: the product is exact)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    try:
        config = QuantizationConfig.model_validate({k: v for k, v in qcfg.items() if k != "dflash_quant"})
    except Exception as exc:  # pydantic's error is long: its first problem is enough for one line
        lines = str(exc).strip().splitlines()
        what = type(exc).__name__
        if len(lines) > 2:  # pydantic: a location line, then the message
            loc = ".".join(p for p in lines[1].strip().split(".") if not p.startswith("function-"))
            what = f"{loc}: {lines[2].split(' [type=')[0].strip()}"
        raise DFlashQuantError(
            f"quantization_config is not a valid compressed-tensors config ({what}); restore config.json from "
            "the export or re-export it"
        ) from exc
    if config.format != FORMAT:
        raise DFlashQuantError(
            f"compressed-tensors format {config.format!r} cannot be read here; dflash-quant reads the {FORMAT} "
            "checkpoints it writes"
        )
    schemes = list(config.config_groups.values())
    for name, scheme in config.config_groups.items():
        if problem := scheme_problem(scheme):
            raise DFlashQuantError(
                f"compressed-tensors config group {name!r} {problem}; dflash-quant reads the int {FORMAT} "
                "schemes it writes (re-export the artifact)"
            )

    def scheme_of(name: str):
        if len(schemes) == 1:
            return schemes[0]
        for scheme in schemes:  # a mix: the group whose regex names this Linear
            if any(t.startswith("re:") and re.match(t[3:], name) for t in scheme.targets):
                return scheme
        raise DFlashQuantError(f"no config group of the compressed-tensors config names {name}; re-export")

    out: dict[str, torch.Tensor] = {}
    bases = {k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")}
    for key, value in tensors.items():
        if key.rsplit(".", 1)[0] not in bases:
            out[key] = value
    for base in sorted(bases):
        state = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == base}
        if "weight_g_idx" in state:
            raise DFlashQuantError(
                f"{base} has weight_g_idx (group act-order), which compressed-tensors no longer reads"
            )
        state["weight_scale"] = state["weight_scale"].float()
        weight = PackedQuantizationCompressor.decompress(state, scheme_of(base))["weight"]
        out[f"{base}.weight"] = weight.float()
    return out
