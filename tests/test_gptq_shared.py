import pytest
import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.quantize.gptq import gptq_quantize, gptq_quantize_shared
from dflash_quant.quantize.spec import QuantSpec


@pytest.mark.parametrize("desc_act", [False, True])
def test_shared_input_pass_equals_per_matrix_gptq(desc_act):
    torch.manual_seed(0)
    x = torch.randn(512, 64) @ torch.randn(64, 64) + 0.1 * torch.randn(512, 64)
    acc = HessianAccumulator(64)
    acc.add(x)
    ws = [torch.randn(48, 64), torch.randn(16, 64), torch.randn(16, 64)]
    spec = QuantSpec(4, 32, True)
    together = gptq_quantize_shared(ws, acc, spec, names=["q", "k", "v"], desc_act=desc_act)
    for w, name, got in zip(ws, "qkv", together, strict=True):
        alone = gptq_quantize(w, acc, spec, desc_act=desc_act, name=name)
        assert got.name == name and got.codes.shape == (w.shape[0], 64)
        assert torch.equal(got.codes, alone.codes) and torch.equal(got.g_idx, alone.g_idx)
        assert torch.equal(got.zeros, alone.zeros)
        torch.testing.assert_close(got.scales, alone.scales, rtol=0, atol=0)
        torch.testing.assert_close(got.dequantize(), alone.dequantize(), rtol=0, atol=0)
