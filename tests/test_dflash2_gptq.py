"""`dflash-quant gptq` end to end on a tiny DFlash2 drafter: backbone Linears and fc quantized, conv and
selector kept bf16 and reloaded unchanged."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from tiny import save_dflash2_drafter, save_target

from dflash_quant.loading.drafter import load_drafter

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


@pytest.mark.slow
def test_gptq_quantizes_backbone_and_keeps_conv_and_selector(tmp_path):
    rng = random.Random(0)

    def line():
        return " ".join(f"w{rng.randint(3, 119)}" for _ in range(8))

    (tmp_path / "calib.txt").write_text("\n".join(line() for _ in range(4)))
    (tmp_path / "eval.txt").write_text("\n".join(line() for _ in range(2)))
    drafter, target = save_dflash2_drafter(tmp_path / "drafter", std=0.2), save_target(tmp_path / "target")
    art = tmp_path / "art"
    res = subprocess.run(
        CLI
        + [
            "gptq",
            str(drafter),
            "--target",
            str(target),
            "--calib-prompts",
            str(tmp_path / "calib.txt"),
            "--eval-prompts",
            str(tmp_path / "eval.txt"),
            "--max-new-tokens",
            "12",
            "--eval-max-new-tokens",
            "8",
            "--group-size",
            "16",
            "--no-card",
            "--output",
            str(art),
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    parity = json.loads((art / "parity.json").read_text())
    assert parity["lossless"] is True
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 4
    skips = set(cfg["quantization_config"]["dynamic"])  # GPTQ loaders must not expect qweight for these
    assert {
        r"-:(^|.*\.)attention_conv\.kernel_projection$",
        r"-:(^|.*\.)mlp_conv\.kernel_projection$",
        r"-:(^|.*\.)candidate_selector\.hidden_projection$",
    } <= skips, skips
    report = json.loads((art / "quant_report.json").read_text())
    quantized = sorted(layer["name"] for layer in report["layers"])
    assert len(quantized) == 15 and "fc" in quantized  # fc + 2 layers x (q, k, v, o, gate, up, down)
    assert not any("conv" in n or "selector" in n for n in quantized)

    src = load_drafter(drafter).model.state_dict()
    with safe_open(str(art / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        kept = [k for k in keys if "_conv." in k or k.startswith("candidate_selector.")]
        assert len(kept) == 2 * 2 * 2 + 3  # per layer 2 convs x (base_kernel, kernel_projection) + selector
        assert (
            "candidate_selector.predecessor_codebook" in keys
            and "layers.0.attention_conv.kernel_projection.weight" in keys
        )
        for k in kept:
            t = fh.get_tensor(k)
            assert t.dtype == torch.bfloat16, k
            assert torch.equal(t, src[k].to(torch.bfloat16)), k
        assert "layers.0.self_attn.q_proj.qweight" in keys and "fc.qweight" in keys
    again = load_drafter(art).model.state_dict()
    for k in kept:
        assert torch.equal(again[k], src[k].to(torch.bfloat16).float()), f"{k} changed through export/reload"
