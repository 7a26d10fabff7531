"""End-to-end `dflash-quant gptq` on a tiny pair: artifact contents, options, and every bad-input path."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import save_drafter, save_target

from dflash_quant.artifact.manifest import verify_manifest
from dflash_quant.loading.drafter import load_drafter

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    rng = random.Random(0)

    def line():
        return " ".join(f"w{rng.randint(3, 119)}" for _ in range(8))

    (root / "calib.txt").write_text("\n".join(line() for _ in range(6)))
    (root / "eval.txt").write_text("\n".join(line() for _ in range(3)))
    return {
        "root": root,
        "drafter": save_drafter(root / "drafter", std=0.2),
        "target": save_target(root / "target"),
    }


def gptq(setup, *extra, out="art", timeout=600):
    s = setup
    args = [
        "gptq",
        str(s["drafter"]),
        "--target",
        str(s["target"]),
        "--calib-prompts",
        str(s["root"] / "calib.txt"),
        "--eval-prompts",
        str(s["root"] / "eval.txt"),
        "--max-new-tokens",
        "16",
        "--eval-max-new-tokens",
        "12",
        "--group-size",
        "32",
        "--output",
        str(s["root"] / out),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # Run where the models are, as a user would: local sources are recorded relative to the working directory.
    return subprocess.run(CLI + args, capture_output=True, text=True, env=env, timeout=timeout, cwd=s["root"])


def test_default_run_writes_a_complete_verified_artifact(setup):
    res = gptq(setup, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # stderr is a pipe here, as in a log: every stage says when it starts and when it is done, in order
    stages = [line.split("] ", 1)[1] for line in res.stderr.splitlines() if re.match(r"\[\d\d:\d\d:\d\d\] ", line)]
    assert stages[0] == "loading the drafter and its target", res.stderr
    started = [s for s in stages if not re.search(r": \d+(/\d+)? \(\d+ s\)$", s)]
    assert any(s.startswith("calibrating") for s in started) and any(s.startswith("quantizing") for s in started)
    steps = ["loading the drafter and its target", "writing the quantized drafter", "memory report and model card"]
    assert [s for s in started if s in steps] == steps, stages  # uncounted steps: announced, in order
    for label in (s for s in started if s not in steps):  # each counted stage ends with its full count
        tail = stages[stages.index(label) + 1 :]
        assert any(re.fullmatch(re.escape(label) + r": (\d+)/\1 \(\d+ s\)", s) for s in tail), (label, stages)
    art = setup["root"] / "art"
    for name in (
        "config.json",
        "model.safetensors",
        "quantize_config.json",
        "provenance.json",
        "quant_report.json",
        "parity.json",
        "memory.json",
        "README.md",
        "manifest.json",
    ):
        assert (art / name).is_file(), name
    assert verify_manifest(art) == []
    assert not list(setup["root"].glob(".art.tmp-*"))
    cfg = json.loads((art / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == ("gptq", 4, 32, True, False)
    assert cfg["dflash_config"]["mask_token_id"] == 2  # the drafter's own schema is kept
    with safe_open(art / "model.safetensors", "pt") as fh:
        keys = set(fh.keys())
        assert fh.metadata()["quantized_by"].startswith("dflash-quant")
        assert fh.get_tensor("fc.qweight").dtype == torch.int32 and fh.get_tensor("fc.scales").dtype == torch.float16
        assert fh.get_tensor("norm.weight").dtype == torch.bfloat16
    assert "fc.weight" not in keys and "layers.1.mlp.down_proj.g_idx" in keys
    report = json.loads((art / "quant_report.json").read_text())
    assert 0.25 < report["quantized_bytes"] / report["original_bytes"] < 0.35  # 4-bit codes + g32 scales/zeros/g_idx
    assert len(report["layers"]) == 15 and all(
        layer["hessian_rows"] > 0 and layer["rel_output_error"] < 0.5 for layer in report["layers"]
    )
    prov = json.loads((art / "provenance.json").read_text())
    assert prov["source_drafter"]["sha256"] and prov["calibration"]["num_prompts"] == 6
    assert prov["target"]["id"] == prov["target"]["path"] == "target" and prov["target"]["kind"] == "local"
    assert prov["calibration"]["prompts"] == "calib.txt" and str(setup["root"]) not in json.dumps(prov)
    parity = json.loads((art / "parity.json").read_text())
    assert parity["lossless"] is True and parity["num_prompts"] == 3
    assert out["parity"]["tau_ratio"] == parity["tau_ratio"]
    # The exported tensors are what the quantized drafter runs with: dequantized weights sit on the 4-bit grid.
    d = load_drafter(art).model
    w = d.fc.weight.detach()
    assert w.shape == (64, 128)
    g_idx = load_file(art / "model.safetensors")["fc.g_idx"]
    assert g_idx.tolist() == sorted(g_idx.tolist())  # no act-order by default: groups in column order
    for g in range(4):
        for row in w[:, g_idx == g]:
            assert len(torch.unique(row)) <= 16  # 4 bits: at most 16 levels per row and group


def test_verify_and_inspect_accept_the_artifact(setup):
    art = setup["root"] / "art"
    if not art.exists():
        pytest.skip("needs the default run")
    res = subprocess.run(CLI + ["inspect", str(art), "--json"], capture_output=True, text=True)
    assert res.returncode == 0 and json.loads(res.stdout)["quantization_config"]["bits"] == 4
    res = subprocess.run(
        CLI + ["verify", str(art), "--prompts", str(setup["root"] / "eval.txt"), "--max-new-tokens", "6", "--json"],
        capture_output=True,
        text=True,
        cwd=setup["root"],
    )
    assert res.returncode == 0, res.stderr  # the target is taken from provenance.json
    assert json.loads(res.stdout)["summary"]["lossless"] is True


def test_refuses_to_overwrite(setup):
    (setup["root"] / "exists").mkdir()
    (setup["root"] / "exists" / "notes.txt").write_text("mine")  # an empty directory would be filled in place
    res = gptq(setup, out="exists")
    assert res.returncode == 2 and "--overwrite" in res.stderr


def test_rtn_profile_vllm_and_calib_cache(setup):
    cache = setup["root"] / "cache"
    res = gptq(setup, "--profile", "vllm", "--calib-cache", str(cache), "--no-verify", "--no-card", out="vllm")
    assert res.returncode == 0, res.stderr
    art = setup["root"] / "vllm"
    keys = set(load_file(art / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in keys and "layers.0.self_attn.o_proj.qweight" in keys
    q = json.loads((art / "config.json").read_text())["quantization_config"]
    assert any("qkv_proj" in k for k in q["dynamic"]) and q["dflash_quant"]["profile"] == "vllm"
    assert (cache / "hessians.safetensors").is_file()
    # Second run with other settings reuses the statistics (no target run: calibration is marked cached).
    res = gptq(setup, "--bits", "3", "--calib-cache", str(cache), "--no-verify", "--no-card", out="cached")
    assert res.returncode == 0, res.stderr
    prov = json.loads((setup["root"] / "cached" / "provenance.json").read_text())
    assert prov["calibration"]["cached"] is True and prov["quantization"]["bits"] == 3
    res = gptq(setup, "--method", "rtn", "--no-verify", "--no-card", out="rtn")
    assert res.returncode == 0, res.stderr
    assert (
        json.loads((setup["root"] / "rtn" / "quant_report.json").read_text())["layers"][0]["rel_output_error"] is None
    )


def test_sequential_and_desc_act(setup):
    res = gptq(setup, "--sequential", "--desc-act", "--kv-hessian", "block+context", "--no-card", out="seq")
    assert res.returncode in (0, 1), res.stderr  # parity may fail on a random pair; the artifact must be complete
    art = setup["root"] / "seq"
    assert verify_manifest(art) == []
    prov = json.loads((art / "provenance.json").read_text())
    assert prov["quantization"]["sequential"] is True and prov["calibration"]["kv_hessian"] == "block+context"
    g_idx = load_file(art / "model.safetensors")["layers.0.mlp.down_proj.g_idx"]
    assert sorted(g_idx.tolist()) != g_idx.tolist()  # act-order permutes the group map


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--group-size", "48"], 2, "group"),
        (["--bits", "5"], 2, "bits"),
        (["--method", "awq"], 2, "--method"),
        (["--profile", "tgi"], 2, "--profile"),
        (["--kv-hessian", "all"], 2, "--kv-hessian"),
        (["--skip", "("], 2, "--skip"),
        (["--num-prompts", "1", "--max-new-tokens", "1"], 1, "calibration rows"),
    ],
)
def test_bad_arguments(setup, extra, code, message):
    res = gptq(setup, *extra, "--no-verify", out="bad")
    assert res.returncode == code, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not (setup["root"] / "bad").exists()


def test_same_prompts_for_calibration_and_parity_refused(setup):
    s = setup
    res = subprocess.run(
        CLI
        + [
            "gptq",
            str(s["drafter"]),
            "--target",
            str(s["target"]),
            "--calib-prompts",
            str(s["root"] / "calib.txt"),
            "--eval-prompts",
            str(s["root"] / "calib.txt"),
            "--output",
            str(s["root"] / "same"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "calibration prompts" in res.stderr


def test_damaged_inputs(setup, tmp_path):
    bad = save_drafter(tmp_path / "nan", std=0.2)
    t = load_file(bad / "model.safetensors")
    t["fc.weight"][0, 0] = float("inf")
    save_file(t, str(bad / "model.safetensors"))
    s = {**setup, "drafter": bad}
    res = gptq(s, out="nanout")
    assert res.returncode == 1 and "NaN or inf" in res.stderr
    cfg = json.loads((setup["drafter"] / "config.json").read_text())
    nokeys = tmp_path / "nokeys"
    nokeys.mkdir()
    (nokeys / "model.safetensors").write_bytes((setup["drafter"] / "model.safetensors").read_bytes())
    (nokeys / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k not in ("dflash_config", "architectures")})
    )
    res = gptq({**setup, "drafter": nokeys}, out="nokeysout")
    assert res.returncode == 1 and "not a DFlash drafter config" in res.stderr
    other_target = save_target(tmp_path / "t2", hidden_size=32, head_dim=8)
    res = gptq({**setup, "target": other_target}, out="mismatch")
    assert res.returncode == 1 and "fc takes" in res.stderr


def test_ctrl_c_leaves_no_output(setup):
    s = setup
    args = CLI + [
        "gptq",
        str(s["drafter"]),
        "--target",
        str(s["target"]),
        "--calib-prompts",
        str(s["root"] / "calib.txt"),
        "--eval-prompts",
        str(s["root"] / "eval.txt"),
        "--max-new-tokens",
        "64",
        "--group-size",
        "32",
        # The signal must land while the artifact is staged. The suite shares one check cache, and a hit (or a
        # busy machine delaying this poll) let CI's run publish first and die by SIGINT at exit: no cache, and a
        # long parity check (random drafter: one target forward per token) keep the staging window seconds wide.
        "--no-check-cache",
        "--eval-max-new-tokens",
        "300",
        "--output",
        str(s["root"] / "interrupted"),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120

    def exported() -> bool:  # the GPTQ tensors are staged and the (seconds-long) parity check is running
        return any((d / "model.safetensors").exists() for d in s["root"].glob(".interrupted.tmp-*"))

    while time.time() < deadline and proc.poll() is None and not exported():
        time.sleep(0.02)
    assert exported(), f"the run never reached the parity stage (rc {proc.poll()})"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err[-2000:])
    assert not (s["root"] / "interrupted").exists()
    assert not list(s["root"].glob(".interrupted.tmp-*"))
