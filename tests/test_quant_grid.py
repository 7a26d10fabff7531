import pytest
import torch

from dflash_quant.errors import UsageError
from dflash_quant.quantize.grid import find_params, group_params
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("bits", [0, 1, 5, 16])
def test_spec_rejects_unsupported_bits(bits):
    with pytest.raises(UsageError, match="bits"):
        QuantSpec(bits=bits)


def test_group_size_must_divide_width_and_message_names_layer():
    spec = QuantSpec(4, 96)
    with pytest.raises(UsageError) as e:
        spec.group_width(4096, "layers.0.mlp.down_proj")
    msg = str(e.value)
    assert "4096" in msg and "layers.0.mlp.down_proj" in msg and "128" in msg
    with pytest.raises(UsageError):
        QuantSpec(4, 0)
    assert QuantSpec(4, -1).n_groups(300) == 1
    assert QuantSpec(4, 64).n_groups(256) == 4


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_symmetric_zero_is_midpoint_and_scale_fp16_exact(bits):
    w = torch.randn(16, 64)
    scale, zero = find_params(w, QuantSpec(bits, -1, True))
    assert torch.all(zero == 2 ** (bits - 1))
    assert torch.equal(scale, scale.half().float())
    exact = 2 * w.abs().amax(dim=1) / (2**bits - 1)
    # the smallest fp16 value that is >= the exact scale (rounding up never clips the extremes)
    assert torch.all(scale >= exact)
    below = torch.nextafter(scale.half(), torch.zeros(16, dtype=torch.float16)).float()
    assert torch.all(below < exact)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_asymmetric_grid_covers_range_and_zero_in_v1_range(bits):
    w = torch.randn(32, 64) + torch.linspace(-2, 2, 32).unsqueeze(1)
    w[0] = w[0].abs()  # a row that is all >= 0 would want zero 0
    spec = QuantSpec(bits, -1, False)
    scale, zero = find_params(w, spec)
    assert torch.all(zero >= 1) and torch.all(zero <= spec.maxq)
    assert torch.equal(zero, zero.round())
    # every weight is within half a step of its grid point (no clipping beyond rounding + fp16 slack)
    qw = rtn_quantize(w, spec)
    err = (qw.dequantize() - w).abs()
    assert torch.all(err <= 0.5 * scale.unsqueeze(1) * 1.01 + 1e-7)


def test_textbook_zero_allows_zero_point_0():
    w = torch.rand(4, 32) + 0.1
    scale, zero = find_params(w, QuantSpec(4, -1, False, v1_zeros=False))
    assert torch.all(zero == 0)


def test_rtn_codes_and_groups():
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    spec = QuantSpec(4, 32, True)
    qw = rtn_quantize(w, spec)
    assert qw.codes.dtype == torch.uint8 and qw.codes.shape == (8, 128)
    assert int(qw.codes.max()) <= 15
    assert qw.scales.shape == (4, 8) and qw.zeros.shape == (4, 8)
    assert torch.equal(qw.g_idx, torch.arange(128, dtype=torch.int32) // 32)
    s, z = group_params(w, spec)
    assert torch.equal(s, qw.scales)
    # every weight lands on its nearest grid point: within half a step (plus fp16 scale rounding at the edge)
    deq = qw.dequantize()
    sc = qw.scales[qw.g_idx.long()].T
    assert torch.all((deq - w).abs() <= sc / 2 * 1.01 + 1e-7)
    assert torch.equal(torch.round(deq / sc), deq / sc)


def test_all_zero_group_dequantizes_to_zero():
    w = torch.zeros(4, 64)
    for sym in (True, False):
        qw = rtn_quantize(w, QuantSpec(4, 32, sym))
        assert torch.equal(qw.dequantize(), w)
        assert torch.all(qw.scales > 0)


def test_rtn_follows_input_device_and_rejects_nan():
    w = torch.randn(4, 64)
    qw = rtn_quantize(w, QuantSpec(4, 64))
    assert qw.codes.device == w.device
    w[0, 0] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        rtn_quantize(w, QuantSpec(4, 64), name="fc")
