"""compressed-tensors `pack-quantized` (llm-compressor's format, vLLM's preferred), through the library itself.

GPTQ code q in [0, 2**b) with zero z maps onto the library's signed grid exactly: x_q = q - 2**(b-1),
zero point z - 2**(b-1) (asymmetric only; symmetric GPTQ has z = 2**(b-1), i.e. zero point 0), and the
same fp16 scale, so (x_q - zp) * scale is the GPTQ weight. Scales stay fp16 (the exact stored values);
a reader that multiplies in fp16 gets the GPTQ weight rounded to fp16, in fp32 the GPTQ weight itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dflash_quant import __version__
from dflash_quant.errors import DFlashQuantError, UsageError

FORMAT = "pack-quantized"
ACT_ORDER_PROBLEM = (
    "compressed-tensors >= 0.20 removed group act-order (a column permutation in weight_g_idx); "
    "quantize with `gptq --no-desc-act` or `--desc-act --static-groups`"
)


def grid_problem(desc_act: bool) -> str | None:
    return ACT_ORDER_PROBLEM if desc_act else None


def _scheme_args(art, bits: int | None = None, group_size: int | None = None) -> dict[str, Any]:
    """Weight args at the artifact's setting, or at one Linear's (bits, group_size) of a mix."""
    bits = art.bits if bits is None else bits
    group_size = art.group_size if group_size is None else group_size
    args: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": art.sym, "dynamic": False}
    if group_size == -1:
        args["strategy"] = "channel"
    else:
        args.update(strategy="group", group_size=group_size)
    return args


def _groups(art) -> dict[tuple[int, int], list[str]]:
    """Quantized Linears by (bits, group_size): one entry for a uniform drafter, several for a mix."""
    out: dict[tuple[int, int], list[str]] = {}
    for name, qw in art.quantized.items():
        out.setdefault((qw.spec.bits, qw.spec.group_size), []).append(name)
    return out or {(art.bits, art.group_size): []}


def _in_order(qw) -> bool:
    from dflash_quant.export.convert import columns_in_order

    return columns_in_order(qw)


LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def ignore_rules(kept: list[str], n_layers: int) -> list[str]:
    """`ignore` regexes for Linears left unquantized, matched by suffix so that engines that move the drafter's
    modules under other prefixes (vLLM: `model.fc`, layers offset by the target's count) still match, plus the
    fused names vLLM builds (`qkv_proj`, `gate_up_proj`) when all their parts are kept."""
    by_suffix: dict[str, set[str]] = {}
    for name in kept:
        suffix = name if name == "fc" else ".".join(name.split(".")[-2:])
        by_suffix.setdefault(suffix, set()).add(name)
    rules = []
    full = {s for s, names in by_suffix.items() if s == "fc" or len(names) == n_layers}
    for suffix, names in sorted(by_suffix.items()):
        if suffix in full:
            rules.append(r"re:(^|.*\.)" + re.escape(suffix) + "$")
        else:
            rules += [r"re:(^|.*\.)" + re.escape(n) + "$" for n in sorted(names)]
    if {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} <= full:
        rules.append(r"re:(^|.*\.)self_attn\.qkv_proj$")
    if {"mlp.gate_proj", "mlp.up_proj"} <= full:
        rules.append(r"re:(^|.*\.)mlp\.gate_up_proj$")
    return rules


def kept_linears(art) -> list[str]:
    """Linear weights the artifact keeps dense (profiles and --skip)."""
    kept = []
    for key, value in art.dense.items():
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base and value.dim() == 2 and (base == "fc" or base.endswith(LINEAR_SUFFIXES)):
            kept.append(base)
    return sorted(kept)


def quantization_config(art) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups = _groups(art)
    if len(groups) == 1:
        (bits, group), _ = next(iter(groups.items()))
        schemes = {
            "group_0": QuantizationScheme(
                targets=["Linear"], weights=QuantizationArgs(**_scheme_args(art, bits, group))
            )
        }
    else:  # a mix: one config group per setting, each naming its Linears (anchored suffix, as `ignore` does)
        schemes = {
            f"group_{i}": QuantizationScheme(
                targets=[r"re:(^|.*\.)" + re.escape(n) + "$" for n in sorted(names)],
                weights=QuantizationArgs(**_scheme_args(art, bits, group)),
            )
            for i, ((bits, group), names) in enumerate(sorted(groups.items()))
        }
    config = QuantizationConfig(
        config_groups=schemes,
        format=FORMAT,
        quantization_status="compressed",
        ignore=ignore_rules(kept_linears(art), int(art.config.get("num_hidden_layers", 0))),
    )
    out = config.model_dump()
    out["quant_method"] = "compressed-tensors"
    out["dflash_quant"] = {
        "from": "gptq",
        "profile": (art.qcfg.get("dflash_quant") or {}).get("profile"),
        "quantizer": f"dflash-quant:{__version__}",
    }
    return out


def pack_weight(qw) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one quantized Linear."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    bits = qw.spec.bits
    offset = 1 << (bits - 1)
    x_q = (qw.codes.to(torch.int16) - offset).to(torch.int8)
    out = {
        "weight_packed": pack_to_int32(x_q, bits),
        "weight_scale": qw.scales.T.contiguous().to(torch.float16),  # [out, groups]
        "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64),
    }
    if not qw.spec.sym:
        zp = (qw.zeros.T.to(torch.int16) - offset).to(torch.int8).contiguous()  # [out, groups]
        out["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0).contiguous()
    elif not torch.all(qw.zeros == offset):
        raise DFlashQuantError(f"{qw.name}: symmetric GPTQ zero points are not {offset}; re-export the artifact")
    if not _in_order(qw):
        raise UsageError(f"{qw.name}: {ACT_ORDER_PROBLEM}")
    return out


def write_compressed_tensors(dst: Path, art) -> dict[str, Any]:
    qbytes = art.save_packed(dst, pack_weight, "pt")
    config = dict(art.config)
    config["quantization_config"] = quantization_config(art)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "format": "compressed-tensors",
        "files": ["model.safetensors", "config.json"],
        "quantized_bytes": qbytes,
        "exact": "bit-identical codes and fp16 scales (the weight is exact in fp32, fp16-rounded by fp16 readers)",
    }


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
