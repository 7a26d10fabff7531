import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash_quant.cli.app import app

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("w1 w2 w3 w4 w5\n\nw9 w8 w7 w6\nw10 w11 w12\n")
    return path


def _run(args, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(CLI + args, capture_output=True, text=True, env=env, timeout=300, **kw)


def test_verify_json_subprocess(tiny_pair, prompt_file):
    drafter, target = tiny_pair
    res = _run(
        [
            "verify",
            str(drafter),
            "--target",
            str(target),
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "12",
            "--json",
        ]
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # stdout is pure JSON: progress went to stderr
    s = report["summary"]
    assert report["num_prompts"] == 3 and report["block_size"] == 4
    assert s["lossless"] is True and s["new_tokens"] == 36
    assert len(s["per_position_acceptance"]) == 3 and len(s["acceptance_histogram"]) == 4
    assert sum(s["acceptance_histogram"]) == s["drafter_forwards"]
    assert s["tau"] >= 1.0 and s["baseline_tokens_per_s"] > 0


def test_verify_compare_side_by_side(tiny_pair, prompt_file, tmp_path):
    from tiny import save_drafter

    drafter, target = tiny_pair
    other = save_drafter(tmp_path / "other", seed=7)
    res = CliRunner().invoke(
        app,
        [
            "verify",
            str(drafter),
            "--target",
            str(target),
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "8",
            "--compare",
            str(other),
            "--json",
            "--num-prompts",
            "2",
        ],
    )
    report = json.loads(res.stdout)
    assert report["baseline"]["drafter"] == str(other) and report["summary"]["drafter"] == str(drafter)
    assert report["parity"]["tau_ratio"] == pytest.approx(
        report["summary"]["tau"] / report["baseline"]["tau"], abs=1e-3
    )
    # exit code follows the parity verdict
    assert res.exit_code == (0 if report["parity"]["passed"] else 1)


def test_verify_table_output(tiny_pair, prompt_file):
    drafter, target = tiny_pair
    res = CliRunner().invoke(
        app,
        [
            "verify",
            str(drafter),
            "--target",
            str(target),
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "6",
            "--num-prompts",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "accept @ pos 3" in res.stdout and "lossless" in res.stdout


def test_verify_bad_inputs_exit_codes(tiny_pair, tmp_path, prompt_file):
    drafter, target = tiny_pair
    res = _run(["verify", str(tmp_path / "missing"), "--target", str(target)])
    assert res.returncode == 1 and "error:" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = _run(["verify", str(drafter), "--target", str(target), "--prompts", str(prompt_file), "--block-size", "9"])
    assert res.returncode == 2 and "--block-size" in res.stderr
    res = _run(["verify", str(drafter), "--target", str(drafter)])
    assert res.returncode == 1 and "not a target" in res.stderr
    res = _run(["verify", str(drafter)])
    assert res.returncode == 2 and "--target" in res.stderr


def test_inspect(tiny_pair):
    drafter, _ = tiny_pair
    res = CliRunner().invoke(app, ["inspect", str(drafter), "--json"])
    info = json.loads(res.stdout)
    assert info["config"]["target_layer_ids"] == [0, 2]
    # fc: 2 taps * 64 -> 64; per layer q 64*64, k/v 64*32, o 64*64, mlp 3*64*128, norms 4*16+... counted exactly
    assert info["by_module"]["fc"]["elements"] == 2 * 64 * 64
    assert info["by_module"]["layers.0.mlp"]["elements"] == 3 * 64 * 128
    assert info["by_module"]["layers.0.self_attn"]["elements"] == 64 * 64 * 2 + 64 * 32 * 2 + 16 * 2
    assert info["bytes"] == 4 * info["stored_elements"]
