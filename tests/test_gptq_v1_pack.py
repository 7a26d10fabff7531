import pytest
import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import DFlashQuantError
from dflash_quant.export.gptq_v1 import gptq_quantization_config, marlin_problems, pack_gptq_v1
from dflash_quant.io.gptq_v1 import pack_dim0, unpack_dim0, unpack_gptq_v1
from dflash_quant.quantize.gptq import gptq_quantize
from dflash_quant.quantize.grid import QuantizedWeight
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec


def _hessian(width, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, width, generator=g) @ torch.randn(width, width, generator=g)
    acc = HessianAccumulator(width)
    acc.add(x)
    return acc


def _random_qw(bits, sym, group, act, out_features=64, in_features=256, seed=0):
    """A QuantizedWeight with random codes/zeros/fp16 scales and the g_idx layout of each act-order mode."""
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec(bits, group, sym)
    width = in_features if group == -1 else group
    n_groups = in_features // width
    g_idx = torch.arange(in_features, dtype=torch.int32) // width
    if act == "desc":  # dynamic act-order: groups follow a permutation of the columns
        perm = torch.randperm(in_features, generator=g)
        g_idx = torch.empty_like(g_idx)
        g_idx[perm] = (torch.arange(in_features) // width).to(torch.int32)
    zeros = (
        torch.full((n_groups, out_features), 2 ** (bits - 1), dtype=torch.int32)
        if sym
        else torch.randint(1, spec.maxq + 1, (n_groups, out_features), generator=g, dtype=torch.int32)
    )
    return QuantizedWeight(
        codes=torch.randint(0, spec.maxq + 1, (out_features, in_features), generator=g).to(torch.uint8),
        scales=(torch.rand(n_groups, out_features, generator=g) * 0.1 + 1e-3).half().float(),
        zeros=zeros,
        g_idx=g_idx,
        spec=spec,
        desc_act=act != "none",
        static_groups=act == "desc_static",
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("act", ["none", "desc", "desc_static"])
def test_pack_unpack_roundtrip_exact(bits, sym, group, act):
    qw = _random_qw(bits, sym, group, act, seed=bits * 7 + group)
    t = pack_gptq_v1(qw)
    n_groups = qw.n_groups
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (256 * bits // 32, 64)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (n_groups, 64 * bits // 32)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (n_groups, 64)
    assert t["g_idx"].dtype == torch.int32 and torch.equal(t["g_idx"], qw.g_idx)
    assert torch.equal(unpack_gptq_v1(t, bits, group), qw.dequantize())


@pytest.mark.parametrize(
    "bits,sym,group,act",
    [(4, True, 128, "none"), (3, False, 32, "desc"), (2, False, 64, "desc_static"), (8, True, -1, "desc")],
)
def test_gptq_output_roundtrips_exact(bits, sym, group, act):
    torch.manual_seed(bits + group)
    w = torch.randn(32, 256)
    qw = gptq_quantize(
        w, _hessian(256), QuantSpec(bits, group, sym), desc_act=act != "none", static_groups=act == "desc_static"
    )
    assert torch.equal(unpack_gptq_v1(pack_gptq_v1(qw), bits, group), qw.dequantize())


def test_symmetric_4bit_qzeros_are_0x77777777():
    qw = rtn_quantize(torch.randn(64, 128), QuantSpec(4, 32, True))
    qz = pack_gptq_v1(qw)["qzeros"]
    assert torch.all(qz == 0x77777777)


@pytest.mark.parametrize("bits,word", [(2, 0x55555555), (8, 0x7F7F7F7F)])
def test_symmetric_qzeros_other_bits(bits, word):
    qz = pack_gptq_v1(rtn_quantize(torch.randn(64, 128), QuantSpec(bits, 64, True)))["qzeros"]
    expected = word - (1 << 32) if word >= 1 << 31 else word
    assert torch.all(qz == expected)


def test_4bit_packing_lowest_bits_first():
    codes = torch.arange(16).reshape(16, 1) % 16  # input i has code i
    words = pack_dim0(codes, 4)
    assert words.shape == (2, 1)
    assert int(words[0, 0]) & 0xFFFFFFFF == 0x76543210
    assert int(words[1, 0]) & 0xFFFFFFFF == 0xFEDCBA98


def test_3bit_layout_straddles_words_like_gptqmodel():
    # value 10 sits at bits 30..32: low 2 bits end word 0, its top bit starts word 1; value 21 at bits 63..65
    v = torch.zeros(32, 1, dtype=torch.int64)
    v[10] = 0b111
    w = pack_dim0(v, 3).to(torch.int64) & 0xFFFFFFFF
    assert [int(x) for x in w[:, 0]] == [0b11 << 30, 0b1, 0]
    v = torch.zeros(32, 1, dtype=torch.int64)
    v[21] = 0b111
    w = pack_dim0(v, 3).to(torch.int64) & 0xFFFFFFFF
    assert [int(x) for x in w[:, 0]] == [0, 1 << 31, 0b11]
    rnd = torch.randint(0, 8, (96, 5))
    assert torch.equal(unpack_dim0(pack_dim0(rnd, 3), 3), rnd)


def test_pack_rejects_unpackable_shapes_and_zero_point_0():
    qw = rtn_quantize(torch.randn(8, 40), QuantSpec(3, -1, True), name="odd")
    with pytest.raises(DFlashQuantError, match="odd"):
        pack_gptq_v1(qw)
    qw = rtn_quantize(torch.rand(32, 64) + 0.1, QuantSpec(4, -1, False, v1_zeros=False))
    with pytest.raises(DFlashQuantError, match="zero"):
        pack_gptq_v1(qw)


def test_unpack_without_g_idx_uses_contiguous_groups():
    qw = rtn_quantize(torch.randn(32, 128), QuantSpec(4, 32, False))
    t = pack_gptq_v1(qw)
    del t["g_idx"]
    assert torch.equal(unpack_gptq_v1(t, 4, 32), qw.dequantize())


def test_quantization_config_and_marlin_rules():
    good = gptq_quantization_config(4, 128, True, False, damp_percent=0.01)
    assert good["quant_method"] == "gptq" and good["checkpoint_format"] == "gptq"
    for key in ("bits", "group_size", "sym", "desc_act", "static_groups", "damp_percent", "true_sequential"):
        assert key in good
    assert marlin_problems(good) == []
    assert marlin_problems(gptq_quantization_config(8, -1, True, True)) == []
    assert any("bits=3" in p for p in marlin_problems(gptq_quantization_config(3, 128, True, False)))
    assert any("sym=False" in p for p in marlin_problems(gptq_quantization_config(4, 128, False, False)))
    assert any("group_size=256" in p for p in marlin_problems(gptq_quantization_config(4, 256, True, False)))
    bad = dict(good)
    del bad["desc_act"]
    assert any("desc_act" in p for p in marlin_problems(bad))
    assert any("quant_method" in p for p in marlin_problems({**good, "quant_method": "awq"}))
    assert any("fc" in p for p in marlin_problems(good, shapes={"fc": (4096, 20480 + 64)}))
    with pytest.raises(Exception, match="overwrite"):
        gptq_quantization_config(4, 128, True, False, extra={"bits": 8})
