"""int4 drafter kernels (dflash_quant/kernels/int4_linear.py, int4_triton.py).

CPU: the GPTQ v1 codes as the kernels read them decode to our own dequantized weight; act-order columns
permuted into tiles give the same product; the kernel choice falls back to dequant where none runs.
Triton interpreter (local only: TRITON_INTERPRET=1 and triton importable, e.g. from a --target dir, with
numpy < 2.4 ahead of it on PYTHONPATH: 2.4 breaks the interpreter's scalar conversion; triton 3.6
with numpy 2.3.5 works): our split-K kernel against the bf16 dequantized matmul, and the drafter through it. gpu: every kernel against the fp32 dequantized
matmul, and the reference pair's tau with the int4 drafter through each kernel against the dequantized one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_quant.errors import UsageError
from dflash_quant.export.gptq_v1 import pack_gptq_v1
from dflash_quant.io.gptq_v1 import decode_gptq_v1
from dflash_quant.kernels.int4_linear import (
    MAX_KERNEL_ROWS,
    Int4Codes,
    Int4Linear,
    kernel_problem,
    plan,
    use_int4_kernel,
)
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec

ROOT = Path(__file__).resolve().parents[1]


def _quantized(out_f: int, in_f: int, group: int, sym: bool, act_order: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen)
    qw = rtn_quantize(w, QuantSpec(bits=4, group_size=group, sym=sym))
    if act_order:  # the layout act-order GPTQ leaves: each input column's group taken from a permutation
        perm = torch.randperm(in_f, generator=gen)
        qw.g_idx = (torch.argsort(perm) // group).to(torch.int32)
    return qw


def _codes(qw, group: int) -> Int4Codes:
    codes, zeros, scales, g_idx = decode_gptq_v1(pack_gptq_v1(qw), 4, group)
    return Int4Codes(codes, zeros, scales, g_idx, group)


@pytest.mark.parametrize("group,sym,act_order", [(32, False, False), (128, True, False), (64, False, True)])
def test_gptq_codes_decode_to_our_dequantized_weight(group, sym, act_order):
    qw = _quantized(64, 256, group, sym, act_order)
    c = _codes(qw, group)
    assert torch.equal(c.dequantize(), qw.dequantize())
    ordered, perm = c.in_order()
    assert (perm is None) == (not act_order)
    x = torch.randn(3, 256, dtype=torch.float64)
    xp = x if perm is None else x[:, perm]
    assert torch.equal(ordered.g_idx, torch.arange(256) // group)  # every group one contiguous tile
    torch.testing.assert_close(xp @ ordered.dequantize().double().T, x @ c.dequantize().double().T)


def test_groups_of_unequal_width_cannot_be_tiled():
    c = _codes(_quantized(32, 128, 32, True, False), 32)
    c.g_idx = torch.cat([torch.zeros(40, dtype=torch.long), torch.arange(88) // 32 + 1]).clamp(max=3)
    with pytest.raises(ValueError, match="unequal width"):
        c.in_order()
    # every kernel passes over such a Linear (kernel_problem only reads the device's type: runs on CPU too)
    for kernel in ("cuda", "triton", "tinygemm", "gemlite"):
        assert "cannot be made contiguous tiles" in (kernel_problem(kernel, c, torch.device("cuda")) or "")


GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128}


@pytest.mark.parametrize(
    "choice,qcfg,device,dtype,reason",
    [
        ("dequant", GPTQ4, "cuda", torch.bfloat16, "--int4-kernel dequant"),
        ("auto", None, "cuda", torch.bfloat16, "not quantized"),
        ("auto", {**GPTQ4, "bits": 8}, "cuda", torch.bfloat16, "need 4 bits"),
        ("auto", {"quant_method": "compressed-tensors"}, "cuda", torch.bfloat16, "read GPTQ v1"),
        ("auto", GPTQ4, "cpu", torch.float32, "need CUDA"),
        ("triton", GPTQ4, "cuda", torch.float32, "bf16 activations"),
    ],
)
def test_plan_says_why_the_dequantized_path_runs(choice, qcfg, device, dtype, reason):
    kernels, why = plan(choice, qcfg, torch.device(device), dtype)
    assert kernels == [] and reason in why


def test_plan_orders_kernels_and_refuses_unknown_names():
    auto = ["cuda", "triton", "tinygemm", "gemlite"]
    assert plan("auto", GPTQ4, torch.device("cuda"), torch.bfloat16) == (auto, None)
    assert plan("gemlite", GPTQ4, torch.device("cuda"), torch.bfloat16) == (["gemlite"], None)
    with pytest.raises(UsageError, match="--int4-kernel must be one of"):
        plan("marlin", GPTQ4, torch.device("cuda"), torch.bfloat16)


def test_kernel_problems_name_the_shape():
    c = _codes(_quantized(40, 96, 32, True, False), 32)
    assert kernel_problem("triton", c, torch.device("cpu")) == "int4 kernels need CUDA"
    assert kernel_problem("cuda", c, torch.device("cpu")) == "int4 kernels need CUDA"
    if hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        assert "in % 128" in (kernel_problem("tinygemm", c, torch.device("cuda")) or "")
    # the CUDA kernel's layout: pairs of 8-output x 128-input tiles, groups of 32, 64 or whole 128-wide chunks
    from dflash_quant.kernels.int4_cuda import shape_problem

    assert "in % 128 == 0 and out % 16 == 0 (got 40x96)" in (shape_problem(40, 96, 32) or "")
    assert "group of 32, 64 or a multiple of 128" in (shape_problem(64, 384, 96) or "")
    assert shape_problem(64, 256, 256) is None and shape_problem(16, 128, 32) is None


def _rtn_artifact(pair: str, out: Path) -> Path:
    """A reference drafter, RTN 4-bit g32 asym, exported as GPTQ v1 by the real CLI."""
    cmd = [sys.executable, "-m", "dflash_quant.cli.app", "gptq", pair, "--method", "rtn", "--no-verify"]
    cmd += ["--no-card", "--format", "gptq", "--device", "cpu", "--group-size", "32", "--asym", "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
    return out


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory) -> Path:
    """The reference drafter, RTN 4-bit g32 asym, exported as GPTQ v1 by the real CLI."""
    return _rtn_artifact("reference", tmp_path_factory.mktemp("int4") / "rtn")


@pytest.fixture(scope="module")
def rtn_artifacts(rtn_artifact, tmp_path_factory) -> dict[str, Path]:
    """Both reference pairs' drafters (DFlash v1 and DFlash2), RTN 4-bit g32 asym as GPTQ v1."""
    dflash2 = _rtn_artifact("reference-dflash2", tmp_path_factory.mktemp("int4") / "rtn2")
    return {"reference": rtn_artifact, "reference-dflash2": dflash2}


