"""`dflash-quant export` and `gptq --format` on the shipped reference pair (RTN: no calibration, seconds)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_quant.artifact.manifest import verify_manifest
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.pipeline.job import GptqJob
from dflash_quant.pipeline.run import run_gptq
from dflash_quant.quantize.settings import QuantSettings

gguf = pytest.importorskip("gguf")
CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
pytestmark = pytest.mark.slow  # CLI subprocesses (torch import each)


def _gptq(out: Path, **quant) -> Path:
    run_gptq(GptqJob(output=out, quant=QuantSettings(method="rtn", **quant), verify=False, write_card=False))
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return {
        "root": root,
        "g32": _gptq(root / "g32", group_size=32),
        "g32-vllm": _gptq(root / "g32-vllm", group_size=32, profile="vllm"),
        "g128-asym": _gptq(root / "g128-asym", group_size=128, sym=False),
    }


def export(src, fmt, out, *extra):
    return subprocess.run(
        [*CLI, "export", str(src), "--format", fmt, "--output", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _weights(path):
    return load_drafter(path).model.state_dict()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gguf", "mlx"])
def test_export_loads_to_the_same_weights(arts, fmt):
    out = arts["root"] / f"g32-{fmt}"
    res = export(arts["g32"], fmt, out)
    assert res.returncode == 0, res.stderr
    assert verify_manifest(out) == []
    for name in ("provenance.json", "quant_report.json", "memory.json", "README.md", "config.json"):
        assert (out / name).is_file(), name
    prov = json.loads((out / "provenance.json").read_text())
    assert (
        prov["export"]["format"] == fmt
        and prov["source_drafter"] == json.loads((arts["g32"] / "provenance.json").read_text())["source_drafter"]
    )
    want, got = _weights(arts["g32"]), _weights(out)
    assert all(torch.equal(want[k], got[k]) for k in want)  # symmetric group 32 maps exactly in every format
    card = (out / "README.md").read_text()
    assert {"gguf": "llama-server", "mlx": "dflash generate", "compressed-tensors": "vllm serve"}[fmt] in card


def test_gguf_matches_llama_cpp_converter_layout(arts):
    from dflash_quant.io import gguf as gg

    out = arts["root"] / "vllm-gguf"
    assert export(arts["g32-vllm"], "gguf", out).returncode == 0
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    keys = set(reader.fields)
    assert set(gg.KEYS) <= keys
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert reader.fields["dflash.target_layers"].contents() == [1, 3, 5]  # reference taps [0, 2, 4], +1
    assert (
        reader.fields["dflash.block_size"].contents() == 8
        and reader.fields["tokenizer.ggml.mask_token_id"].contents() == 1
    )
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 4096
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # names as llama.cpp's DFlash converter writes them; no token_embd / output
    expected = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight"
        for i in range(3)
        for n in (
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_q_norm",
            "attn_k_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    assert set(types) == expected
    assert (
        types["blk.0.attn_q.weight"] == "BF16" and types["blk.0.attn_output.weight"] == "Q4_0"
    )  # vllm profile: q/k/v bf16
    assert types["blk.0.attn_norm.weight"] == "F32"
    want, got = _weights(arts["g32-vllm"]), _weights(out)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_compressed_tensors_profile_ignore_list(arts):
    out = arts["root"] / "vllm-ct"
    assert export(arts["g32-vllm"], "compressed-tensors", out).returncode == 0
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert r"re:(^|.*\.)self_attn\.qkv_proj$" in qcfg["ignore"] and r"re:(^|.*\.)self_attn\.q_proj$" in qcfg["ignore"]


def test_asymmetric_g128_mlx_within_bias_rounding_and_gguf_refused(arts):
    out = arts["root"] / "asym-mlx"
    assert export(arts["g128-asym"], "mlx", out).returncode == 0
    want, got = _weights(arts["g128-asym"]), _weights(out)
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert 0 < worst < 1e-3
    res = export(arts["g128-asym"], "gguf", arts["root"] / "asym-gguf")
    assert res.returncode == 2 and "group size 128" in res.stderr and "--group-size 32" in res.stderr
    assert not (arts["root"] / "asym-gguf").exists()
    assert len([ln for ln in res.stderr.strip().splitlines() if ln.strip()]) <= 3  # one message (rich may wrap it)
    res = export(arts["g128-asym"], "gguf", arts["root"] / "asym-gguf-rq", "--requantize")
    assert res.returncode == 0, res.stderr
    assert json.loads((arts["root"] / "asym-gguf-rq" / "provenance.json").read_text())["export"]["requantized"] is True


def test_bad_inputs(arts, tmp_path):
    res = export(arts["g32"], "gguf", arts["g32"] / "inside")
    assert res.returncode == 2 and "overlaps" in res.stderr
    res = export("dflash_quant/reference/pair/drafter", "mlx", tmp_path / "x")
    assert res.returncode == 2 and "not a GPTQ v1 artifact" in res.stderr and not (tmp_path / "x").exists()
    res = export(arts["g32"], "onnx", tmp_path / "y")
    assert res.returncode == 2 and "unknown" in res.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")  # a user's directory, not an artifact: never replaced
    res = export(arts["g32"], "mlx", tmp_path / "taken")
    assert res.returncode == 2 and (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    target = tmp_path / "target"  # the GGUF's vocabulary comes from it: nothing is written into it
    shutil.copytree("dflash_quant/reference/pair/target", target)
    before = sorted(p.name for p in target.iterdir())
    res = export(arts["g32"], "gguf", target / "gguf", "--target", str(target))
    assert res.returncode == 2 and "lies inside the input" in res.stderr, res.stderr
    assert sorted(p.name for p in target.iterdir()) == before


def test_gptq_format_writes_the_format_directly(arts):
    out = arts["root"] / "direct-gguf"
    run_gptq(
        GptqJob(
            output=out, quant=QuantSettings(method="rtn", group_size=32), verify=False, write_card=False, format="gguf"
        )
    )
    assert not (out / "model.safetensors").exists() and len(list(out.glob("*.gguf"))) == 1
    assert verify_manifest(out) == []
    want, got = _weights(arts["g32"]), _weights(out)
    assert all(torch.equal(want[k], got[k]) for k in want)
    res = subprocess.run(
        [*CLI, "gptq", "--format", "gguf", "--output", str(arts["root"] / "g128-gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "group size 128" in res.stderr and not (arts["root"] / "g128-gguf").exists()
