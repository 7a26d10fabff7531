"""`dflash-quant memory` and `dflash-quant budget` through Typer's runner and one real subprocess."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from dflash_quant.cli.app import app

runner = CliRunner()
KiB = 1 << 10


def _fake_gptq_artifact(drafter_dir: Path, out: Path, group: int = 32) -> Path:
    """Replace every 2-D Linear weight of a bf16 drafter by GPTQ v1 tensors of the right shapes (values arbitrary)."""
    out.mkdir()
    tensors = {}
    with safe_open(drafter_dir / "model.safetensors", framework="pt") as fh:
        for key in fh.keys():
            t = fh.get_tensor(key)
            if key.endswith(".weight") and t.dim() == 2:
                base, (n_out, n_in) = key[: -len(".weight")], t.shape
                tensors[f"{base}.qweight"] = torch.full((n_in // 8, n_out), 0x77777777, dtype=torch.int32)
                tensors[f"{base}.qzeros"] = torch.full((n_in // group, n_out // 8), 0x77777777, dtype=torch.int32)
                tensors[f"{base}.scales"] = torch.full((n_in // group, n_out), 0.01, dtype=torch.float16)
                tensors[f"{base}.g_idx"] = (torch.arange(n_in) // group).to(torch.int32)
            else:
                tensors[key] = t.to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((drafter_dir / "config.json").read_text())
    q = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"}  # fmt: skip
    cfg["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "quantize_config.json").write_text(json.dumps(q))
    return out


@pytest.fixture(scope="module")
def artifact(tiny_pair, tmp_path_factory):
    drafter, _ = tiny_pair
    return _fake_gptq_artifact(drafter, tmp_path_factory.mktemp("art") / "int4")


def test_budget_json_from_presets():
    r = runner.invoke(app, ["budget", "--target", "qwen3.5-27b", "--drafter", "qwen3.6-27b-dflash", "--gpu", "rtx4090",
                            "--context", "8192", "--target-weights", "int4", "--state-dtype", "bf16", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["caches"]["target_kv_bytes_per_token"] == 64 * KiB
    # 17 slots (prefix caching) x 48 layers x the state page padded to a 480-token, 4 KiB/token block
    assert rep["caches"]["target_state_bytes_per_request"] == 17 * 48 * 480 * 4096
    assert rep["caches"]["target_state_slots"] == 17 and rep["settings"]["prefix_caching"] is True
    assert set(rep["budgets"]) == {"bf16", "int4"}
    b, q = rep["budgets"]["bf16"], rep["budgets"]["int4"]
    assert q["headroom_bytes"] - b["headroom_bytes"] == rep["drafter"]["bf16_bytes"] - rep["drafter"]["quantized_bytes"]


def test_budget_table_on_stdout():
    r = runner.invoke(app, ["budget", "--target", "qwen3-8b", "--drafter", "qwen3-8b-dflash-b16", "--gpu", "24GiB"])
    assert r.exit_code == 0, r.stderr
    assert "headroom" in r.stdout and "int4 drafter" in r.stdout and "144.00 KiB/token" in r.stdout


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["--gpu", "rtx9090"], 2, "unknown GPU"),
        (["--context", "-5"], 2, "context"),
        (["--concurrency", "0"], 2, "concurrency"),
        (["--target-weights", "int3"], 2, "17.8GB"),
        (["--kv-dtype", "int2"], 2, "--kv-dtype"),
    ],
)
def test_budget_bad_inputs(args, code, text):
    r = runner.invoke(app, ["budget", "--target", "qwen3-8b", "--drafter", "qwen3-8b-dflash-b16", *args])
    assert r.exit_code == code
    assert text in r.stderr and len(r.stderr.strip().splitlines()) <= 2


def test_budget_config_without_layer_counts(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    r = runner.invoke(app, ["budget", "--target", str(cfg), "--drafter", "qwen3-8b-dflash-b16"])
    assert r.exit_code == 1
    assert "num_hidden_layers" in r.stderr


def test_budget_reads_drafter_bytes_from_artifact_files(artifact, tiny_pair):
    _, target = tiny_pair
    r = runner.invoke(app, ["budget", "--target", str(target), "--drafter", str(artifact), "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["drafter"]["weights_from"].startswith("safetensors headers (quantized")
    assert rep["drafter"]["quantized_bytes"] < rep["drafter"]["bf16_bytes"]
    assert rep["target"]["weights_from"] == "safetensors headers"


def test_memory_report_on_quantized_artifact(artifact, tiny_pair, tmp_path):
    drafter, _ = tiny_pair
    art = tmp_path / "copy"
    shutil.copytree(artifact, art)
    from dflash_quant.artifact.manifest import write_manifest

    write_manifest(art)
    r = runner.invoke(app, ["memory", str(art), "--baseline", str(drafter), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    on_disk = json.loads((art / "memory.json").read_text())
    assert on_disk == rep
    w = rep["weights"]
    assert w["total_bytes"] == sum(w["by_dtype"].values()) == sum(w["by_module"].values())
    assert set(w["by_dtype"]) == {"int32", "float16", "bfloat16"}
    assert "fc" in w["by_module"] and "layers.0.self_attn" in w["by_module"]
    assert rep["baseline"]["ratio"] == pytest.approx(w["total_bytes"] / rep["baseline"]["total_bytes"], abs=1e-4)
    assert rep["resident"]["device"] == "cpu" and rep["resident"]["method"] == "tensor bytes"
    assert rep["resident"]["form"] == "dequantized bf16"
    assert rep["resident"]["bytes"] >= w["dequantized_bf16_bytes"] * 0.99
    assert rep["resident"]["packed_bytes"] == w["total_bytes"]
    assert rep["context_kv_bytes_per_token"] > 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert "memory.json" in manifest["files"]


def test_memory_out_replaces_its_own_report_only(artifact, tmp_path):
    """--out elsewhere writes there, and a second run replaces that report; the artifact is left as it was."""
    before = {p.name: p.read_bytes() for p in artifact.iterdir() if p.is_file()}
    out = tmp_path / "reports" / "memory.json"
    out.parent.mkdir()
    for _ in range(2):
        r = runner.invoke(app, ["memory", str(artifact), "--device", "none", "--out", str(out)])
        assert r.exit_code == 0, r.stderr
        assert json.loads(out.read_text())["disk_bytes"] > 0
    assert {p.name: p.read_bytes() for p in artifact.iterdir() if p.is_file()} == before
    out.write_text('{"mine": true}')  # a file that is not a report is refused, and kept
    r = runner.invoke(app, ["memory", str(artifact), "--device", "none", "--out", str(out)])
    assert r.exit_code == 2 and "is not a memory report" in r.stderr
    assert out.read_text() == '{"mine": true}'


def test_memory_bad_directory(tmp_path):
    r = runner.invoke(app, ["memory", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "not a directory" in r.stderr


def test_budget_subprocess():
    exe = Path(sys.executable).parent / "dflash-quant"
    proc = subprocess.run(
        [
            str(exe),
            "budget",
            "--target",
            "qwen3-8b",
            "--drafter",
            "qwen3-8b-dflash-b16",
            "--gpu",
            "rtx3090",
            "--context",
            "16384",
            "--target-weights",
            "int4",
            "--json",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["gpu"]["name"] == "rtx3090" and rep["settings"]["spec_tokens"] == 15
    bad = subprocess.run([str(exe), "budget", "--target", "qwen3-8b", "--drafter", "qwen3-8b-dflash-b16",
                          "--gpu", "voodoo5"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "unknown GPU" in bad.stderr