def test_cpu_drafter_keeps_the_dequantized_weights(rtn_artifact):
    from dflash_quant.loading.drafter import load_drafter

    loaded = load_drafter(rtn_artifact)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    info = use_int4_kernel(loaded.model, loaded.source.path, loaded.quantization, "auto")
    assert info == {"kernel": "dequant", "linears": 0, "reason": "int4 kernels need CUDA"}
    after = loaded.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton (run locally, see module doc)")
@pytest.mark.parametrize(
    "group,sym,act_order,rows,block_n,split_k,wide",
    [
        (32, False, False, 5, 32, 3, False),
        (32, False, False, 5, 32, 3, True),
        (64, True, True, 16, 64, 1, True),
        (128, False, False, 70, 32, 2, False),
        (128, True, False, 9, 64, 2, True),
    ],
)
def test_triton_kernel_in_the_interpreter(group, sym, act_order, rows, block_n, split_k, wide):
    import triton

    from dflash_quant.kernels.int4_triton import _w4a16_kernel, reset_tuning

    config = {"BLOCK_N": block_n, "SPLIT_K": split_k, "WIDE_LOAD": wide, "SWAP_AB": wide}
    _w4a16_kernel.configs = [triton.Config(config, num_warps=4, num_stages=2)]
    reset_tuning()
    qw = _quantized(96, 384, group, sym, act_order, seed=group)
    c = _codes(qw, group)
    layer = Int4Linear(c, None, "triton")
    x = torch.randn(rows, 384).to(torch.bfloat16)
    # the interpreter runs the kernel's FP32_DOT branch (fp32 weight tile, see int4_triton.py) and truncates
    # on its cast to bf16, so the result is the fp32 dequantized matmul within one bf16 ulp
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    if rows > MAX_KERNEL_ROWS:  # many rows: the weight rebuilt in bf16 by our dequant kernel, then a bf16 GEMM
        assert torch.equal(got, x @ c.dequantize().to(torch.bfloat16).T)
        return
    ref = (x.double() @ c.dequantize().double().T).float()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp(min=2**-30))) - 7)
    assert bool(((got.float() - ref).abs() <= ulp * 1.01 + 1e-6).all())
    assert torch.equal(layer(x), got)  # split-K counters were left at zero: a second call adds up the same


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton (run locally, see module doc)")
@pytest.mark.parametrize("group,sym,act_order", [(32, False, False), (128, True, True), (64, False, True)])
def test_dequant_kernel_rebuilds_the_bf16_weight_bit_for_bit(group, sym, act_order):
    from dflash_quant.io.gptq_v1 import pack_dim0
    from dflash_quant.kernels.int4_triton import dequantize_t

    c, _ = _codes(_quantized(80, 256, group, sym, act_order, seed=3), group).in_order()
    qweight = pack_dim0(c.codes.T, 4)
    got = dequantize_t(qweight, c.scales.to(torch.float16), c.zeros.to(torch.float16), group)
    assert torch.equal(got, c.dequantize().to(torch.bfloat16).T)
    broken = qweight.clone()
    broken[3, 5] ^= 1 << 8  # one code of one word: exactly one weight must change
    diff = dequantize_t(broken, c.scales.to(torch.float16), c.zeros.to(torch.float16), group) != got
    assert int(diff.sum()) == 1 and bool(diff[3 * 8 + 2, 5])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(
    params=[(1, False, False), (4, False, False), (4, True, False), (2, False, True), (4, True, True)],
    ids=["splitk1", "splitk4", "splitk4-wide", "splitk2-swap", "splitk4-wide-swap"],
)
def triton_split(request):
    """Our kernel pinned to one config, without and with split-K (both code paths, few compilations)."""
    import triton

    from dflash_quant.kernels.int4_triton import _w4a16_kernel, reset_tuning

    saved = _w4a16_kernel.configs
    split_k, wide, swap = request.param
    config = {"BLOCK_N": 64, "SPLIT_K": split_k, "WIDE_LOAD": wide, "SWAP_AB": swap}
    _w4a16_kernel.configs = [triton.Config(config, num_warps=4, num_stages=3)]
    reset_tuning()
    yield request.param
    _w4a16_kernel.configs = saved
    reset_tuning()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kernel", ["cuda", "triton", "gemlite", "tinygemm"])
