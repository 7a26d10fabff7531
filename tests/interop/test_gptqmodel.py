"""Our GPTQ v1 tensors, loaded into GPTQModel's CPU torch kernel, decode to our weights (run: make interop)."""

import pytest
import torch

gptqmodel = pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (build it with `make interop`)")
from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # noqa: E402
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module  # noqa: E402

from dflash_quant.calibration.hessian import HessianAccumulator  # noqa: E402
from dflash_quant.export.gptq_v1 import pack_gptq_v1  # noqa: E402
from dflash_quant.io.gptq_v1 import unpack_gptq_v1  # noqa: E402
from dflash_quant.quantize.gptq import gptq_quantize  # noqa: E402
from dflash_quant.quantize.spec import QuantSpec  # noqa: E402

pytestmark = pytest.mark.interop

CONFIGS = [
    # bits, group, sym, desc_act, static_groups
    (4, 128, True, False, False),
    (4, 32, False, False, False),
    (8, 128, True, False, False),
    (8, -1, False, False, False),
    (4, 128, True, True, False),
    (4, 64, False, True, True),
    (3, 128, True, False, False),
    (3, 32, False, True, False),
    (2, 64, True, False, False),
    (2, 32, False, False, False),
]


def _gptqmodel_linear(tensors, bits, group, sym, desc_act, out_features, in_features):
    m = TorchLinear(
        bits=bits,
        group_size=group,
        sym=sym,
        desc_act=desc_act,
        in_features=in_features,
        out_features=out_features,
        bias=False,
        pack_dtype=torch.int32,
    )
    for key, value in tensors.items():
        getattr(m, key).data.copy_(value)
    # The torch kernel keeps zero points in GPTQModel's internal v2 form (no -1 offset).
    convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
    m.post_init()
    return m.eval()


@pytest.mark.parametrize("bits,group,sym,desc_act,static_groups", CONFIGS)
def test_gptqmodel_decodes_our_tensors(bits, group, sym, desc_act, static_groups):
    torch.manual_seed(bits * 1000 + group)
    out_features, in_features = 192, 256
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(1024, in_features) @ torch.randn(in_features, in_features)  # correlated inputs
    acc = HessianAccumulator(in_features, name="interop")
    acc.add(x)
    qw = gptq_quantize(weight, acc, QuantSpec(bits, group, sym), desc_act=desc_act, static_groups=static_groups)
    tensors = pack_gptq_v1(qw)
    ours = unpack_gptq_v1(tensors, bits, group)
    assert torch.equal(ours, qw.dequantize())

    m = _gptqmodel_linear(tensors, bits, group, sym, desc_act, out_features, in_features)
    with torch.no_grad():
        theirs = m.dequantize_weight()  # [in, out], fp16
        assert theirs.dtype == torch.float16
        # GPTQModel multiplies fp16 scale by (q - zero) in fp16: exactly our fp32 value rounded to fp16.
        assert torch.equal(theirs.T, ours.half())
        xin = torch.randn(8, in_features)
        y = m(xin)
    ref = xin @ ours.half().float().T
    torch.testing.assert_close(y.float(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
