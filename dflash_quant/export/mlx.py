"""MLX affine-quantized safetensors (what `mx.quantize` produces and mlx-lm / dflash-mlx load), from GPTQ codes
(the codec: io.mlx).

MLX stores per quantized Linear `weight` (uint32 [out, in*bits/32], codes packed along the input dim, lowest
bits first, a continuous bit stream for 3-bit), `scales` and `biases` ([out, in/group]), and
`"quantization": {"group_size", "bits"}` in config.json; a weight is scales * q + biases.
GPTQ's scale * (q - zero) is the same code with biases = -scale * zero: symmetric grids (zero 2**(bits-1))
give an exact fp16 bias, asymmetric ones round the bias to fp16 once. Group sizes 32/64/128 only, no act-order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_quant.errors import UsageError
from dflash_quant.io.mlx import pack_affine
from dflash_quant.quantize.grid import columns_in_order

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 8)


def grid_problem(bits: int, group_size: int, desc_act: bool) -> str | None:
    why = []
    if group_size not in GROUP_SIZES:
        why.append(f"group size {group_size} (MLX: {', '.join(map(str, GROUP_SIZES))})")
    if bits not in BITS:
        why.append(f"{bits}-bit")
    if desc_act:
        why.append("act-order without static groups (MLX has no column permutation)")
    if why:
        return f"GPTQ with {', '.join(why)} cannot be written as MLX affine; quantize with `gptq --group-size 64 --no-desc-act` (or group 32/128, or --desc-act --static-groups)"
    return None


def pack_weight(qw) -> dict[str, torch.Tensor]:
    if not columns_in_order(qw):
        raise UsageError(f"{qw.name}: act-order GPTQ cannot be written as MLX affine; quantize with --no-desc-act")
    return pack_affine(qw.codes, qw.scales, qw.zeros, qw.spec.bits)


def write_mlx(dst: Path, art) -> dict[str, Any]:
    problem = grid_problem(
        art.bits, art.group_size, bool(art.qcfg.get("desc_act")) and not art.qcfg.get("static_groups")
    )
    if problem:
        raise UsageError(problem)
    qbytes = art.save_packed(dst, pack_weight, "mlx")
    config = dict(art.config)
    config.pop("quantization_config", None)
    config["quantization"] = {"group_size": art.group_size, "bits": art.bits, "mode": "affine"}
    config["dflash_quant"] = {
        "from": "gptq",
        "sym": art.sym,
        "profile": (art.qcfg.get("dflash_quant") or {}).get("profile"),
    }
    if "rope_theta" not in config:  # dflash-mlx builds the drafter from a top-level rope_theta
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    exact = "bit-identical codes and fp16 scales; " + (
        "biases -scale*zero exact in fp16" if art.sym else "biases -scale*zero rounded to fp16"
    )
    return {"format": "mlx", "files": ["model.safetensors", "config.json"], "quantized_bytes": qbytes, "exact": exact}
