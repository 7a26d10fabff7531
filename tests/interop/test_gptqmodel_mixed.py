"""A mixed-precision GPTQ v1 config (`dynamic` per-Linear overrides, as dflash-quant writes it) read by
GPTQModel's own `dynamic_get`, and each Linear decoded by GPTQModel's CPU torch kernel at the setting it
resolves: the same weights as ours (run: make interop)."""

import pytest
import torch

gptqmodel = pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (build it with `make interop`)")
from gptqmodel.quantization.config import dynamic_get  # noqa: E402

from dflash_quant.calibration.hessian import HessianAccumulator  # noqa: E402
from dflash_quant.export.gptq_dynamic import layer_setting  # noqa: E402
from dflash_quant.export.gptq_v1 import pack_gptq_v1  # noqa: E402
from dflash_quant.export.writer import quantization_config  # noqa: E402
from dflash_quant.io.gptq_v1 import unpack_gptq_v1  # noqa: E402
from dflash_quant.quantize.gptq import gptq_quantize  # noqa: E402
from dflash_quant.quantize.settings import QuantSettings  # noqa: E402
from dflash_quant.quantize.spec import QuantSpec  # noqa: E402

from .test_gptqmodel import _gptqmodel_linear  # noqa: E402

pytestmark = pytest.mark.interop

# a mix like the search's: base 4/128, overrides on some Linears (every searched group: 32/64/128/per
# channel), one kept in bf16
PICKS = {
    "fc": (4, 128),
    "layers.0.self_attn.q_proj": (2, 128),
    "layers.0.self_attn.k_proj": (3, 32),
    "layers.0.self_attn.v_proj": (4, 128),
    "layers.0.self_attn.o_proj": (4, -1),
    "layers.0.mlp.gate_proj": (3, 64),
    "layers.0.mlp.down_proj": (8, 32),
    "layers.1.self_attn.q_proj": (3, 128),
    "layers.1.mlp.up_proj": (2, -1),
}
KEPT = ["layers.1.self_attn.k_proj"]
# how the search may solve a pick (act-order with static groups, clip search): plain GPTQ v1 tensors either way
SOLVE = {
    "layers.0.self_attn.q_proj": (True, True),
    "layers.0.self_attn.k_proj": (False, True),
    "layers.0.mlp.gate_proj": (True, False),
    "layers.1.mlp.up_proj": (True, True),
}


def test_gptqmodel_resolves_and_decodes_a_mixed_artifact():
    qcfg = quantization_config(QuantSettings(bits=4, group_size=128), KEPT, 2, PICKS)
    dynamic = qcfg["dynamic"]
    assert dynamic_get(dynamic, KEPT[0]) is False  # the bf16 Linear is skipped by GPTQModel too
    for i, (name, (bits, group)) in enumerate(PICKS.items()):
        got = (
            dynamic_get(dynamic, name, "bits", qcfg["bits"]),
            dynamic_get(dynamic, name, "group_size", qcfg["group_size"]),
        )
        assert got == (bits, group) == layer_setting(qcfg, name)
        torch.manual_seed(i)
        out_features, in_features = 192, 256
        weight = torch.randn(out_features, in_features) * 0.05
        acc = HessianAccumulator(in_features, name=name)
        acc.add(torch.randn(512, in_features))
        act, clip = SOLVE.get(name, (False, False))
        qw = gptq_quantize(weight, acc, QuantSpec(bits, group, True), desc_act=act, static_groups=act, clip=clip)
        assert torch.equal(
            qw.g_idx, torch.arange(in_features, dtype=torch.int32) // (group if group > 0 else in_features)
        )
        tensors = pack_gptq_v1(qw)
        ours = unpack_gptq_v1(tensors, bits, group)
        m = _gptqmodel_linear(tensors, bits, group, True, False, out_features, in_features)
        with torch.no_grad():
            assert torch.equal(m.dequantize_weight().T, ours.half())
