"""Each export codec against its format's own reader: compressed-tensors' decompressor, gguf-py's dequantize,
and the MLX affine formula (mlx itself: tests/test_export_mlx.py). Exact where the grid maps."""

import numpy as np
import pytest
import torch
from test_gptq_v1_pack import _random_qw

from dflash_quant.errors import UsageError
from dflash_quant.export import compressed_tensors as ct
from dflash_quant.export import gguf as gg
from dflash_quant.export import mlx as mx_codec
from dflash_quant.io import gguf_names
from dflash_quant.io.compressed_tensors import read_compressed_tensors
from dflash_quant.io.mlx import dequantize_affine

gguf = pytest.importorskip("gguf")


def _fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    h = x.half()
    return (torch.nextafter(h, torch.full_like(h, float("inf"))).float() - h.float()).abs()


# ------------------------------------------------------------------ compressed-tensors


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [-1, 32, 128])
@pytest.mark.parametrize("act", ["none", "desc", "desc_static"])
def test_compressed_tensors_reads_back_the_gptq_weight(bits, sym, group, act):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    qw = _random_qw(bits, sym, group, act, seed=bits)
    qw.name = "layers.0.mlp.up_proj"
    if act == "desc" and group != -1:  # compressed-tensors 0.20 dropped group act-order (weight_g_idx)
        with pytest.raises(UsageError, match="act-order"):
            ct.pack_weight(qw)
        return
    state = ct.pack_weight(qw)
    assert state["weight_packed"].dtype == torch.int32 and state["weight_scale"].dtype == torch.float16
    assert ("weight_zero_point" in state) == (not sym) and "weight_g_idx" not in state
    want = qw.dequantize()

    class Art:  # what quantization_config() reads
        bits, group_size = qw.spec.bits, qw.spec.group_size
        quantized = {qw.name: qw}

    Art.sym = sym
    args = QuantizationArgs(**ct._scheme_args(Art))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    # the library's decompressor as is: its fp16 product is our exact weight rounded once to fp16
    got16 = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]
    assert got16.dtype == torch.float16 and torch.equal(got16, want.half())
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": scheme.model_dump()},
        "ignore": [],
    }
    tensors = {f"{qw.name}.{k}": v for k, v in state.items()}
    got = read_compressed_tensors(tensors, qcfg)[f"{qw.name}.weight"]
    assert torch.equal(got, want)  # fp32: bit for bit


def test_ignore_rules_match_engine_names():
    import re

    kept = [f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"] + ["fc", "layers.1.mlp.down_proj"]
    rules = ct.ignore_rules(kept, n_layers=2)
    pats = [re.compile(r[3:]) for r in rules]

    def hit(name):
        return any(p.fullmatch(name) for p in pats)

    assert all(r.startswith("re:") for r in rules)
    # vLLM: fc under model., draft layers offset by the target's layer count, q/k/v fused
    assert hit("model.fc") and hit("model.layers.38.self_attn.qkv_proj") and hit("layers.0.self_attn.k_proj")
    assert hit("layers.1.mlp.down_proj") and not hit("layers.0.mlp.down_proj")  # kept in one layer: full name
    assert not hit("model.layers.38.self_attn.o_proj") and not hit("model.layers.3.mlp.gate_up_proj")


# ------------------------------------------------------------------ GGUF


@pytest.mark.parametrize("bits,sym,kind", [(4, True, "Q4_0"), (8, True, "Q8_0")])
def test_gguf_symmetric_group32_is_bit_identical(bits, sym, kind):
    qw = _random_qw(bits, sym, 32, "none", seed=3)
    data, got_kind = gg.encode_weight(qw)
    assert got_kind == kind
    assert data.shape == (
        qw.out_features,
        qw.in_features // 32 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1],
    )
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(back.astype(np.float32), qw.dequantize().numpy())


def test_gguf_q4_0_block_layout():
    """ggml's block_q4_0: fp16 d, then byte j = q[j] | q[j+16] << 4."""
    qw = _random_qw(4, True, 32, "none", out_features=1, in_features=32, seed=5)
    data, _ = gg.encode_weight(qw)
    assert data.shape == (1, 18)
    assert data[0, :2].view(np.float16)[0] == np.float16(qw.scales[0, 0].item())
    q = qw.codes[0].numpy()
    assert list(data[0, 2:]) == [int(q[j]) | int(q[j + 16]) << 4 for j in range(16)]


def test_gguf_asymmetric_is_q4_1_up_to_the_offset_rounding():
    qw = _random_qw(4, False, 32, "none", seed=7)
    data, kind = gg.encode_weight(qw)
    assert kind == "Q4_1"
    back = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1).astype(np.float32))
    want = qw.dequantize()
    m = -(qw.scales * qw.zeros.float()).T.repeat_interleave(32, dim=1)
    # the only rounding is m to fp16 (half an ulp), plus fp32 rounding of d*q + m
    bound = _fp16_ulp(m) / 2 + want.abs() * 2**-23 + m.abs() * 2**-23
    assert torch.all((back - want).abs() <= bound)
    assert not torch.equal(back, want)  # it is a rounding, not exact, and the test can tell


