"""Quantized targets kept packed (issue #14 part 2): the reference target's compressed-tensors W4A16 form,
built at test time, against transformers' own (decompressing) load, its resident bytes, and the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_quant.export.int4_target import write_int4_target
from dflash_quant.io.source import resolve
from dflash_quant.io.weights import read_safetensors
from dflash_quant.loading import target_quant
from dflash_quant.loading.target import load_target
from dflash_quant.loading.target_quant import PackedLinear, PackedScheme
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


@pytest.fixture(scope="module")
def int4_target(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("qt") / "target-w4g32"
    write_int4_target(resolve("reference:target").path, dst, QuantSpec(bits=4, group_size=32, sym=True))
    return dst


def _packed_from(weight: torch.Tensor, spec: QuantSpec, unpacked_zp: bool = False) -> tuple[PackedLinear, torch.Tensor]:
    from dflash_quant.export.compressed_tensors import pack_weight

    qw = rtn_quantize(weight, spec)
    t = pack_weight(qw)
    zp = t.get("weight_zero_point")
    if unpacked_zp:  # signed [out, groups], the layout transformers 5.x allocates
        zp = (qw.zeros.T.to(torch.int16) - (1 << (spec.bits - 1))).to(torch.int8).contiguous()
    module = PackedLinear(
        t["weight_packed"],
        t["weight_scale"],
        zp,
        None,
        None,
        PackedScheme(spec.bits, spec.group_size, spec.sym),
        weight.shape[1],
        weight.shape[0],
    )
    return module, qw.dequantize()


@pytest.mark.parametrize(("sym", "unpacked_zp"), [(True, False), (False, False), (False, True)])
def test_dequantize_chunks_equal_the_grid(monkeypatch, sym, unpacked_zp):
    monkeypatch.setattr(target_quant, "CHUNK_BYTES", 4 * 128 * 5)  # 5 rows per block: blocks cut unevenly
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    module, dense = _packed_from(w, QuantSpec(bits=4, group_size=32, sym=sym), unpacked_zp)
    assert module._rows_per_chunk() == 5
    assert torch.equal(module.dequantize(), dense)
    x = torch.randn(3, 7, 128)
    assert torch.allclose(module(x), x @ dense.T, atol=1e-5, rtol=1e-5)


def test_tinygemm_operands_decode_to_the_grid():
    """The CUDA path's (scale, zero) conversion, run through torch's CPU twin of the tinygemm int4 kernel."""
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    module, dense = _packed_from(w, QuantSpec(bits=4, group_size=32, sym=False))
    assert module.tinygemm_ok()
    unsigned, sz = module.tinygemm_operands()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
    x = torch.randn(4, 128).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).float()
    want = x.float() @ dense.T
    # bf16 scales/zeros and bf16 accumulation: a few bf16 ulps of the output's magnitude
    assert (y - want).abs().max() <= 0.02 * want.abs().max()


def test_the_repacked_tinygemm_copy_is_held_where_byte_counters_see_it(monkeypatch):
    """The CUDA path's repacked codes and scales are (unsaved) buffers: the calibration prediction, resident_bytes
    and .to() see them (as a plain attribute a 27B int4 target's prediction missed its ~12 GB of codes)."""
    from dflash_quant.calibration.peak import _param_bytes

    monkeypatch.setattr(
        target_quant, "tinygemm_pack", lambda u: torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
    )
    module, _ = _packed_from(torch.randn(64, 256), QuantSpec(bits=4, group_size=128, sym=True))
    saved = set(module.state_dict())
    module._prepare_tinygemm()
    assert module.weight_packed.numel() == 0 and module.kernel == "tinygemm-int4"
    assert module.tinygemm_packed is not None and module.tinygemm_sz is not None
    held = module.tinygemm_packed.untyped_storage().nbytes() + module.tinygemm_sz.numel() * 2
    assert module.tinygemm_packed.untyped_storage().nbytes() >= 64 * 256 // 2  # 4 bits a weight, at least
    scales = module.weight_scale.numel() * 2
    assert _param_bytes(module, 2, resident=True) == held + scales
    assert target_quant.resident_bytes(module) == held + scales
    assert set(module.state_dict()) == saved  # never written to a checkpoint


def test_packed_target_logits_equal_transformers_decompressed(int4_target):
    from transformers import AutoModelForCausalLM

    packed = load_target(int4_target)
    linears = {n for n, m in packed.model.named_modules() if isinstance(m, nn.Linear)}
    assert linears == {"lm_head"}  # every decoder Linear is held packed
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 42
    dense = AutoModelForCausalLM.from_pretrained(int4_target, dtype=torch.float32).eval()  # run_compressed=False
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed.model(ids).logits, dense(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    # and the int4 target differs from the bf16 one it came from (the fixture really quantized it)
    bf16 = load_target("reference:target")
    with torch.no_grad():
        assert (bf16.model(ids).logits - a).abs().max() > 1e-2


def test_resident_bytes_by_hand(int4_target):
    t = load_target(int4_target)
    cfg = json.loads((int4_target / "config.json").read_text())
    h, inter, layers, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    weights = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (inter, h), (inter, h), (h, inter)]
    per_layer = sum(o * i // 2 + (o * i // 32) * 2 for o, i in weights)  # int4 codes in int32 + fp16 scales g32
    norms = layers * (2 * h + 2 * hd) + h  # fp32: input/post norms, q/k norms, final norm
    embed = cfg["vocab_size"] * h  # fp32, tied with lm_head: held once
    rotary = 2 * (hd // 2)  # inv_freq and original_inv_freq, fp32
    want = layers * per_layer + 4 * (norms + embed + rotary)
    assert t.quantization.resident_bytes == want == 6533376
    assert t.quantization.bits == 4 and t.quantization.group_size == 32 and t.quantization.symmetric is True
    dense = load_target("reference:target")
    assert dense.quantization.format is None and dense.quantization.resident_bytes > 1.5 * want


def test_calibration_budget_prices_the_target_as_held_packed(int4_target):
    """gptq keeps a pack-quantized target packed, so `budget --calibration` counts its files' bytes, not bf16."""
    from dflash_quant.memory.budget import resolve_target
    from dflash_quant.memory.calibration import calibration_budget
    from dflash_quant.memory.weights import weights_from_files

    files = weights_from_files(int4_target)
    t = resolve_target(str(int4_target), None, engine="reference")
    assert t.weight_bytes == files.total_bytes < 0.6 * files.dequantized_bf16_bytes
    packed = calibration_budget(str(int4_target), "reference", "h100", 64, 64)
    dense = calibration_budget(str(resolve("reference:target").path), "reference", "h100", 64, 64)
    assert packed.predicted["target_weights"] == files.total_bytes
    assert dense.peak_bytes - packed.peak_bytes == dense.predicted["target_weights"] - files.total_bytes


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=900, cwd=cwd)


@pytest.mark.slow
def test_cli_verify_and_gptq_against_the_int4_target(int4_target, tmp_path):
    res = _run(
        ["verify", "reference", "--target", str(int4_target), "--num-prompts", "4", "--max-new-tokens", "24",
         "--no-check-cache", "--json"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["summary"]["lossless"] is True  # greedy output == the int4 target's own
    tq = report["target_quantization"]
    assert (tq["format"], tq["bits"], tq["group_size"], tq["packed_linears"]) == ("pack-quantized", 4, 32, 42)
    assert tq["resident_bytes"] == 6533376

    out = tmp_path / "q"
    res = _run(
        ["gptq", "reference", "--target", str(int4_target), "-o", str(out), "--num-prompts", "4",
         "--max-new-tokens", "16", "--eval-num-prompts", "4", "--eval-max-new-tokens", "24", "--no-check-cache",
         "--json"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["parity"]["lossless"] is True
    assert result["target_quantization"]["resident_bytes"] == 6533376
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["target_quantization"]["format"] == "pack-quantized"
    assert prov["target_quantization"]["bits"] == 4
    assert json.loads((out / "parity.json").read_text())["target_quantization"]["group_size"] == 32
    card = (out / "README.md").read_text()
    assert (
        "Target quantization (calibrated and checked against this form):** compressed-tensors pack-quantized W4 g32"
        in card
    )
    assert read_safetensors(out)  # the artifact was written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tinygemm_target_on_cuda_matches_the_dequantized_path(int4_target, monkeypatch):
    """On CUDA in bf16 the packed Linears run torch's int4 kernel; its logits match the same codes dequantized."""
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0)).cuda()
    kernel = load_target(int4_target, device="cuda", dtype=torch.bfloat16)
    kinds = {m.kernel for m in kernel.model.modules() if isinstance(m, PackedLinear)}
    assert kinds == {"tinygemm-int4"}, kinds
    monkeypatch.setattr(PackedLinear, "tinygemm_ok", lambda self: False)
    dequant = load_target(int4_target, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = kernel.model(ids).logits.float(), dequant.model(ids).logits.float()
    rel = ((a - b).norm() / b.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"tinygemm vs dequant: relative logits difference {rel:.2e}, argmax agreement {agree:.4f}")
    assert rel < 2e-2 and agree > 0.97