@pytest.mark.parametrize("group,sym,act_order", [(32, False, False), (128, True, False), (64, False, True)])
@pytest.mark.parametrize("rows", [1, 16, 24, 40, 100])
def test_kernel_against_fp32_dequant_matmul(kernel, group, sym, act_order, rows, triton_split):
    if kernel != "triton" and triton_split != (1, False, False):
        pytest.skip("split-K is our kernel's parameter")
    c = _codes(_quantized(1024, 2048, group, sym, act_order, seed=group), group).to(torch.device("cuda"))
    problem = kernel_problem(kernel, c, torch.device("cuda"))
    if problem:
        pytest.skip(problem)
    layer = Int4Linear(c, None, kernel)
    x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
    ref = x.float() @ c.dequantize().T
    got = layer(x).float()
    rel = float((got - ref).abs().max() / ref.abs().max())
    # triton: the dequantized bf16 weight exactly, so only the bf16 weight and output roundings (2^-8 each);
    # gemlite/tinygemm also round scales (and zeros * scales) to bf16; cuda rounds no weight (up to 64 rows:
    # only the output's bf16 rounding), and past 64 rows multiplies the dequantized bf16 weight.
    assert rel < {"triton": 8e-3, "cuda": 8e-3 if rows > 64 else 4e-3}.get(kernel, 2e-2), rel
    if kernel == "cuda":
        assert torch.equal(layer(x), layer(x))  # split-K sums partials in a fixed order: the same bits every run
    if kernel == "triton":
        assert torch.equal(layer(x), layer(x))  # split-K sums partials in a fixed order: the same bits every run
        bf16_ref = x.float() @ c.dequantize().to(torch.bfloat16).float().T
        assert float((got - bf16_ref).abs().max() / bf16_ref.abs().max()) < 4e-3


