"""A compressed-tensors W4A16 (pack-quantized, RTN) form of a dense target, for tests and users without one.

The decoder Linears are rounded to nearest on our GPTQ v1 grid and packed with the same codec as the drafter
export (export.compressed_tensors.pack_weight); embeddings, norms and lm_head stay dense.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_quant import __version__
from dflash_quant.errors import DFlashQuantError
from dflash_quant.export.compressed_tensors import pack_weight
from dflash_quant.io.atomic import atomic_dir
from dflash_quant.io.weights import read_safetensors
from dflash_quant.models.config import read_config_json
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec

# Decoder Linears packed: attention, MLP, and the Gated DeltaNet projections of hybrid targets (their small
# in_proj_a / in_proj_b gates stay dense and are listed in `ignore`, as in published int4 hybrids).
LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$"
)
DENSE_GATES = re.compile(r"^model\.layers\.\d+\.linear_attn\.in_proj_[ab]\.weight$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _config(spec: QuantSpec, hybrid: bool = False) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    args: dict[str, Any] = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym, "dynamic": False}
    args.update(
        {"strategy": "channel"} if spec.group_size == -1 else {"strategy": "group", "group_size": spec.group_size}
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head", *(["re:.*linear_attn\\.in_proj_[ab]$"] if hybrid else [])],
    ).model_dump()
    cfg["quant_method"] = "compressed-tensors"
    cfg["dflash_quant"] = {"from": "rtn", "quantizer": f"dflash-quant:{__version__}"}
    return cfg


def write_int4_target(src: Path, dst: Path, spec: QuantSpec, overwrite: bool = False) -> dict[str, int]:
    """Write `dst` (config, packed safetensors, tokenizer); returns {quantized, dense} tensor counts."""

    raw = read_config_json(src / "config.json")
    if raw.get("quantization_config"):
        raise DFlashQuantError(f"{src} is already quantized; pass the dense target")
    return write_packed(read_safetensors(src), raw, src, dst, spec, overwrite=overwrite)


def write_packed(
    tensors: dict[str, torch.Tensor],
    raw: dict[str, Any],
    src: Path,
    dst: Path,
    spec: QuantSpec,
    overwrite: bool = False,
) -> dict[str, int]:
    """The W4A16 target of dense `tensors` (on any device: RTN runs there) with config `raw`; tokenizer files
    are copied from `src`. Returns {quantized, dense} tensor counts."""
    out: dict[str, torch.Tensor] = {}
    n_q = 0
    hybrid = False
    for key, value in sorted(tensors.items()):
        if LINEAR.match(key):
            name = key[: -len(".weight")]
            for part, t in pack_weight(rtn_quantize(value.float(), spec, name=name)).items():
                out[f"{name}.{part}"] = t.cpu().contiguous()
            n_q += 1
        else:
            hybrid = hybrid or bool(DENSE_GATES.match(key))
            out[key] = value.cpu().contiguous()
    if n_q == 0:
        raise DFlashQuantError(f"{src}: no decoder Linears (model.layers.N.*_proj.weight) to quantize")
    with atomic_dir(dst, overwrite=overwrite, inputs=[src]) as tmp:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {**raw, "quantization_config": _config(spec, hybrid)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
    return {
        "quantized": n_q,
        "dense": sum(1 for k in out if not re.search(r"\.weight_(packed|scale|shape|zero_point)$", k)),
    }
