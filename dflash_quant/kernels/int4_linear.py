"""A quantized drafter kept in int4 on CUDA: its GPTQ Linears run through an int4 matmul kernel.

Kernels (chosen by `--int4-kernel`, `auto` picks the first that runs here, in KERNEL_ORDER):
- cuda:     ours (dflash_quant/kernels/int4_cuda.cu), CUDA C++ built on first use; codes pre-shuffled at load into the
            tensor-core operand order, each group's x (q - z) summed in fp32 and scaled once, so no weight is
            rounded (closer to the fp32 dequantized matmul than the bf16 dequantized path).
- triton:   ours (dflash_quant/kernels/int4_triton.py), split-K on GPTQ v1's own qweight layout with fp16 scales as
            stored; its dequantized tile equals the bf16 weight of the dequantized path bit for bit, so only
            the summation order differs from it.
- tinygemm: torch's `_weight_int4pack_mm`; scales and zeros held in bf16, inputs a multiple of 128 wide.
- gemlite:  gemlite's A16Wn (Triton, group-wise scales and zeros); scales and zeros*scales held in bf16.
`dequant` keeps today's path (weights dequantized to the model dtype). Act-order weights have their input
columns permuted once at load so each group is contiguous; forward gathers the input columns to match.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_quant.errors import UsageError
from dflash_quant.io.gptq_v1 import decode_gptq_v1, pack_dim0
from dflash_quant.io.weights import read_safetensors
from dflash_quant.kernels import int4_cuda
from dflash_quant.kernels.int4_choice import KERNEL_ORDER, check_int4_kernel

MAX_KERNEL_ROWS = 64  # our Triton kernel takes up to 64 rows per launch; more rows go through a bf16 GEMM
DEQUANTIZING = ("cuda", "triton")  # kernels whose Int4Linear rebuilds its bf16 weight (Int4QKV needs it)


@dataclass
class Int4Codes:
    """One 4-bit Linear: codes [out, in] in 0..15, zeros/scales [groups, out], g_idx [in]."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor  # as stored (fp16 for GPTQ v1)
    g_idx: torch.Tensor
    group_size: int  # inputs per group

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in], the value the dequantized path holds (before its cast to the model dtype)."""
        g = self.g_idx.long()
        return self.scales.float()[g].T * (self.codes.float() - self.zeros.float()[g].T)

    def to(self, device: torch.device) -> Int4Codes:
        return Int4Codes(
            self.codes.to(device), self.zeros.to(device), self.scales.to(device), self.g_idx.to(device), self.group_size
        )

    def in_order(self) -> tuple[Int4Codes, torch.Tensor | None]:
        """The same Linear with input columns sorted by group (and the permutation), or itself if already so.

        Raises ValueError when the groups are not all `group_size` wide (then no permutation makes them tiles)."""
        k = self.shape[1]
        expected = torch.arange(k, device=self.g_idx.device) // self.group_size
        g = self.g_idx.long()
        if torch.equal(g, expected):
            return self, None
        perm = torch.argsort(g, stable=True)
        if not torch.equal(g[perm], expected):
            raise ValueError("groups of unequal width")
        return Int4Codes(self.codes[:, perm], self.zeros, self.scales, expected, self.group_size), perm


def kernel_problem(name: str, codes: Int4Codes, device: torch.device) -> str | None:
    """Why `name` cannot run this Linear here (None: it can)."""
    out_f, in_f = codes.shape
    if device.type != "cuda":
        return "int4 kernels need CUDA"
    try:
        codes.in_order()
    except ValueError as exc:
        return f"its input groups cannot be made contiguous tiles ({exc})"
    if name == "cuda":
        return int4_cuda.shape_problem(out_f, in_f, codes.group_size) or int4_cuda.build_problem(device)
    if name in ("triton", "gemlite") and importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if name == "gemlite" and importlib.util.find_spec("gemlite") is None:
        return "gemlite is not installed (pip install gemlite)"
    if name == "triton" and codes.group_size % 16:
        return f"group size {codes.group_size} is not a multiple of 16"
    if name == "tinygemm":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return "this torch has no _weight_int4pack_mm"
        if in_f % 128 or out_f % 8 or codes.group_size not in (32, 64, 128, 256):
            return f"tinygemm needs in % 128 == 0, out % 8 == 0, group 32..256 (got {out_f}x{in_f} g{codes.group_size})"
    if name == "gemlite" and (in_f % 32 or out_f % 32 or codes.group_size % 32):
        return f"gemlite needs in, out and the group size multiples of 32 (got {out_f}x{in_f} g{codes.group_size})"
    return None


def tinygemm_pack(unsigned: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [out, in] (in % 128 == 0) in tinygemm's tiled layout (`_weight_int4pack_mm`)."""
    u8 = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)  # [out, in/2], even column high
    return torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), 8 if unsigned.shape[1] % 1024 == 0 else 2)


