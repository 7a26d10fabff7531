"""The MLX export read back by mlx itself (`make mlx-check` runs these in .venv-mlx)."""

import json

import numpy as np
import pytest

from dflash_quant.export.convert import convert_artifact
from dflash_quant.export.gptq_v1 import read_gptq_artifact
from dflash_quant.pipeline.job import GptqJob
from dflash_quant.pipeline.run import run_gptq
from dflash_quant.quantize.settings import QuantSettings

mx = pytest.importorskip("mlx.core")
pytestmark = pytest.mark.mlx


@pytest.fixture(
    scope="module",
    params=[(4, 64, True), (4, 32, False), (3, 128, True), (8, 128, True)],
    ids=lambda p: f"{p[0]}bit-g{p[1]}-{'sym' if p[2] else 'asym'}",
)
def exported(request, tmp_path_factory):
    bits, group, sym = request.param
    root = tmp_path_factory.mktemp("mlx")
    run_gptq(
        GptqJob(
            output=root / "gptq",
            quant=QuantSettings(method="rtn", bits=bits, group_size=group, sym=sym),
            verify=False,
            write_card=False,
        )
    )
    convert_artifact(root / "gptq", root / "mlx", "mlx")
    return read_gptq_artifact(root / "gptq"), root / "mlx", request.param


def test_mlx_dequantize_equals_gptq_weights(exported):
    art, out, (bits, group, sym) = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": group, "bits": bits, "mode": "affine"} and "rope_theta" in cfg
    weights = mx.load(str(out / "model.safetensors"))
    for name, qw in art.quantized.items():
        w, s, b = weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"]
        assert w.dtype == mx.uint32 and s.dtype == mx.float16
        want = qw.dequantize().numpy()
        exact = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits))
        if sym:  # stored values exact, fp32 arithmetic: bit for bit
            assert np.array_equal(exact, want), name
        else:  # the bias -scale*zero rounded to fp16
            m = np.abs(-(qw.scales * qw.zeros.float()).T.repeat_interleave(group, 1).numpy())
            assert np.all(np.abs(exact - want) <= m * 2**-11 + np.abs(want) * 2**-22), name
        native = np.array(mx.dequantize(w, s, b, group_size=group, bits=bits).astype(mx.float32))
        assert np.allclose(native, want, rtol=2**-9, atol=float(np.abs(want).max()) * 2**-10), name  # fp16 arithmetic


def test_mlx_quantized_linear_runs_the_stored_tensors(exported):
    import mlx.nn as nn

    art, out, (bits, group, sym) = exported
    weights = mx.load(str(out / "model.safetensors"))
    name = "layers.0.mlp.down_proj"
    qw = art.quantized[name]
    layer = nn.QuantizedLinear(qw.in_features, qw.out_features, bias=False, group_size=group, bits=bits)
    layer.weight, layer.scales, layer.biases = (weights[f"{name}.{p}"] for p in ("weight", "scales", "biases"))
    x = np.random.default_rng(0).standard_normal((4, qw.in_features)).astype(np.float32)
    got = np.array(layer(mx.array(x)).astype(mx.float32))
    want = x @ qw.dequantize().numpy().T
    assert np.allclose(got, want, rtol=1e-2, atol=1e-2 * float(np.abs(want).max()))
