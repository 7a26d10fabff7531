"""Quantized targets kept quantized in memory.

transformers 5.x loads a compressed-tensors `pack-quantized` checkpoint with run_compressed=False, i.e. it
decompresses every Linear to dense: a 27B int4 target would occupy its bf16 size. Here the model is built on
the meta device, every Linear whose checkpoint holds `weight_packed` becomes a PackedLinear that keeps the
int32 codes, the scales (and zero points, g_idx) as stored, and the rest is loaded from the same tensors.

PackedLinear's forward:
- CUDA, 4 bits, bf16 input, in-order groups of 32..256: torch's tinygemm int4 kernel
  (`aten._weight_int4pack_mm` on weights repacked once by `aten._convert_weight_to_int4pack`); the repacked
  copy replaces the int32 codes (same 4 bits per weight). Not measured in this project yet (no GPU run).
- otherwise (CPU, other bit widths, act-order): dequantize a block of output rows at a time and matmul; the
  dense transient is at most CHUNK_BYTES.
GPTQ/AWQ targets go through transformers' own loader with the maintained backend (extra `gptq-target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_quant.artifact.reports import TargetQuantization
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.weights import read_safetensors
from dflash_quant.kernels.int4_linear import tinygemm_pack

CHUNK_BYTES = 8 << 20  # dense fp32 transient per dequantized block
GPTQ_EXTRA = "pip install 'dflash-quant[gptq-target]'"
TINYGEMM_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class PackedScheme:
    bits: int
    group_size: int  # -1: one group per row (strategy channel)
    symmetric: bool


def scheme_of(qcfg: dict[str, Any], source_id: str) -> PackedScheme:
    """The one weight scheme of a compressed-tensors W{4,8}A16 config (refuses what we cannot keep packed)."""
    fmt = qcfg.get("format")
    if fmt != "pack-quantized":
        raise UsageError(
            f"{source_id}: compressed-tensors format {fmt!r} cannot be kept packed; "
            "use a pack-quantized (W4A16/W8A16) target"
        )
    schemes = []
    for name, group in (qcfg.get("config_groups") or {}).items():
        if group.get("input_activations") or group.get("output_activations"):
            raise UsageError(
                f"{source_id}: config group {name} quantizes activations; only weight-only (A16) targets are supported"
            )
        w = group.get("weights") or {}
        if w.get("type", "int") != "int" or w.get("dynamic") or w.get("strategy") not in ("group", "channel"):
            raise UsageError(
                f"{source_id}: config group {name} weights {w} are not int group/channel; "
                "use a W4A16/W8A16 pack-quantized target"
            )
        bits = int(w.get("num_bits", 0))
        if bits not in (4, 8):
            raise UsageError(f"{source_id}: {bits}-bit target weights are not supported; use 4 or 8 bits")
        gs = int(w["group_size"]) if w.get("strategy") == "group" else -1
        schemes.append(PackedScheme(bits=bits, group_size=gs, symmetric=bool(w.get("symmetric", True))))
    if len(set(schemes)) != 1:
        raise UsageError(
            f"{source_id}: {len(set(schemes))} different weight schemes in config_groups; "
            "a packed target needs exactly one"
        )
    return schemes[0]


class PackedLinear(nn.Module):
    """y = x W^T + b with W held as compressed-tensors pack-quantized codes (see the module docstring)."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    weight_g_idx: torch.Tensor | None
    tinygemm_packed: torch.Tensor | None
    tinygemm_sz: torch.Tensor | None

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_zero_point: torch.Tensor | None,
        weight_g_idx: torch.Tensor | None,
        bias: torch.Tensor | None,
        scheme: PackedScheme,
        in_features: int,
        out_features: int,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)
        if weight_g_idx is not None and torch.equal(
            weight_g_idx.long(), torch.arange(in_features) // max(scheme.group_size, 1)
        ):
            weight_g_idx = None  # in-order groups: the same as no g_idx
        self.register_buffer("weight_g_idx", weight_g_idx)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kernel = "dequant-chunked"
        # tinygemm's repacked codes and scales_and_zeros, once prepared: buffers (not saved), so whatever counts
        # or moves the model's tensors sees them
        self.register_buffer("tinygemm_packed", None, persistent=False)
        self.register_buffer("tinygemm_sz", None, persistent=False)

    def extra_repr(self) -> str:
        s = self.scheme
        return f"in={self.in_features}, out={self.out_features}, bits={s.bits}, group={s.group_size}, {self.kernel}"

    def _rows_per_chunk(self) -> int:
        return max(1, min(self.out_features, CHUNK_BYTES // (4 * self.in_features)))

    def zero_points(self) -> torch.Tensor | None:
        """Signed zero points [out, groups]: packed along rows in int32 (our export, llm-compressor's older
        writers) or stored unpacked (the shape transformers 5.x allocates for them)."""
        zp = self.weight_zero_point
        if zp is None:
            return None
        if zp.dtype == torch.int32 and zp.shape[0] != self.out_features:
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            return unpack_from_int32(zp, self.scheme.bits, torch.Size(list(self.weight_scale.shape)), 0)
        if tuple(zp.shape) != tuple(self.weight_scale.shape):
            raise DFlashQuantError(
                f"weight_zero_point shape {tuple(zp.shape)} fits neither packed nor [out, groups] "
                f"{tuple(self.weight_scale.shape)}; damaged checkpoint"
            )
        return zp

    def dequantize(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """fp32 weight rows [r0, r1): (code - zero_point) * scale."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        r1 = self.out_features if r1 is None else r1
        bits, k = self.scheme.bits, self.in_features
        codes = unpack_from_int32(self.weight_packed[r0:r1], bits, torch.Size([r1 - r0, k])).float()
        scale = self.weight_scale[r0:r1].float()
        zp_all = self.zero_points()
        zp = zp_all[r0:r1].float() if zp_all is not None else None
        if self.weight_g_idx is not None:
            g = self.weight_g_idx.long()
            scale = scale[:, g]
            zp = zp[:, g] if zp is not None else None
        elif self.scheme.group_size > 0:
            scale = scale.repeat_interleave(self.scheme.group_size, dim=1)[:, :k]
            zp = zp.repeat_interleave(self.scheme.group_size, dim=1)[:, :k] if zp is not None else None
        return (codes - zp) * scale if zp is not None else codes * scale

    def tinygemm_ok(self) -> bool:
        s = self.scheme
        return (
            s.bits == 4
            and self.weight_g_idx is None
            and s.group_size in TINYGEMM_GROUPS
            and self.in_features % 128 == 0
            and self.out_features % 8 == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm")
        )

    def tinygemm_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unsigned 4-bit codes [out, in] (int32) and tinygemm's scales_and_zeros [groups, out, 2] (bf16).

        tinygemm decodes (u - 8) * scale + zero; ours is (u - 8 - zp) * scale, so zero = -zp * scale."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        codes = unpack_from_int32(self.weight_packed, 4, torch.Size([self.out_features, self.in_features]))
        unsigned = codes.to(torch.int32) + 8
        scale = self.weight_scale.float()  # [out, groups]
        zero = torch.zeros_like(scale)
        zp = self.zero_points()
        if zp is not None:
            zero = -zp.float() * scale
        sz = torch.stack([scale.T, zero.T], dim=-1).contiguous().to(torch.bfloat16)
        return unsigned, sz

    def _prepare_tinygemm(self) -> None:
        unsigned, sz = self.tinygemm_operands()
        packed = tinygemm_pack(unsigned)
        self.tinygemm_packed, self.tinygemm_sz = packed, sz.to(packed.device)
        self.weight_packed = torch.empty(0, dtype=torch.int32, device=packed.device)  # the repacked copy replaces it
        self.kernel = "tinygemm-int4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.bfloat16 and (self.tinygemm_packed is not None or self.tinygemm_ok()):
            if self.tinygemm_packed is None:
                self._prepare_tinygemm()
            packed, sz = self.tinygemm_packed, self.tinygemm_sz
            assert packed is not None and sz is not None
            flat = x.reshape(-1, self.in_features)
            y = torch.ops.aten._weight_int4pack_mm(flat, packed, self.scheme.group_size, sz)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        out = x.new_empty(*x.shape[:-1], self.out_features)
        step = self._rows_per_chunk()
        for r0 in range(0, self.out_features, step):
            r1 = min(r0 + step, self.out_features)
            w = self.dequantize(r0, r1).to(x.dtype)
            b = self.bias[r0:r1] if self.bias is not None else None
            out[..., r0:r1] = F.linear(x, w, b)
        return out


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: parameters and buffers, each storage counted once (tied weights)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes() if t.device.type != "meta" else 0
    return total


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:

    return read_safetensors(path)


def load_packed_target(
    path: Path, raw: dict[str, Any], source_id: str, dtype: torch.dtype, device: str | torch.device
) -> tuple[nn.Module, PackedScheme, int]:
    """A transformers causal LM whose quantized Linears stay packed (PackedLinear); returns (model, scheme, count)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    qcfg = raw["quantization_config"]
    scheme = scheme_of(qcfg, source_id)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # built plain; the packed modules replace the quantized Linears
    tensors = _checkpoint_tensors(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    packed_names = sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    if not packed_names:
        raise DFlashQuantError(f"{source_id}: quantization_config is compressed-tensors but no weight_packed tensors")
    for name in packed_names:
        try:
            linear = model.get_submodule(name)
        except AttributeError as exc:
            raise DFlashQuantError(
                f"{source_id}: packed tensor {name} has no Linear in the model; wrong config"
            ) from exc
        if not isinstance(linear, nn.Linear):
            raise DFlashQuantError(f"{source_id}: {name} is a {type(linear).__name__}, not a Linear")
        shape = tensors.pop(f"{name}.weight_shape", None)
        if shape is not None and tuple(int(v) for v in shape) != (linear.out_features, linear.in_features):
            raise DFlashQuantError(
                f"{source_id}: {name}.weight_shape {tuple(shape.tolist())} does not match the config "
                f"({linear.out_features}, {linear.in_features})"
            )
        bias = tensors.pop(f"{name}.bias", None)
        module = PackedLinear(
            tensors.pop(f"{name}.weight_packed").to(device),
            tensors.pop(f"{name}.weight_scale").to(device),
            _opt(tensors.pop(f"{name}.weight_zero_point", None), device),
            _opt(tensors.pop(f"{name}.weight_g_idx", None), device),
            bias.to(device=device, dtype=dtype) if bias is not None else None,
            scheme,
            linear.in_features,
            linear.out_features,
        )
        if scheme.symmetric and module.weight_zero_point is not None and module.weight_zero_point.any():
            raise DFlashQuantError(f"{source_id}: {name} is symmetric but has non-zero zero points; damaged checkpoint")
        if not scheme.symmetric and module.weight_zero_point is None:
            raise DFlashQuantError(f"{source_id}: {name} is asymmetric but has no weight_zero_point")
        if torch.device(device).type == "cuda" and dtype == torch.bfloat16 and module.tinygemm_ok():
            module._prepare_tinygemm()
        _set_module(model, name, module)
    _load_dense(model, tensors, source_id, dtype, device)
    return model, scheme, len(packed_names)


def _opt(t: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    return t.to(device) if t is not None else None


def _load_dense(model: nn.Module, tensors: dict[str, torch.Tensor], source_id: str, dtype: torch.dtype, device) -> None:
    """The checkpoint's dense tensors into the meta-built model; tied heads and non-persistent buffers rebuilt."""
    expected = {k for k, v in model.state_dict().items() if v.device.type == "meta"}
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = sorted(expected - tensors.keys() - tied)
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise DFlashQuantError(
            f"{source_id}: checkpoint does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # type: ignore[operator]  # transformers method seen through nn.Module.__getattr__
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":  # rotary: non-persistent buffers
            with torch.device(device):
                _set_module(model, name, type(module)(config=module.config))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise DFlashQuantError(f"{source_id}: no tensors for {left[:3]} in the checkpoint")


def gptq_backend_problem(method: str) -> str | None:
    """Why a GPTQ/AWQ target cannot load here (None when the maintained backend is installed)."""
    import importlib.util

    if importlib.util.find_spec("gptqmodel") is None:
        return f"the target is a {method.upper()} checkpoint and its backend (GPTQModel) is not installed; {GPTQ_EXTRA}"
    return None


def load_quantized_target(
    path: Path, raw: dict[str, Any], source_id: str, dtype: torch.dtype, device: str | torch.device
) -> tuple[nn.Module, dict[str, Any]]:
    """A quantized target, kept quantized: compressed-tensors here, GPTQ/AWQ through GPTQModel (extra)."""
    qcfg = raw["quantization_config"]
    method = str(qcfg.get("quant_method") or "").lower()
    if method == "compressed-tensors":
        model, scheme, n = load_packed_target(path, raw, source_id, dtype, device)
        kernels = sorted({m.kernel for m in model.modules() if isinstance(m, PackedLinear)})
        info = {
            "format": qcfg.get("format"),
            "quant_method": method,
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "symmetric": scheme.symmetric,
            "packed_linears": n,
            "kernel": ",".join(kernels),
        }
        return model, info
    if method in ("gptq", "awq"):
        problem = gptq_backend_problem(method)
        if problem:
            raise UsageError(f"{source_id}: {problem}")
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=False, use_safetensors=True, device_map=str(device)
            )
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise DFlashQuantError(f"cannot load {method.upper()} target {source_id} ({exc}); {GPTQ_EXTRA}") from exc
        dense = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
        info = {
            "format": method,
            "quant_method": method,
            "bits": qcfg.get("bits"),
            "group_size": qcfg.get("group_size"),
            "symmetric": qcfg.get("sym"),
            "packed_linears": sum(1 for m in model.modules() if hasattr(m, "qweight")),
            "kernel": f"gptqmodel ({dense} dense Linears left)",
        }
        return model, info
    raise UsageError(
        f"{source_id}: target quant_method {method!r} is not supported; "
        "use a compressed-tensors pack-quantized, GPTQ or AWQ target, or the dense model"
    )


def describe(model: nn.Module, info: dict[str, Any] | None):
    """TargetQuantization of a loaded target (dense targets: only resident_bytes)."""

    if info is not None:
        kernels = sorted({m.kernel for m in model.modules() if isinstance(m, PackedLinear)})
        if kernels:
            info = {**info, "kernel": ",".join(kernels)}
    return TargetQuantization.from_dict({**(info or {}), "resident_bytes": resident_bytes(model)})