@pytest.fixture
def triton_one_config():
    import triton

    from dflash_quant.kernels.int4_triton import _w4a16_kernel, reset_tuning

    saved = _w4a16_kernel.configs
    config = {"BLOCK_N": 64, "SPLIT_K": 2, "WIDE_LOAD": True, "SWAP_AB": True}
    _w4a16_kernel.configs = [triton.Config(config, num_warps=4, num_stages=3)]
    reset_tuning()
    yield
    _w4a16_kernel.configs = saved
    reset_tuning()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "kernel,fuse",
    [
        ("cuda", "qkv"),
        ("cuda", True),
        ("cuda", False),
        ("triton", "qkv"),
        ("triton", True),
        ("triton", False),
        ("tinygemm", True),
        ("gemlite", True),
    ],
)
def test_reference_pair_tau_through_the_kernel(rtn_artifact, triton_one_config, kernel, fuse):
    """tau of the int4 drafter through the kernel within the parity gate's default tolerance (0.03) of the
    dequantized drafter's, same prompts (bf16)."""
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target
    from dflash_quant.speculative.verify import CheckSettings, spec_runs

    dev = torch.device("cuda")
    target = load_target("reference:target", device=dev, dtype=torch.bfloat16)
    prompts = encode_prompts(target, "reference:heldout", 8, False, 48)
    taus, hidden = {}, {}
    for choice in ("dequant", kernel):
        loaded = load_drafter(rtn_artifact, device=dev, dtype=torch.bfloat16)
        try:
            info = use_int4_kernel(
                loaded.model, loaded.source.path, loaded.quantization, choice, fuse=bool(fuse), qkv=fuse == "qkv"
            )
        except UsageError as exc:  # a library this machine lacks (e.g. gemlite not installed)
            assert choice not in ("triton", "cuda"), exc
            pytest.skip(str(exc))
        assert info["kernel"] == choice and (choice == "dequant") == (info["linears"] == 0)
        qkv = [layer.self_attn.qkv_proj is not None for layer in loaded.model.layers]
        assert all(qkv) == (fuse == "qkv" and choice != "dequant") and (all(qkv) or not any(qkv))
        settings = CheckSettings(48, 0.0, loaded.config.block_size, 0, stop_tokens(target))
        with torch.inference_mode():
            runs = spec_runs(loaded.model, target.model, prompts, settings)
        taus[choice] = sum(sum(r.acceptance_lengths) for r in runs) / sum(len(r.acceptance_lengths) for r in runs)
        hidden[choice] = _first_block(loaded.model, target.model, prompts[0])
    # no kernel here is exact (summation order; gemlite/tinygemm also round scales), so the gate is the tau
    # ratio; a broken kernel drafts garbage and tau falls towards 1 (the output stays the target's either way)
    assert abs(taus[kernel] / taus["dequant"] - 1) <= 0.03, taus
    # one drafter forward over the prompt and a block: the kernel's hidden states against the dequantized ones
    rel = float((hidden[kernel] - hidden["dequant"]).norm() / hidden["dequant"].norm())
    assert rel < 2e-2, rel


@torch.inference_mode()
def _first_block(drafter, target, ids: list[int]) -> torch.Tensor:
    """The drafter's hidden states for the first block after a prompt (as bench_prefill.py runs it), fp32."""
    from dflash_quant.models.model import DraftCache

    dev = next(drafter.parameters()).device
    prompt = torch.tensor([ids], device=dev)
    out = target(prompt, output_hidden_states=True)
    ctx = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    block = torch.full((1, drafter.block_size), drafter.mask_token_id, device=dev)
    block[0, 0] = out.logits[0, -1].argmax()
    positions = torch.arange(0, len(ids) + drafter.block_size, device=dev)[None]
    return drafter(target.get_input_embeddings()(block), ctx, positions, cache=DraftCache()).float()


def test_parity_and_card_record_how_the_quantized_drafter_ran(reference_artifact):
    """The real pipeline run (CPU): parity.json says the dequantized path ran and why; the card says so."""
    from dflash_quant.artifact.reports import Parity

    parity = Parity.read(reference_artifact)
    assert parity.drafter_kernel is not None
    # the default is the dequantized path (the int4 kernels are opt-in until measured faster than bf16)
    assert (parity.drafter_kernel.kernel, parity.drafter_kernel.reason) == ("dequant", "--int4-kernel dequant")
    base, quant = parity.baseline.spec_tokens_per_s, parity.quantized.spec_tokens_per_s
    assert parity.spec_speed_ratio == round(quant / base, 4)
    text = (reference_artifact / "README.md").read_text()
    assert "The quantized drafter ran with its weights dequantized to float32 (--int4-kernel dequant)." in text
    assert f"Its spec tok/s is {parity.spec_speed_ratio:.2f}x the bf16 drafter's in the same check" in text


