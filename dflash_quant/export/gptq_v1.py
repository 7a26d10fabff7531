"""GPTQ v1 checkpoints of quantized drafters (AutoGPTQ / GPTQModel / vLLM `gptq` and `gptq_marlin`): each
QuantizedWeight packed by the codec (io.gptq_v1), the `quantization_config`, and vLLM's Marlin rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_quant import __version__
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.export.gptq_dynamic import layer_setting
from dflash_quant.io.gptq_v1 import pack_tensors, unpack_dim0
from dflash_quant.io.weights import read_safetensors, save_safetensors
from dflash_quant.models.config import read_config_json
from dflash_quant.quantize.grid import QuantizedWeight
from dflash_quant.quantize.spec import SUPPORTED_BITS, QuantSpec


def pack_gptq_v1(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The four GPTQ v1 tensors for one quantized Linear (on CPU)."""
    return pack_tensors(qw.codes, qw.zeros, qw.scales, qw.g_idx, qw.spec.bits, qw.name)


@dataclass
class GptqArtifact:
    """A GPTQ v1 artifact in memory: its config, the quantized Linears as codes, everything else as stored."""

    path: Path
    config: dict[str, Any]
    qcfg: dict[str, Any]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def bits(self) -> int:
        return int(self.qcfg["bits"])

    @property
    def group_size(self) -> int:
        return int(self.qcfg["group_size"])

    @property
    def sym(self) -> bool:
        return bool(self.qcfg.get("sym", True))

    def save_packed(self, dst: Path, pack: Callable[[QuantizedWeight], dict[str, torch.Tensor]], fmt: str) -> int:
        """model.safetensors with each quantized Linear as `pack` lays it out and the rest as stored; returns the
        quantized tensors' bytes."""
        tensors: dict[str, torch.Tensor] = {}
        qbytes = 0
        for name, qw in self.quantized.items():
            for part, t in pack(qw).items():
                tensors[f"{name}.{part}"] = t.contiguous()
                qbytes += t.numel() * t.element_size()
        for key, value in self.dense.items():
            tensors[key] = value.contiguous()
        save_safetensors(
            tensors,
            dst / "model.safetensors",
            metadata={"format": fmt, "quantized_by": f"dflash-quant {__version__}"},
        )
        return qbytes


def read_gptq_artifact(path: Path) -> GptqArtifact:
    """Codes, scales, zeros and g_idx of every quantized Linear of a GPTQ v1 artifact (exact, no float math)."""

    path = Path(path)
    config = read_config_json(path)
    qcfg = config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "gptq":
        found = qcfg.get("quant_method") or ("mlx" if config.get("quantization") else "none: a bf16 drafter")
        raise UsageError(
            f"{path} is not a GPTQ v1 artifact (quant_method {found}); export converts the output of `dflash-quant gptq`"
        )
    tensors = read_safetensors(path)
    bits, group = int(qcfg["bits"]), int(qcfg["group_size"])
    spec = QuantSpec(bits=bits, group_size=group, sym=bool(qcfg.get("sym", True)))
    art = GptqArtifact(path=path, config=config, qcfg=qcfg)
    bases = {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    for key, value in tensors.items():
        if key.rsplit(".", 1)[0] not in bases:
            art.dense[key] = value
    for base in sorted(bases):
        try:
            qweight, qzeros, scales, g_idx = (tensors[f"{base}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx"))
        except KeyError as exc:
            raise DFlashQuantError(f"quantized layer {base} lacks {exc.args[0]}; re-export the artifact") from exc
        out_features = qweight.shape[1]
        bits, group = layer_setting(qcfg, base)  # a mixed artifact's `dynamic` rule, else the config's
        spec = QuantSpec(bits=bits, group_size=group, sym=bool(qcfg.get("sym", True)))
        codes = unpack_dim0(qweight, bits).T.contiguous()
        zeros = unpack_dim0(qzeros.T.contiguous(), bits, out_features).T + 1
        art.quantized[base] = QuantizedWeight(
            codes=codes.to(torch.uint8),
            scales=scales.float(),
            zeros=zeros.to(torch.int32),
            g_idx=g_idx.to(torch.int32),
            spec=spec,
            desc_act=bool(qcfg.get("desc_act")),
            static_groups=bool(qcfg.get("static_groups")),
            name=base,
        )
    return art


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
