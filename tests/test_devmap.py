"""Targets split by --device-map (issue #14): same tokens, tau and Hessians as on one device; resumable and
memory-predicted calibration; `budget --calibration` checked by hand.

On CPU the real split transformers/accelerate support is resident CPU modules plus modules offloaded to
"disk" (their weights stay in the checkpoint / offload folder and are loaded for each forward), which moves
every weight through accelerate's hooks as a GPU+CPU split does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny import save_drafter, save_hybrid_target, save_target

from dflash_quant.calibration import checkpoint as ckpt
from dflash_quant.calibration.capture import capture
from dflash_quant.calibration.peak import predict_run
from dflash_quant.errors import UsageError
from dflash_quant.loading.runtime import encode_prompts, load_pair, stop_tokens
from dflash_quant.memory.calibration import calibration_budget, hessian_widths, mean_layer_bytes
from dflash_quant.memory.gpus import fmt_bytes
from dflash_quant.memory.kv import parse_shape
from dflash_quant.memory.presets import preset_path
from dflash_quant.models.placement import Placement, make_placement
from dflash_quant.speculative.verify import CheckSettings, baseline_runs, spec_runs

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


def split_map(n_layers: int, head: str = "cpu") -> dict[str, str]:
    """The first half of the decoder layers resident on cpu, the rest offloaded to disk."""
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": head}
    for i in range(n_layers):
        dmap[f"model.layers.{i}"] = "cpu" if i < n_layers // 2 else "disk"
    return dmap


def _same_run(drafter_src: str, target_src: str | None, dmap: dict, prompts_spec: str, n: int, new: int):
    one_d, one_t = load_pair(drafter_src, target_src, CPU, torch.float32)
    split_d, split_t = load_pair(drafter_src, target_src, CPU, torch.float32, Placement(dmap))
    assert any(p.device.type == "meta" for p in split_t.model.parameters()), "nothing was offloaded"
    ids = encode_prompts(one_t, prompts_spec, n, True)
    stats = [
        capture(d.model, t.model, ids, new, "block+context", stop_token_ids=stop_tokens(t))
        for d, t in ((one_d, one_t), (split_d, split_t))
    ]
    settings = CheckSettings(new, 0.0, None, 0, stop_tokens(one_t))
    runs = [spec_runs(d.model, t.model, ids, settings) for d, t in ((one_d, one_t), (split_d, split_t))]
    base = [baseline_runs(t.model, ids, settings) for t in (one_t, split_t)]
    return stats, runs, base


def test_split_target_same_tau_tokens_and_hessians():
    """The shipped reference pair (tied lm_head, 6 layers): half the layers offloaded to disk."""
    stats, runs, base = _same_run("reference", None, split_map(6), "reference:calib", 4, 24)
    one, split = stats
    assert one.mean_tau == split.mean_tau and one.steps == split.steps
    assert one.rows() == split.rows()
    for name, acc in one.hessians.items():
        assert acc.xtx is not None and split.hessians[name].xtx is not None
        torch.testing.assert_close(split.hessians[name].xtx, acc.xtx, rtol=1e-6, atol=1e-6)
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert [r.acceptance_lengths for r in runs[0]] == [r.acceptance_lengths for r in runs[1]]
    assert [r.tokens for r in base[0]] == [r.tokens for r in base[1]]
    assert one.mean_tau is not None and one.mean_tau > 1.5  # the drafter really drafts (not a degenerate run)


def test_split_hybrid_target_with_offloaded_head(tmp_path):
    """A Gated-DeltaNet hybrid target (its rollback replays tokens through the split model), lm_head on disk."""
    save_hybrid_target(tmp_path / "target")
    save_drafter(tmp_path / "drafter", std=0.2, dflash_config={"mask_token_id": 2, "target_layer_ids": [0, 3]})
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"w{i} w{i + 3} w{i + 1} w{i + 7} w{i + 2}" for i in range(5, 10)))
    stats, runs, _ = _same_run(
        str(tmp_path / "drafter"), str(tmp_path / "target"), split_map(4, head="disk"), str(prompts), 5, 16
    )
    assert stats[0].mean_tau == stats[1].mean_tau
    for name, acc in stats[0].hessians.items():
        torch.testing.assert_close(stats[1].hessians[name].xtx, acc.xtx, rtol=1e-6, atol=1e-6)
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert sum(r.replay_forwards for r in runs[1]) > 0  # the rollback path ran on the split target


def test_strategy_and_max_memory_parse():
    p = make_placement("auto", "cpu=2GiB")
    assert p is not None and p.device_map == "auto" and p.max_memory == {"cpu": "2GiB"}
    assert make_placement(None, None) is None
    with pytest.raises(UsageError, match="not DEVICE=SIZE"):
        make_placement("auto", "cpu")


def test_hessians_on_another_device_arg_accepted():
    """--hessian-device cpu with a cpu drafter: the accumulators live where they are told."""
    d, t = load_pair("reference", None, CPU, torch.float32)
    ids = encode_prompts(t, "reference:calib", 1, True)
    s = capture(d.model, t.model, ids, 8, "block", hessian_device=CPU)
    assert all(a.device == CPU for a in s.hessians.values())


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_roundtrip_and_key_mismatch(tmp_path):
    d, t = load_pair("reference", None, CPU, torch.float32)
    ids = encode_prompts(t, "reference:calib", 3, True)
    key = {"k": 1, "prompt_ids_sha256": ckpt.prompts_digest(ids)}
    done = []

    def save(state):  # as the pipeline does: written during the call (the Hessians are the live ones)
        done.append(state.done)
        if state.done == 1:
            ckpt.save(tmp_path, key, state)

    full = capture(d.model, t.model, ids, 16, "block", keep_replay=True, checkpoint=save, checkpoint_every=1)
    assert done == [1, 2]  # none after the last prompt: the run is complete then
    assert ckpt.load(tmp_path, {**key, "k": 2}, CPU) is None  # other settings never resume
    state = ckpt.load(tmp_path, key, CPU)
    assert state is not None and state.done == 1 and state.replay is not None and len(state.replay) == 1
    resumed = capture(d.model, t.model, ids, 16, "block", keep_replay=True, resume=state)
    assert resumed.resumed_prompts == 1 and resumed.steps == full.steps and resumed.mean_tau == full.mean_tau
    for name, acc in full.hessians.items():
        torch.testing.assert_close(resumed.hessians[name].xtx, acc.xtx, rtol=1e-6, atol=1e-5)
    assert resumed.replay is not None and full.replay is not None
    assert [len(c) for c in resumed.replay] == [len(c) for c in full.replay]
    for a, b in zip(resumed.replay[0], full.replay[0], strict=True):  # the checkpointed prompt's target tokens
        assert a.labels is not None and b.labels is not None and torch.equal(a.labels, b.labels)
    (tmp_path / ckpt.FILE).write_bytes(b"torn")
    with pytest.raises(Exception, match="damaged"):
        ckpt.load(tmp_path, key, CPU)


def _gptq(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "gptq",
        "reference",
        "--device",
        "cpu",
        "--num-prompts",
        "10",
        "--max-new-tokens",
        "48",
        "--no-verify",
        "--no-card",
        "--calib-checkpoint-every",
        "2",
        "--no-calib-cache",  # every run calibrates (the store would serve the second from the first)
        "-o",
        str(out),
        *extra,
    ]


@pytest.mark.slow
def test_killed_gptq_resumes_with_the_same_codes(tmp_path):
    """kill -9 during calibration, then the identical command: it resumes from the checkpoint in the user cache
    and writes the same Hessians (calibration rows) and the same packed codes as a run never interrupted."""
    xdg = tmp_path / "xdg"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(xdg)}
    out = tmp_path / "a"

    def checkpoints() -> list[Path]:
        return list((xdg / "dflash-quant" / "calib").glob(f"*.checkpoint/{ckpt.FILE}"))

    proc = subprocess.Popen(_gptq(out), env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while proc.poll() is None and not checkpoints() and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before a checkpoint was seen"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    (ck,) = checkpoints()  # --no-calib-cache keeps finished calibrations out of the store, not checkpoints
    assert not out.exists() and not list(tmp_path.glob(".a.calib-checkpoint*"))
    mine = ck.parent / "notes.txt"  # the folder is ours by name only: a file someone put there must survive
    mine.write_text("mine")
    subprocess.run(_gptq(out), env=env, cwd=tmp_path, check=True, capture_output=True, timeout=600)
    assert not ck.exists() and mine.read_text() == "mine"
    subprocess.run(
        _gptq(tmp_path / "b"),  # never interrupted; it checkpoints into the same folder, and removes its own
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=600,
    )
    ca = json.loads((out / "provenance.json").read_text())["calibration"]
    cb = json.loads((tmp_path / "b" / "provenance.json").read_text())["calibration"]
    assert ca["resumed_prompts"] >= 2 and ca["resumed_prompts"] % 2 == 0 and cb["resumed_prompts"] == 0
    assert ca["rows"] == cb["rows"] and ca["steps"] == cb["steps"] and ca["mean_tau_bf16"] == cb["mean_tau_bf16"]
    from safetensors.torch import load_file

    codes_a, codes_b = load_file(out / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert codes_a.keys() == codes_b.keys()
    for name, tensor in codes_a.items():  # qweight, qzeros, scales, g_idx and the kept tensors, exactly
        assert torch.equal(tensor, codes_b[name]), name
    assert [f.name for f in ck.parent.iterdir()] == ["notes.txt"]  # a finished run leaves no checkpoint behind
    assert not list(tmp_path.glob(".*.calib-checkpoint"))  # nor anything beside its output


def test_gptq_with_a_max_memory_strategy_records_the_sizes_as_given(tmp_path):
    """`--device-map auto --max-memory cpu=1MiB` on the shipped pair: the target spills to disk, the run finishes,
    and provenance records the limit as typed. accelerate rewrites the sizes of the dict it is handed into byte
    counts; handed ours, it broke the provenance record after calibration and GPTQ had run (the 27B capped run's
    plan goes through this path)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    out = tmp_path / "a"
    cmd = _gptq(out, "--device-map", "auto", "--max-memory", "cpu=1MiB", "--calib-checkpoint-every", "0")
    cmd[cmd.index("--num-prompts") + 1], cmd[cmd.index("--max-new-tokens") + 1] = "4", "16"
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    placement = json.loads((out / "provenance.json").read_text())["calibration"]["target_placement"]
    assert placement["max_memory"] == {"cpu": "1MiB"} and placement["device_map"] == "auto"
    assert "disk" in placement["resolved"].values(), placement

    # What every forward streams, counted apart from dflash-quant: the file's tensors (read from its header), the
    # tied embedding once more for the head that reads it; on CPU nothing lives in host memory to be streamed.
    target = REPO / "dflash_quant" / "reference" / "pair" / "target"
    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        numel = {k: fh.get_slice(k).get_shape() for k in fh.keys()}
    sizes = {k: int(torch.tensor(shape).prod()) for k, shape in numel.items()}
    assert (
        placement["resolved"] == {"": "disk"}
        and json.loads((target / "config.json").read_text())["tie_word_embeddings"]
    )
    per_element = placement["weight_bytes"]["disk"] // sum(sizes.values())
    assert per_element * sum(sizes.values()) == placement["weight_bytes"]["disk"]
    embed = sizes["model.embed_tokens.weight"] * per_element
    assert placement["streamed_bytes"] == {"host": 0, "pinned": 0, "disk": placement["weight_bytes"]["disk"] + embed}
    streams = f"every target forward streams {fmt_bytes(placement['streamed_bytes']['disk'])} from disk"
    assert any(streams in line for line in res.stderr.splitlines() if line.startswith("[")), res.stderr[-2000:]