def test_card_line_for_an_int4_kernel_run():
    from dflash_quant.model_cards.sections import drafter_kernel_line

    line = drafter_kernel_line(
        {
            "drafter_kernel": {"kernel": "triton", "linears": 36, "reason": None},
            "spec_speed_ratio": 1.234,
            "cache": {"bf16_drafter": "hit"},
        }
    )
    assert line == (
        "The quantized drafter ran in int4: 36 Linears through the `triton` kernel. Its spec tok/s is 1.23x the "
        "bf16 drafter's in the same check (the bf16 run's time comes from an earlier run's cache)."
    )
    assert "not recorded" in drafter_kernel_line({})


def test_verify_cli_reports_the_drafter_kernel(rtn_artifact):
    """Real CLI on CPU: the JSON names what ran and why; the table's footer says it in words."""
    import json

    base = [sys.executable, "-m", "dflash_quant.cli.app", "verify", str(rtn_artifact), "--compare", "reference"]
    base += ["--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "8", "--no-check-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "500"}  # rich wraps nothing at this width
    out = subprocess.run(
        [*base, "--int4-kernel", "auto", "--json"], check=True, cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert json.loads(out.stdout)["drafter_kernel"] == {
        "kernel": "dequant",
        "linears": 0,
        "reason": "int4 kernels need CUDA",
    }
    out = subprocess.run(base, check=True, cwd=ROOT, env=env, capture_output=True, text=True)  # the default
    assert f"drafter {rtn_artifact}: dequantized (--int4-kernel dequant)" in out.stdout


class _Counting(torch.nn.Module):
    """A stand-in for a fused Int4Linear that counts its GEMMs."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.calls, self.kernel = weight, 0, "counting"
        self.in_features = weight.shape[1]

    def forward(self, x):
        self.calls += 1
        return x @ self.weight.T


def test_fused_members_share_one_gemm_per_input():
    from dflash_quant.kernels.int4_linear import Int4Member, _SharedInput

    w = torch.randn(24, 8)
    fused, state = _Counting(w), _SharedInput(2)
    k, v = Int4Member(fused, 0, 16, state), Int4Member(fused, 16, 24, state)
    x = torch.randn(3, 8)
    torch.testing.assert_close(k(x), x @ w[:16].T)
    torch.testing.assert_close(v(x), x @ w[16:].T)
    assert fused.calls == 1 and state.x is None and state.y is None  # both served: nothing held
    torch.testing.assert_close(k(x), x @ w[:16].T)
    x.mul_(2)  # changed in place: not the input the cached output came from
    torch.testing.assert_close(v(x), x @ w[16:].T)
    assert fused.calls == 3
    y = x.clone()  # equal values, another tensor: computed again (identity, not values, decides)
    torch.testing.assert_close(k(y), y @ w[:16].T)
    torch.testing.assert_close(v(x), x @ w[16:].T)
    assert fused.calls == 5
    with torch.inference_mode():  # inference tensors: identity alone
        z = torch.randn(3, 8)
        torch.testing.assert_close(k(z), z @ w[:16].T)
        torch.testing.assert_close(v(z), z @ w[16:].T)
    assert fused.calls == 6


class _Exact(torch.nn.Module):
    """A CPU stand-in for Int4Linear: the fp32 dequantized matmul, counting its GEMMs and the rows they took."""

    def __init__(self, codes: Int4Codes, bias, kernel: str):
        super().__init__()
        self.weight, self.bias, self.kernel = codes.dequantize(), bias, kernel
        self.out_features, self.in_features = codes.shape
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.reshape(-1, self.in_features).shape[0])
        return torch.nn.functional.linear(x.float(), self.weight, self.bias).to(x.dtype)

    def dequantized(self):
        self.rows.append(0)  # the weight rebuilt: no GEMM through the kernel
        return self.weight


def test_int4_qkv_runs_one_gemm_for_a_step_and_no_q_over_a_prompt():
    """Int4QKV: up to its rows, q|k|v is one GEMM over cat(ctx, h) with q's context rows dropped; past them (a
    prompt's context) the weight is rebuilt once and q multiplies h alone. Both equal three separate Linears."""
    from dflash_quant.kernels.int4_linear import Int4QKV

    gen = torch.Generator().manual_seed(0)
    parts = [_codes(_quantized(n, 128, 32, False, False, seed=i), 32) for i, n in enumerate((64, 32, 32))]
    from dflash_quant.kernels.int4_linear import concat_outputs

    fused = _Exact(concat_outputs(parts), torch.randn(128, generator=gen), "cuda")
    qkv = Int4QKV(fused, 64, rows=40)
    w, b = fused.weight, fused.bias
    for batch, ctx, block in ((1, 4, 16), (2, 4, 16), (1, 0, 16), (2, 30, 16), (1, 200, 16)):
        kv_in = torch.randn(batch, ctx + block, 128, generator=gen)
        h = kv_in[:, ctx:]
        fused.rows.clear()
        q, kv = qkv(h, kv_in)
        torch.testing.assert_close(q, torch.nn.functional.linear(h, w[:64], b[:64]))
        torch.testing.assert_close(kv, torch.nn.functional.linear(kv_in, w[64:], b[64:]))
        one_gemm = batch * (ctx + block) <= 40
        assert fused.rows == ([batch * (ctx + block)] if one_gemm else [0]), (batch, ctx, fused.rows)


@pytest.mark.parametrize("pair", ["reference", "reference-dflash2"])
def test_q_k_v_run_as_one_gemm_over_the_context_and_block(rtn_artifacts, pair, monkeypatch):
    """Fused (the default), each drafter layer runs q|k|v as one GEMM over cat(ctx, h) in a decode step (a prompt's forward:
    the rebuilt weight, q over h alone) and gate|up as one; the speculative tokens, acceptance (one by one and
    batched) and the first block's hidden states equal one GEMM a Linear (exact stand-in kernel), DFlash v1
    and DFlash2."""
    import dflash_quant.kernels.int4_linear as il
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target
    from dflash_quant.speculative.verify import CheckSettings, spec_runs

    monkeypatch.setattr(il, "Int4Linear", _Exact)  # named cuda: a kernel that rebuilds its bf16 weight
    monkeypatch.setattr(il, "plan", lambda choice, qcfg, device, dtype: (["cuda"], None))
    monkeypatch.setattr(il, "kernel_problem", lambda name, codes, device: None)
    target = load_target(f"{pair}:target")
    prompts = encode_prompts(target, f"{pair}:heldout", 4, False, 24)
    runs, hidden, models = {}, {}, {}
    for fuse in (False, True):
        loaded = load_drafter(rtn_artifacts[pair])
        # fused as `gptq` and `verify` call it: q|k|v is the runtime's default
        info = il.use_int4_kernel(loaded.model, loaded.source.path, loaded.quantization, "auto", fuse)
        layers = loaded.model.layers
        assert info["fused_groups"] == (2 * len(layers) if fuse else 0)
        assert all((a.self_attn.qkv_proj is not None) == fuse for a in layers)
        for a in layers if fuse else []:  # the reference's short prompts take the rebuilt weight too
            a.self_attn.qkv_proj.rows = 16
        for batch in (1, 2):
            settings = CheckSettings(24, 0.0, loaded.config.block_size, 0, stop_tokens(target), batch=batch)
            with torch.no_grad():
                runs[fuse, batch] = spec_runs(loaded.model, target.model, prompts, settings)
        hidden[fuse] = _first_block(loaded.model, target.model, prompts[0])
        models[fuse] = loaded.model
    for batch in (1, 2):
        assert [r.tokens for r in runs[True, batch]] == [r.tokens for r in runs[False, batch]]
        assert [r.acceptance_lengths for r in runs[True, batch]] == [r.acceptance_lengths for r in runs[False, batch]]
    torch.testing.assert_close(hidden[True], hidden[False], rtol=1e-5, atol=1e-5)
    attn, unfused = models[True].layers[0].self_attn, models[False].layers[0].self_attn
    qkv = attn.qkv_proj.fused
    assert qkv.out_features == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    # one GEMM for q|k|v per forward (none through the members), over k/v's rows, the context's and the block's,
    # while they fit the kernel; the prompt's forward rebuilds the weight (0) and runs no q over the prompt
    kernel_rows = [r if r <= 16 else 0 for r in unfused.k_proj.rows]
    assert qkv.rows == kernel_rows and len(qkv.rows) == len(unfused.q_proj.rows)
    assert any(r > q for r, q in zip(qkv.rows, unfused.q_proj.rows, strict=True) if r)  # context rows in the GEMM
    assert 0 in qkv.rows  # the prompt's forward
    assert models[True].layers[0].mlp.up_proj.fused is models[True].layers[0].mlp.gate_proj.fused
    # the members still answer when called alone (q on h, k and v on cat(ctx, h)) and hold nothing afterwards
    kv_in = torch.randn(1, 5, attn.q_proj.in_features)
    h = kv_in[:, 2:].clone()
    calls = [
        (attn.q_proj, unfused.q_proj, h),
        (attn.k_proj, unfused.k_proj, kv_in),
        (attn.v_proj, unfused.v_proj, kv_in),
    ]
    for member, ref, x in calls:
        torch.testing.assert_close(member(x), ref(x))
    assert all(m.state.x is None and m.state.y is None for m in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_cached_int4_runs_are_keyed_by_the_runtime_sources(tmp_path, monkeypatch):
    """verify's check cache keeps an int4 kernel's runs apart per kernel and per revision of the int4 runtime's
    sources (a new split-K rule or fusion sums in another order); the dequantized path's runs need neither."""
    import dflash_quant.kernels.int4_linear as il

    assert il.run_key({"kernel": "dequant", "linears": 0, "reason": "CPU"}) is None
    before = il.run_key({"kernel": "cuda", "linears": 8, "fused_groups": 2})
    assert before == f"cuda@{il.runtime_revision()}" and before != il.run_key({"kernel": "triton"})
    edited = tmp_path / "int4_cuda.cu"
    edited.write_bytes(il.int4_cuda.SOURCE.read_bytes() + b"\n// another split-K rule\n")
    monkeypatch.setattr(il.int4_cuda, "SOURCE", edited)
    il.runtime_revision.cache_clear()
    try:
        assert il.run_key({"kernel": "cuda"}) != before
    finally:
        il.runtime_revision.cache_clear()


def test_shared_input_groups_need_equal_layouts():
    from dflash_quant.kernels.int4_linear import shared_input_groups

    def codes(out_f, group=32, act_order=False):
        return _codes(_quantized(out_f, 128, group, True, act_order), group)

    layers = {
        "layers.0.self_attn.k_proj": (codes(32), None),
        "layers.0.self_attn.v_proj": (codes(32), None),
        "layers.0.mlp.gate_proj": (codes(64), None),
        "layers.0.mlp.up_proj": (codes(64, group=64), None),  # other groups: not fused
        "layers.1.self_attn.k_proj": (codes(32), None),
        "layers.1.self_attn.v_proj": (codes(32, act_order=True), None),  # permuted inputs: not fused
        "layers.1.mlp.gate_proj": (codes(64), None),
        "layers.1.mlp.up_proj": (codes(64), torch.zeros(64)),  # one with bias: not fused
        "layers.2.mlp.gate_proj": (codes(64), None),  # up_proj kept bf16: not fused
    }
    assert shared_input_groups(layers) == [["layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]]
    qkv = ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]
    layers["layers.0.self_attn.q_proj"] = (codes(32), None)  # q joins k and v in one group
    assert shared_input_groups(layers) == [qkv]
    assert shared_input_groups(layers, qkv=False) == [qkv[1:]]  # the attention cannot run q|k|v: k|v alone
    layers["layers.0.self_attn.q_proj"] = (codes(32, act_order=True), None)  # q cannot join: k|v still fused
    assert shared_input_groups(layers) == [qkv[1:]]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton (run locally, see module doc)")
@pytest.mark.parametrize("fuse", [False, True, "qkv"])
def test_reference_drafter_through_our_kernel_in_the_interpreter(rtn_artifact, monkeypatch, fuse):
    """The whole int4 drafter (GPTQ v1 artifact -> Int4Linear/Int4Member) on CPU in bf16 against the dequantized
    bf16 drafter: the same speculative tokens and tau on the reference pair."""
    import triton

    import dflash_quant.kernels.int4_linear as il
    from dflash_quant.kernels.int4_triton import _w4a16_kernel, reset_tuning
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target
    from dflash_quant.speculative.verify import CheckSettings, spec_runs

    _w4a16_kernel.configs = [
        triton.Config({"BLOCK_N": 64, "SPLIT_K": 2, "WIDE_LOAD": True, "SWAP_AB": True}, num_warps=4)
    ]
    reset_tuning()
    monkeypatch.setattr(il, "plan", lambda choice, qcfg, device, dtype: (["triton"], None))  # CPU allowed here
    monkeypatch.setattr(il, "kernel_problem", lambda name, codes, device: None)
    target = load_target("reference:target", dtype=torch.bfloat16)
    prompts = encode_prompts(target, "reference:heldout", 1, False, 8)
    runs = {}
    for name in ("dequant", "triton"):
        loaded = load_drafter(rtn_artifact, dtype=torch.bfloat16)
        if name == "triton":
            info = il.use_int4_kernel(
                loaded.model, loaded.source.path, loaded.quantization, "triton", bool(fuse), qkv=fuse == "qkv"
            )
            assert all((layer.self_attn.qkv_proj is not None) == (fuse == "qkv") for layer in loaded.model.layers)
            for layer in loaded.model.layers if fuse == "qkv" else []:  # the prompt's forward: the rebuilt weight
                layer.self_attn.qkv_proj.rows = 16
            assert info["kernel"] == "triton" and info["fused_groups"] == (
                2 * loaded.config.num_hidden_layers if fuse else 0
            )
        settings = CheckSettings(8, 0.0, loaded.config.block_size, 0, stop_tokens(target))
        with torch.no_grad():
            runs[name] = spec_runs(loaded.model, target.model, prompts, settings)
    assert [r.tokens for r in runs["triton"]] == [r.tokens for r in runs["dequant"]]
    assert [r.acceptance_lengths for r in runs["triton"]] == [r.acceptance_lengths for r in runs["dequant"]]


def test_a_kernel_that_cannot_run_falls_back_or_refuses(rtn_artifact, monkeypatch):
    """Every kernel passes over a Linear it cannot run: `auto` then keeps the dequantized weights and says why
    for each kernel tried; a kernel asked for by name is a usage error naming the Linear."""
    import dflash_quant.kernels.int4_linear as il
    from dflash_quant.loading.drafter import load_drafter

    loaded = load_drafter(rtn_artifact)
    monkeypatch.setattr(il, "plan", lambda choice, qcfg, device, dtype: (["triton", "tinygemm"], None))
    info = il.use_int4_kernel(loaded.model, loaded.source.path, loaded.quantization, "auto")
    assert info == {
        "kernel": "dequant",
        "linears": 0,
        "reason": "triton: fc: int4 kernels need CUDA; tinygemm: fc: int4 kernels need CUDA",
    }
    assert all(isinstance(m, torch.nn.Linear) for n, m in loaded.model.named_modules() if n.endswith("_proj"))
    monkeypatch.setattr(il, "plan", lambda choice, qcfg, device, dtype: (["tinygemm"], None))
    with pytest.raises(UsageError, match=r"--int4-kernel tinygemm cannot run this drafter \(tinygemm: fc: .*dequant"):
        il.use_int4_kernel(loaded.model, loaded.source.path, loaded.quantization, "tinygemm")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_autotuning_keeps_a_few_configs_that_fill_the_gpu(monkeypatch):
    import triton

    import dflash_quant.kernels.int4_triton as kernels
    from dflash_quant.kernels.int4_triton import _CONFIGS, _prune, split_for

    monkeypatch.setattr(kernels, "_sm_count", lambda device: 132)

    sms = 132  # H200
    # a wide matrix already has enough tiles; a narrow deep one (down: 4096 x 12288) needs split-K
    assert split_for(24576, 4096, 64, 128, sms) == 1
    assert split_for(4096, 12288, 64, 128, sms) == 8 and 4096 // 64 * 8 >= 2 * sms
    assert split_for(4096, 256, 64, 128, sms) == 2  # capped by the two K blocks there are
    x = torch.empty(16, 12288, device="meta")
    kept = _prune(_CONFIGS, {"N": 4096, "K": 12288, "x_ptr": x}, BLOCK_K=128, M_BUCKET=16, GROUP=128)
    assert 0 < len(kept) <= 16 < len(_CONFIGS)
    assert {c.kwargs["BLOCK_N"] for c in kept} <= {64, 128}
    assert all(c.kwargs["SPLIT_K"] in (4, 8) or c.kwargs["BLOCK_N"] == 128 for c in kept)
    pinned = [triton.Config({"BLOCK_N": 32, "SPLIT_K": 3, "WIDE_LOAD": False, "SWAP_AB": False})]
    assert _prune(pinned, {"N": 4096, "K": 12288, "x_ptr": x}, BLOCK_K=128) == pinned  # tests pin one config