class Int4Linear(nn.Module):
    """y = x W^T + b with W held only as 4-bit codes in the layout of one kernel."""

    perm: torch.Tensor | None
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    packed: torch.Tensor
    sz: torch.Tensor
    counters: torch.Tensor

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None, kernel: str):
        super().__init__()
        codes, perm = codes.in_order()
        self.out_features, self.in_features = codes.shape
        self.kernel, self.group_size = kernel, codes.group_size
        self.register_buffer("perm", perm)
        if bias is not None:
            bias = bias.to(device=codes.codes.device, dtype=torch.bfloat16)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._gemlite: Any = None
        if kernel == "cuda":
            weights = int4_cuda.CudaWeights(codes.codes, codes.zeros, codes.scales, self.group_size)
            for name, tensor in weights.buffers().items():
                self.register_buffer(name, tensor)
            self._cuda_split = weights.split
            self._cuda_variant = 0  # benchmarks/gpu_int4.py tries development variants of the kernel
        elif kernel == "triton":
            self.register_buffer("qweight", pack_dim0(codes.codes.T, 4))  # [in/8, out]
            self.register_buffer("scales", codes.scales.to(torch.float16).contiguous())
            self.register_buffer("zeros", codes.zeros.to(torch.float16).contiguous())
        elif kernel == "tinygemm":
            scale = codes.scales.float()
            zero = (8 - codes.zeros.float()) * scale  # tinygemm decodes (u - 8) * scale + zero
            self.register_buffer("packed", tinygemm_pack(codes.codes.to(torch.int32)))
            self.register_buffer("sz", torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous())
        elif kernel == "gemlite":
            from gemlite.helper import A16Wn

            self._gemlite = A16Wn(device=codes.codes.device, dtype=torch.bfloat16).from_weights(
                codes.codes.to(torch.uint8).contiguous(),
                codes.scales.T.contiguous().to(torch.bfloat16),
                codes.zeros.T.contiguous().to(torch.bfloat16),
                4,
                self.group_size,
            )
        else:
            raise UsageError(f"unknown int4 kernel {kernel!r}; use one of {', '.join(KERNEL_ORDER)}")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, kernel={self.kernel}"

    def dequantized(self) -> torch.Tensor:
        """The bf16 weight [out, in] rebuilt from the codes (the dequantized path's bits; input columns in the
        kernel's order), for inputs of many rows: cuda and triton only (DEQUANTIZING)."""
        if self.kernel == "cuda":
            return int4_cuda.module().w4_dequant(self.qweight, self.scales, self.zeros, self.group_size)
        if self.kernel == "triton":
            from dflash_quant.kernels.int4_triton import dequantize_t

            return dequantize_t(self.qweight, self.scales, self.zeros, self.group_size).T
        raise NotImplementedError(f"the {self.kernel} kernel's layout is not rebuilt in bf16 here")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.perm is not None:
            flat = flat[:, self.perm]
        if self.kernel == "cuda":
            y = int4_cuda.matmul(
                flat,
                self.qweight,
                self.scales,
                self.zeros,
                self.counters,
                self.group_size,
                self._cuda_split,
                self._cuda_variant,
            )
        elif self.kernel == "triton":
            from dflash_quant.kernels.int4_triton import w4a16_matmul

            if flat.shape[0] <= MAX_KERNEL_ROWS:
                y = w4a16_matmul(flat, self.qweight, self.scales, self.zeros, self.group_size)
            else:  # a prompt's worth of rows: compute-bound, so rebuild the bf16 weight once and use cuBLAS
                from dflash_quant.kernels.int4_triton import dequantize_t

                y = flat @ dequantize_t(self.qweight, self.scales, self.zeros, self.group_size)
        elif self.kernel == "tinygemm":
            y = torch.ops.aten._weight_int4pack_mm(flat.contiguous(), self.packed, self.group_size, self.sz)
        else:
            y = self._gemlite(flat.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def gptq_codes(path: Path, qcfg: dict[str, Any]) -> dict[str, tuple[Int4Codes, torch.Tensor | None]]:
    """Every GPTQ v1 Linear of a drafter directory: name (without `model.`) -> (codes, bias)."""

    tensors = read_safetensors(path)
    bits, group = int(qcfg["bits"]), int(qcfg["group_size"])
    out: dict[str, tuple[Int4Codes, torch.Tensor | None]] = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        base = key[: -len(".qweight")]
        parts = {
            s: tensors[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if f"{base}.{s}" in tensors
        }
        codes, zeros, scales, g_idx = decode_gptq_v1(parts, bits, group)
        width = codes.shape[1] if group == -1 else group
        name = base[len("model.") :] if base.startswith("model.") else base
        out[name] = (Int4Codes(codes, zeros, scales, g_idx, width), tensors.get(f"{base}.bias"))
    return out


def plan(
    choice: str, qcfg: dict[str, Any] | None, device: torch.device, dtype: torch.dtype
) -> tuple[list[str], str | None]:
    """Kernels to try for a drafter (in order), or none and why the dequantized path runs."""
    check_int4_kernel(choice)
    if choice == "dequant":
        return [], "--int4-kernel dequant"
    if not qcfg:
        return [], "the drafter is not quantized"
    if qcfg.get("quant_method") != "gptq":
        return [], f"int4 kernels read GPTQ v1 artifacts; this one is {qcfg.get('quant_method')!r}"
    if int(qcfg.get("bits", 0)) != 4:
        return [], f"int4 kernels need 4 bits; this artifact has {qcfg.get('bits')}"
    if device.type != "cuda":
        return [], "int4 kernels need CUDA"
    if dtype != torch.bfloat16:
        return [], f"int4 kernels take bf16 activations; this run is {str(dtype).replace('torch.', '')}"
    return (list(KERNEL_ORDER) if choice == "auto" else [choice]), None


def use_int4_kernel(
    model: nn.Module, path: Path, qcfg: dict[str, Any] | None, choice: str, fuse: bool = True, qkv: bool = True
) -> dict[str, Any]:
    """Replace the drafter's GPTQ Linears by Int4Linear (k/v and gate/up fused when `fuse`, q/k/v with `qkv`);
    returns what ran (`kernel`, `linears`, `fused_groups`, `reason`).

    A kernel that cannot run one of the Linears is passed over for the next; with none left the drafter
    keeps its dequantized weights and `reason` says why. An explicit kernel that cannot run is an error."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kernels, reason = plan(choice, qcfg, device, dtype)
    if not kernels:
        return {"kernel": "dequant", "linears": 0, "reason": reason}
    assert qcfg is not None
    layers = {n: (c.to(device), b) for n, (c, b) in gptq_codes(path, qcfg).items()}
    try:
        return use_int4_codes(model, layers, kernels, fuse, qkv)
    except KernelUnavailable as exc:
        if choice != "auto":
            raise UsageError(f"--int4-kernel {choice} cannot run this drafter ({exc}); use auto or dequant") from exc
        return {"kernel": "dequant", "linears": 0, "reason": str(exc)}


class KernelUnavailable(Exception):
    """None of the kernels tried can run every Linear here (the message says why for each)."""


def use_int4_codes(
    model: nn.Module,
    layers: dict[str, tuple[Int4Codes, torch.Tensor | None]],
    kernels: list[str],
    fuse: bool = True,
    qkv: bool = True,
) -> dict[str, Any]:
    """Replace the Linears named in `layers` (codes on the model's device) with the first kernel of `kernels`
    that runs them all; raises KernelUnavailable when none does (the weights are then left as they were). With
    `fuse`, Linears on one input run as one GEMM: k|v and gate|up, and q|k|v (Int4QKV) with `qkv`. q|k|v is on by
    default since it was timed (H100): a step's GEMMs at 16 rows 0.371 ms against 0.398 with q and
    k|v apart, one layer's q/k/v 11.7-15.0 us against 16.8-18.6 at 0-16 context rows, the same tokens as the
    dequantized drafter (benchmarks/results/int4_cuda_dev/*_h100_s15*.json)."""
    device = next(model.parameters()).device
    problems: list[str] = []
    for kernel in kernels:
        found = next(((n, p) for n, (c, _) in layers.items() if (p := kernel_problem(kernel, c, device))), None)
        if found is None:
            break
        problems.append(f"{kernel}: {found[0]}: {found[1]}")
    else:
        raise KernelUnavailable("; ".join(problems))
    for name, (codes, _) in layers.items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != codes.shape:
            raise UsageError(f"quantized {name} does not match the drafter's Linear; re-export the artifact")
    layers = dict(layers)
    # q joins k|v only where the attention can run the fused GEMM itself (DFlashAttention's qkv_proj)
    qkv = (
        qkv
        and kernel in DEQUANTIZING
        and all(hasattr(model.get_submodule(n.rpartition(".")[0]), "qkv_proj") for n in layers if n.endswith(QKV[0]))
    )
    groups = shared_input_groups(layers, qkv) if fuse else []
    for members in groups:
        parts = [layers.pop(n) for n in members]
        bias = None if parts[0][1] is None else torch.cat([b for _, b in parts])  # type: ignore[misc]
        fused = Int4Linear(concat_outputs([c for c, _ in parts]), bias, kernel)
        is_qkv = members[0].endswith("." + QKV[0])
        # members called on one tensor share its output; q reads other rows than k|v (its own, when called alone)
        sharing = members[1:] if is_qkv else members
        state = _SharedInput(len(sharing))
        start = 0
        for name, (codes, _) in zip(members, parts, strict=True):
            own = state if name in sharing else _SharedInput(1)
            _replace(model, name, Int4Member(fused, start, start + codes.shape[0], own))
            start += codes.shape[0]
        if is_qkv:  # the attention runs q|k|v itself (q's input is k's last rows)
            model.get_submodule(members[0].rpartition(".")[0]).qkv_proj = Int4QKV(fused, parts[0][0].shape[0])
    for name, (codes, bias) in layers.items():
        _replace(model, name, Int4Linear(codes, bias, kernel))
    linears = len(layers) + sum(len(m) for m in groups)
    return {"kernel": kernel, "linears": linears, "fused_groups": len(groups), "reason": None}


@functools.cache
def runtime_revision() -> str:
    """A digest of the int4 runtime's sources (the kernels, their split-K rules, the fusion of Linears): a change
    there changes an int4 drafter's summation order, so cached runs are keyed by it."""
    here = Path(__file__)
    digest = hashlib.sha256()
    for path in (here, here.with_name("int4_triton.py"), Path(int4_cuda.__file__), int4_cuda.SOURCE):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_key(info: dict[str, Any]) -> str | None:
    """What a check cache key adds for a drafter run as `use_int4_kernel` reported (None: the dequantized path,
    whose runs are the weights' alone)."""
    kernel = info.get("kernel")
    return None if kernel in (None, "dequant") else f"{kernel}@{runtime_revision()}"


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


# Linears a drafter layer runs on one input, each group as one GEMM (fewer launches), the longest group first. q
# reads the block's rows h and k/v cat(ctx, h): DFlashAttention runs q|k|v through its `qkv_proj` (Int4QKV); a
# layer whose q cannot join, or a kernel that cannot rebuild its bf16 weight, still fuses k|v.
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
SHARED_INPUTS = (QKV, ("self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def shared_input_groups(layers: dict[str, tuple[Int4Codes, torch.Tensor | None]], qkv: bool = True) -> list[list[str]]:
    """Member names of each fusable group: all quantized, same width and grid layout, in-order groups, and all
    with or all without bias; q|k|v only with `qkv`."""
    groups: list[list[str]] = []
    taken: set[str] = set()
    for suffixes in SHARED_INPUTS if qkv else SHARED_INPUTS[1:]:
        for name in layers:
            if not name.endswith("." + suffixes[0]):
                continue
            prefix = name[: -len(suffixes[0])]
            members = [prefix + s for s in suffixes]
            if not all(m in layers and m not in taken for m in members):
                continue
            codes = [layers[m][0] for m in members]
            same = {(c.shape[1], c.group_size, c.scales.dtype) for c in codes}
            biased = {layers[m][1] is None for m in members}
            if len(same) == 1 and len(biased) == 1 and all(c.in_order()[1] is None for c in codes):
                groups.append(members)
                taken.update(members)
    return groups


def concat_outputs(codes: list[Int4Codes]) -> Int4Codes:
    """Linears on one input as one Linear: their outputs side by side (same input width and groups)."""
    return Int4Codes(
        torch.cat([c.codes for c in codes]),
        torch.cat([c.zeros for c in codes], dim=1),
        torch.cat([c.scales for c in codes], dim=1),
        codes[0].g_idx,
        codes[0].group_size,
    )


class _SharedInput:
    """The input a fused group's first member saw (held, so its memory cannot pass to another tensor) and the
    output, until every member has taken its columns. Members must be called on the same tensor without an
    in-place change in between where it is an inference tensor (no version counter): DFlash's attention (k, v)
    and MLP (gate, up) call them back to back."""

    def __init__(self, members: int) -> None:
        self.members, self.left = members, 0
        self.x: torch.Tensor | None = None
        self.version = -1
        self.y: torch.Tensor | None = None


class Int4Member(nn.Module):
    """One Linear of a fused group: the first member called on a tensor runs the group's GEMM, the others
    called on the same unchanged tensor take their columns of it; any other input runs the GEMM again."""

    def __init__(self, fused: Int4Linear, start: int, end: int, state: _SharedInput):
        super().__init__()
        self.fused, self.start, self.end, self.state = fused, start, end, state
        self.in_features, self.out_features = fused.in_features, end - start

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of a fused {self.fused.kernel} GEMM"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.state
        version = -1 if x.is_inference() else x._version  # inference tensors keep no version counter
        if st.x is not x or st.version != version or st.y is None:
            st.y, st.x, st.version, st.left = self.fused(x), x, version, st.members - 1
        else:
            st.left -= 1
        y = st.y
        if st.left == 0:  # every member has its columns: let go of the input and output
            st.x = st.y = None
        return y[..., self.start : self.end]


class Int4QKV(nn.Module):
    """q|k|v of a DFlash attention layer held as one int4 Linear. q reads the block's rows h, k and v the context's
    and the block's, cat(ctx, h), whose tail is h. While the kernel takes cat(ctx, h) (a decode step: at most
    `rows` rows) the three run as one kernel over it and q's context rows are dropped (the kernel streams the same
    weight whatever the rows); past that (a prompt's context) the bf16 weight is rebuilt once and q multiplies h
    alone, so a long prompt pays no q over its context."""

    def __init__(self, fused: Int4Linear, q_features: int, rows: int = MAX_KERNEL_ROWS):
        super().__init__()
        self.fused, self.q_features, self.rows = fused, q_features, rows

    def extra_repr(self) -> str:
        return f"q={self.q_features}, k|v={self.fused.out_features - self.q_features}, one GEMM up to {self.rows} rows"

    def forward(self, h: torch.Tensor, kv_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q of h, k|v of kv_in), last dims q_features and the rest."""
        nq = self.q_features
        if kv_in.numel() // kv_in.shape[-1] <= self.rows:
            y = self.fused(kv_in)
            return y[..., kv_in.shape[-2] - h.shape[-2] :, :nq], y[..., nq:]
        w = self.fused.dequantized()
        b = self.fused.bias
        q = F.linear(h.to(w.dtype), w[:nq], None if b is None else b[:nq]).to(h.dtype)
        kv = F.linear(kv_in.to(w.dtype), w[nq:], None if b is None else b[nq:]).to(kv_in.dtype)
        return q, kv


def int4_matmul_error(layer: nn.Module, codes: Int4Codes, rows: int = 16, seed: int = 0) -> float:
    """max |kernel - fp32 dequant matmul| / max |fp32 dequant matmul| on random bf16 rows."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, codes.shape[1], generator=gen).to(device=codes.codes.device, dtype=torch.bfloat16)
    ref = F.linear(x.float(), codes.dequantize())
    got = layer(x).float()
    return float((got - ref).abs().max() / ref.abs().max())