# ------------------------------------------------------------------------------------------ memory

CPU_TOLERANCE = 0.05  # measured cpu_tracked_tensors within 5 % of the formula's resident bytes


def test_predicted_vs_measured_peak_cpu():
    d, t = load_pair("reference", None, CPU, torch.float32)
    ids = encode_prompts(t, "reference:calib", 6, True)
    stats = capture(d.model, t.model, ids, 48, "block+context", stop_token_ids=stop_tokens(t), measure=True)
    assert stats.memory is not None and stats.memory["measured_kind"] == "cpu_tracked_tensors"
    pred, comparable = predict_run(
        t.model, d.model, t.source.path, d.raw_config, ids, 48, torch.float32, "block+context", CPU, CPU
    )
    assert comparable == pred.resident
    measured = stats.memory["measured_bytes"]
    assert abs(measured / comparable - 1) < CPU_TOLERANCE, (measured, pred.terms)
    # the Hessian term is exact: every group's fp32 [in, in]
    got = sum(a.xtx.numel() * 4 for a in stats.hessians.values() if a.xtx is not None)
    assert got == pred.terms["hessians"]


def test_budget_calibration_hand_checked():
    """Qwen3.5-27B + its DFlash drafter (presets), 1024-token prompts, 64 new tokens, bf16."""
    drafter = parse_shape(preset_path("qwen3.5-27b-dflash"))
    widths = hessian_widths(drafter)
    # fc: 5 taps x 5120; per layer: qkv 5120, kv 5120, o_proj 32 x 128 = 4096, gate_up 5120, down 17408
    per_layer = 3 * 5120**2 + 4096**2 + 17408**2
    assert sum(w * w for w in widths.values()) == (5 * 5120) ** 2 + 5 * per_layer
    hess = 4 * ((5 * 5120) ** 2 + 5 * per_layer)
    assert hess == 10_590_617_600  # 9.86 GiB of fp32 Hessians, 2.62 GB of them fc's

    rep = calibration_budget("qwen3.5-27b", "qwen3.5-27b-dflash", "h100", 1024, 64)
    p = rep.predicted
    assert p is not None and p["hessians"] == hess
    # prefill: 65 hidden states of [1024, 5120] bf16; KV: 16 full layers x 2 x 4 kv heads x 256 x 2 B per token
    assert p["hidden_states"] == 65 * 1024 * 5120 * 2
    assert p["target_kv"] - (16 * 2 * 4 * 256 * 2) * 1024 > 0  # plus the 48 linear layers' fixed state
    assert p["logits"] == 248320 * 2
    assert rep.peak_bytes == sum(p.values()) and rep.fits  # ~64.2 GiB on an 80 GiB card
    assert rep.usable_bytes == 80 * 2**30 - 2**30

    small = calibration_budget("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 1024, 64)
    assert not small.fits and small.fix is not None and small.fix.fits
    assert small.fix.flags is not None and "--hessian-device cpu" in small.fix.flags
    others = small.peak_bytes - hess - p["target_weights"]  # activations + drafter: stay on the GPU
    limit = 23 * 2**30 - others
    gib = f"{int(limit // ((1 << 30) / 100)) / 100:.2f}GiB"
    assert any(f.startswith(f"--max-memory 0={gib},cpu=") for f in small.fix.flags), (small.fix.flags, gib)
    assert small.fix.gpu_bytes is not None and small.fix.gpu_bytes <= small.usable_bytes
    # the GPU keeps its largest module free (the 248k x 5120 head), the host takes the rest plus one layer
    head = 248320 * 5120 * 2
    assert small.fix.target_on_gpu_bytes == int(limit) - head
    layer = mean_layer_bytes(parse_shape(preset_path("qwen3.5-27b")), p["target_weights"])
    assert small.fix.cpu_bytes == p["target_weights"] - small.fix.target_on_gpu_bytes + layer + hess
    # what stays in host memory is copied onto the GPU for every target forward
    assert small.fix.streamed_bytes == p["target_weights"] - small.fix.target_on_gpu_bytes
    hess_only = calibration_budget("qwen3.5-27b", "qwen3.5-27b-dflash", "60GiB", 1024, 64)  # Hessians off the GPU
    assert hess_only.fix is not None and hess_only.fix.flags == ["--hessian-device cpu"]
    assert hess_only.fix.streamed_bytes == 0  # the target stays whole on the GPU


def _offload_probe():
    """benchmarks/hybrid27b/offload_probe.py (its meta 27B tree and placement report are the README's numbers)."""
    spec = importlib.util.spec_from_file_location(
        "offload_probe", REPO / "benchmarks" / "hybrid27b" / "offload_probe.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpu", ["21.5GiB", "rtx4090"])
def test_the_offload_plan_puts_nothing_on_disk_when_accelerate_places_it(gpu):
    """The plan's --max-memory, given to accelerate's own placement (what from_pretrained does with
    --device-map auto), keeps every module on the GPU or in host RAM: a module left to "disk" is read back from
    files on every forward (the 27B capped run's greedy decode stalled on it), and the GPU part stays within
    the plan's limit."""
    from accelerate import infer_auto_device_map

    rep = calibration_budget("qwen3.5-27b", "qwen3.8-27b-dflash2", gpu, 96, 64, rows=16, teacher=True)
    assert rep.fix is not None and rep.fix.flags is not None
    mem = next(f for f in rep.fix.flags if f.startswith("--max-memory "))
    limits = {(0 if k == "0" else k): v for k, v in (kv.split("=") for kv in mem.split()[1].split(","))}
    probe = _offload_probe()
    model = probe.meta_27b()
    dmap = infer_auto_device_map(
        model, max_memory=limits, no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16
    )
    assert "disk" not in dmap.values(), sorted(k for k, v in dmap.items() if v == "disk")
    on_gpu = sum(
        p.numel() * 2 for name, dev in dmap.items() if dev == 0 for p in model.get_submodule(name).parameters()
    )
    assert 0 < on_gpu <= rep.fix.target_on_gpu_bytes + 2**30  # the embedding rides on the GPU besides the layers
    # the streamed bytes `budget` announces are what accelerate leaves on the CPU, within about one layer
    on_cpu = sum(
        p.numel() * 2 for name, dev in dmap.items() if dev == "cpu" for p in model.get_submodule(name).parameters()
    )
    layer = mean_layer_bytes(parse_shape(preset_path("qwen3.5-27b")), on_cpu + on_gpu)
    assert rep.fix.streamed_bytes is not None and abs(on_cpu - rep.fix.streamed_bytes) <= 1.5 * layer, (
        on_cpu,
        rep.fix.streamed_bytes,
        layer,
    )
    # the probe's CPU report (`offload_probe.py --placement-only`, the README's numbers) is this placement
    report = probe.placement(mem.split()[1])
    assert report["host_bytes"] == on_cpu and report["disk_modules"] == []
    assert report["modules"] == dict(Counter(str(v) for v in dmap.values()))


def test_budget_calibration_cli_json(tmp_path):
    from typer.testing import CliRunner

    from dflash_quant.cli.app import app

    res = CliRunner().invoke(
        app,
        ["budget", "--calibration", "--target", "qwen3.5-27b", "--drafter", "qwen3.5-27b-dflash", "--gpu", "48GiB",
         "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["fits"] is False and rep["fix"]["flags"][0] == "--hessian-device cpu"
    # the human form says what the split costs every forward, in the JSON's own number
    text = CliRunner().invoke(
        app,
        ["budget", "--calibration", "--target", "qwen3.5-27b", "--drafter", "qwen3.5-27b-dflash", "--gpu", "48GiB"],
    )  # fmt: skip
    assert text.exit_code == 0, text.output
    streamed = f"every target forward copies the ~{fmt_bytes(rep['fix']['streamed_bytes'])} of target weights"
    assert rep["fix"]["streamed_bytes"] > 0 and streamed in " ".join(text.stdout.split())


def test_save_target_tiny_split_refuses_nothing(tmp_path):
    """A plain strategy on a CPU-only machine loads the whole tiny target on cpu (no GPU to split over)."""
    save_target(tmp_path / "t")
    save_drafter(tmp_path / "d")
    p = make_placement("sequential", None)
    _, t = load_pair(str(tmp_path / "d"), str(tmp_path / "t"), CPU, torch.float32, p)
    assert {p.device.type for p in t.model.parameters()} == {"cpu"}