@pytest.mark.parametrize(
    "bits,group,sym,act,needle",
    [
        (4, 128, True, False, "group size 128"),
        (4, 32, True, True, "act-order"),
        (3, 32, True, False, "3-bit"),
        (8, 32, False, False, "8-bit asymmetric"),
    ],
)
def test_gguf_refuses_unmappable_grids_naming_the_settings(bits, group, sym, act, needle):
    msg = gg.grid_problem(bits, group, sym, act)
    assert needle in msg and "--group-size 32 --sym" in msg and "\n" not in msg
    qw = _random_qw(bits, sym, group, "desc" if act else "none", seed=1)
    with pytest.raises(UsageError):
        gg.encode_weight(qw)


def test_gguf_requantize_only_when_asked():
    qw = _random_qw(4, True, 128, "none", seed=2)
    data, kind = gg.encode_weight(qw, requantize=True)
    assert kind == "Q4_0"
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_0)
    want = qw.dequantize().numpy()
    # a round-to-nearest Q4_0 of the GPTQ weight (ggml picks d = -max/8 per block)
    step = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=2, keepdims=True) / 8
    assert np.all(
        np.abs(back - want).reshape(step.shape[0], -1, 32) <= step * 1.01
    )  # d = max/-8 (fp16): the far end clips by <= d
    assert gg.grid_problem(3, 128, True, False, requantize=True) is not None


def test_gguf_names_roundtrip():
    for hf in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.2.self_attn.o_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.input_layernorm.weight",
    ]:
        assert gguf_names.hf_name(gguf_names.gguf_name(hf)) == hf
    assert gguf_names.gguf_name("layers.2.self_attn.o_proj.weight") == "blk.2.attn_output.weight"
    assert gguf_names.gguf_name("hidden_norm.weight") == "enc.output_norm.weight"


# ------------------------------------------------------------------ MLX


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_symmetric_is_exact(bits, group):
    qw = _random_qw(bits, True, group, "none", seed=bits + group)
    t = mx_codec.pack_weight(qw)
    assert t["weight"].shape == (qw.out_features, qw.in_features * bits // 32)
    assert t["scales"].shape == t["biases"].shape == (qw.out_features, qw.in_features // group)
    got = dequantize_affine(t["weight"], t["scales"], t["biases"], bits, group)
    assert torch.equal(got, qw.dequantize())


def test_mlx_asymmetric_within_bias_rounding_and_4bit_word_layout():
    qw = _random_qw(4, False, 64, "none", seed=9)
    t = mx_codec.pack_weight(qw)
    got = dequantize_affine(t["weight"], t["scales"], t["biases"], 4, 64)
    b = -(qw.scales * qw.zeros.float()).T.repeat_interleave(64, dim=1)
    assert torch.all((got - qw.dequantize()).abs() <= _fp16_ulp(b) / 2 + got.abs() * 2**-23)
    word = int(t["weight"].view(torch.int32)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == qw.codes[0, :8].tolist()  # lowest bits first


def test_mlx_refuses_group_minus_one_and_act_order():
    assert "group size -1" in mx_codec.grid_problem(4, -1, False)
    assert "act-order" in mx_codec.grid_problem(4, 64, True)
    with pytest.raises(UsageError):
        mx_codec.pack_weight(_random_qw(4, True, 64, "desc"))
