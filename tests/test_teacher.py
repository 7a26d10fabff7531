"""--teacher-forced: the target's greedy continuation decoded once in batches, the speculative loop replayed from it.

The replay must give what the loop gives (fp32, CPU): the same tokens, accepted drafts and committed counts per
step on the dense v1 pair and on the hybrid (Gated DeltaNet) DFlash2 pair, prompts of different lengths decoded
as left-padded rows of one batch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash_quant.calibration.capture import capture
from dflash_quant.export.int4_target import write_int4_target
from dflash_quant.io.source import resolve
from dflash_quant.loading.runtime import encode_prompts, load_pair, stop_tokens
from dflash_quant.loading.target import load_target
from dflash_quant.memory.calibration import predict_calibration
from dflash_quant.memory.kv import parse_shape
from dflash_quant.quantize.spec import QuantSpec
from dflash_quant.speculative.decode import speculative_generate
from dflash_quant.speculative.teacher import TeacherTarget, greedy_rows

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["reference", "reference-dflash2"])
def pair(request):
    drafter, target = load_pair(request.param, None, CPU, torch.float32)
    prompts = encode_prompts(target, "reference:heldout", 6, True)
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths: left padding is exercised
    return request.param, drafter, target, prompts


def test_replay_gives_the_loops_steps(pair):
    _, drafter, target, prompts = pair
    stops = stop_tokens(target)
    rows = greedy_rows(target.model, prompts, 40, drafter.model.target_layer_ids, CPU)
    for ids, row in zip(prompts, rows, strict=True):
        assert row.ids[: len(ids)] == ids and len(row.continuation) == 41
        loop = speculative_generate(drafter.model, target.model, torch.tensor([ids]), 40, stop_token_ids=stops)
        replay = speculative_generate(
            drafter.model, TeacherTarget(target.model, row), torch.tensor([ids]), 40, stop_token_ids=stops
        )
        assert replay.tokens == loop.tokens
        assert replay.acceptance_lengths == loop.acceptance_lengths
        assert replay.accepted == loop.accepted
        assert replay.target_forwards == 0 and replay.replay_forwards == 0 and loop.target_forwards > 0
        # the loop's tokens are the target's greedy continuation, clipped where it stops
        assert row.continuation[: len(loop.tokens)] == loop.tokens


def test_capture_from_the_teacher_matches_the_loop(pair):
    _, drafter, target, prompts = pair
    stops = stop_tokens(target)
    loop = capture(drafter.model, target.model, prompts, 24, "block+context", stop_token_ids=stops)
    taught = capture(
        drafter.model, target.model, prompts, 24, "block+context", stop_token_ids=stops, batch=4, teacher=True
    )
    assert taught.steps == loop.steps and taught.mean_tau == loop.mean_tau
    assert taught.rows() == loop.rows()
    for key, acc in loop.hessians.items():
        a, b = acc.xtx, taught.hessians[key].xtx
        # taps of one-token forwards vs block forwards: the same numbers up to fp32 rounding
        assert float((a - b).norm() / a.norm()) < 1e-4, key


def test_teacher_capture_keeps_each_prompts_drafter_calls():
    drafter, target = load_pair("reference-dflash2", None, CPU, torch.float32)
    prompts = encode_prompts(target, "reference:calib", 5, True)
    stops = stop_tokens(target)
    loop = capture(drafter.model, target.model, prompts, 16, stop_token_ids=stops, keep_replay=True)
    taught = capture(
        drafter.model, target.model, prompts, 16, stop_token_ids=stops, keep_replay=True, batch=3, teacher=True
    )
    assert taught.replay is not None and loop.replay is not None
    assert [len(calls) for calls in taught.replay] == [len(calls) for calls in loop.replay]
    for calls_a, calls_b in zip(loop.replay, taught.replay, strict=True):
        for a, b in zip(calls_a, calls_b, strict=True):
            assert torch.equal(a.noise, b.noise) and torch.equal(a.positions, b.positions)
            assert torch.allclose(a.ctx, b.ctx, rtol=1e-4, atol=1e-5)


def test_teacher_peak_prediction_counts_taps_not_every_layer():
    target = parse_shape(resolve("reference-dflash2:target").path)
    drafter = parse_shape(resolve("reference-dflash2").path)
    loop = predict_calibration(target, 0, drafter, 0, 300, 64, rows=16)
    taught = predict_calibration(target, 0, drafter, 0, 300, 64, rows=16, teacher_taps=3)
    h, a = target.hidden_size, 2
    assert taught.terms["hidden_states"] == 16 * (3 * (300 + 64) + 2 * 300) * h * a
    assert taught.terms["hidden_states"] < loop.terms["hidden_states"]
    # the drafter runs one prompt at a time under a teacher
    assert taught.transient["drafter_kv"] * 16 == loop.transient["drafter_kv"]


def test_int4_hybrid_target_packs_the_deltanet_projections(tmp_path):
    dst = tmp_path / "t4"
    counts = write_int4_target(resolve("reference-dflash2:target").path, dst, QuantSpec(4, 32, True))
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head", "re:.*linear_attn\\.in_proj_[ab]$"]
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.linear_attn.in_proj_qkv.weight_packed" in keys
    assert "model.layers.0.linear_attn.out_proj.weight_packed" in keys
    assert "model.layers.0.linear_attn.in_proj_a.weight" in keys  # the small gates stay dense
    assert counts["quantized"] == sum(k.endswith(".weight_packed") for k in keys)
    packed = load_target(str(dst), device=CPU, dtype=torch.float32)
    assert packed.quantization is not None and packed.quantization.packed_linears == counts["quantized"]
    # the consumer: transformers' compressed-tensors loader applies the config to exactly the packed Linears
    # (the ignore list keeps the gates and lm_head dense) and computes what our packed modules compute
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 11, 30, 7, 100, 200]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, packed.model(ids).logits, rtol=1e-5, atol=1e-5)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dflash_quant.cli.app", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_gptq_teacher_forced_reports_tau_and_no_lossless_claim(tmp_path):
    out = tmp_path / "tf"
    small = ["--num-prompts", "4", "--max-new-tokens", "16", "--eval-num-prompts", "4", "--eval-max-new-tokens", "24"]
    res = _cli(
        "gptq",
        "reference-dflash2",
        "--teacher-forced",
        "-o",
        str(out),
        *small,
        "--no-check-cache",
        "--tolerance",
        "0.5",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    parity = json.loads((out / "parity.json").read_text())
    assert parity["teacher_forced"] is True and parity["lossless"] is None
    assert parity["lossless_gated"] is False and any("teacher-forced" in n for n in parity["notes"])
    assert parity["baseline"]["tau"] > 1.5 and len(parity["quantized"]["per_position_acceptance"]) == 7
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["calibration"]["teacher_forced"] is True and prov["calibration"]["batch_rows"] == 4
    assert "teacher-forced" in (out / "README.md").read_text()  # the card says how tau was measured
    # the other commands take the artifact as any other
    for args in (
        ["card", str(out)],
        ["memory", str(out), "--json"],
        ["push", str(out), "--repo-id", "me/tf", "--dry-run"],
    ):
        done = _cli(*args)
        assert done.returncode == 0, (args, done.stderr)
    # the same check in the loop gives the same tau (fp32: the teacher's tokens are the loop's)
    loop = _cli("verify", str(out), "--num-prompts", "4", "--max-new-tokens", "24", "--json")
    assert loop.returncode == 0, loop.stderr
    assert json.loads(loop.stdout)["summary"]["tau"] == parity["quantized"]["tau"]
    # verify --teacher-forced: the same tau and acceptance as the loop, no lossless claim
    taught = _cli("verify", str(out), "--teacher-forced", "--compare", "reference-dflash2", "--num-prompts", "4",
                  "--max-new-tokens", "24", "--json")  # fmt: skip
    assert taught.returncode == 0, taught.stderr
    report, looped = json.loads(taught.stdout), json.loads(loop.stdout)["summary"]
    assert report["teacher_forced"] is True and report["summary"]["lossless"] is None
    assert report["summary"]["tau"] == looped["tau"]
    assert report["summary"]["per_position_acceptance"] == looped["per_position_acceptance"]
    assert report["baseline"]["tau"] == parity["baseline"]["tau"] and report["parity"]["lossless_gated"] is False


def test_budget_plans_room_for_the_teachers_rows():
    from dflash_quant.memory.calibration import calibration_budget

    args = ("qwen3.5-27b", "qwen3.8-27b-dflash2", "24GB", 96, 64)
    one = calibration_budget(*args)
    rows = calibration_budget(*args, rows=16, teacher=True)
    assert one.fix is not None and rows.fix is not None and rows.fix.fits
    # 16 rows of Gated DeltaNet state and taps leave less of the card to the target's layers
    assert rows.fix.target_on_gpu_bytes < one.fix.target_on_gpu_bytes
    assert rows.fix.gpu_bytes <= rows.usable_bytes


def test_teacher_of_a_split_target_matches_one_device(tmp_path):
    """Layers offloaded to disk (accelerate streams them in per forward, as from CPU onto a GPU): same record."""
    from dflash_quant.models.placement import Placement

    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dmap.update({f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)})
    one_d, one_t = load_pair("reference-dflash2", None, CPU, torch.float32)
    _, split_t = load_pair("reference-dflash2", None, CPU, torch.float32, Placement(dmap))
    assert any(p.device.type == "meta" for p in split_t.model.parameters()), "nothing was offloaded"
    prompts = encode_prompts(one_t, "reference:calib", 3, True)
    layers = one_d.model.target_layer_ids
    for a, b in zip(
        greedy_rows(one_t.model, prompts, 16, layers, CPU),
        greedy_rows(split_t.model, prompts, 16, layers, CPU),
        strict=True,
    ):
        assert a.ids == b.ids
        for i in layers:
            torch.testing.assert_close(a.taps[i], b.taps[i], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_offloaded_weights_are_pinned_and_give_the_same_output():
    from dflash_quant.models.devmap import pin_offloaded
    from dflash_quant.models.placement import Placement

    dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    dmap.update({f"model.layers.{i}": 0 if i < 3 else "cpu" for i in range(6)})
    path = str(resolve("reference:target").path)
    one = load_target(path, device="cuda", dtype=torch.float32)
    split = load_target(path, device="cuda", dtype=torch.float32, placement=Placement(dmap))
    offloaded = [m for m in split.model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    assert offloaded, "nothing was offloaded"
    assert pin_offloaded(split.model) == 0  # the loader pinned every offloaded tensor already
    ids = torch.tensor([[5, 9, 11, 30, 7]], device="cuda")
    torch.testing.assert_close(split.model(ids).logits, one.model(ids).logits)


def test_the_teacher_check_holds_one_drafter_at_a_time_after_the_targets_record(tmp_path, monkeypatch):
    """Under a GPU cap with a split 27B target, the greedy record's batch and two drafters do not fit at once: the
    check records the target's continuation before any drafter is loaded, holds each drafter for its own pass only,
    and starts after gptq has released the calibrated drafter (weights on meta: the check reads files)."""
    import gc
    import weakref

    from dflash_quant.pipeline import parity, stages
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq

    events: list[str] = []
    held: list[weakref.ref] = []
    real_greedy, real_load, real_verify = parity.greedy_rows_batched, parity.load_drafter, stages.verify

    def greedy(*a, **k):
        events.append("record")
        return real_greedy(*a, **k)

    def load(src, *a, **k):
        gc.collect()
        events.append(f"load ({sum(r() is not None for r in held)} held)")
        loaded = real_load(src, *a, **k)
        held.append(weakref.ref(loaded.model))
        return loaded

    def verify(job, loaded, *a, **k):
        events.append(
            "calibrated drafter on " + ",".join(sorted({p.device.type for p in loaded.drafter.model.parameters()}))
        )
        return real_verify(job, loaded, *a, **k)

    monkeypatch.setattr(parity, "greedy_rows_batched", greedy)
    monkeypatch.setattr(parity, "load_drafter", load)
    monkeypatch.setattr(stages, "verify", verify)
    job = GptqJob(
        output=tmp_path / "tf", drafter="reference-dflash2", calib_num_prompts=4, calib_max_new_tokens=16,
        eval_num_prompts=4, eval_max_new_tokens=16, device="cpu", teacher_forced=True, tolerance=0.5,
        command=["dflash-quant", "gptq"],
    )  # fmt: skip
    result = run_gptq(job)
    assert result.parity is not None and result.parity["teacher_forced"] is True
    assert events == ["calibrated drafter on meta", "record", "load (0 held)", "load (0 held)"], events


@pytest.mark.parametrize("name", ["reference", "reference-dflash2"])
def test_a_teacher_drafts_with_resident_copies_of_an_offloaded_head_and_embedding(name):
    """A split target whose head and input embedding accelerate offloads streams them in on every call: for a
    27B head, 2.5 GB per drafter step. Against a teacher (no target forward meanwhile) the drafter gets resident
    copies instead: the same runs, token for token and step for step, and the offloaded head is not called."""
    from dflash_quant.models.placement import Placement
    from dflash_quant.speculative.verify import CheckSettings, spec_runs

    one_d, one_t = load_pair(name, None, CPU, torch.float32)
    n_layers = one_t.model.config.num_hidden_layers
    dmap = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    dmap.update({f"model.layers.{i}": "cpu" for i in range(n_layers)})
    _, split_t = load_pair(name, None, CPU, torch.float32, Placement(dmap))
    head = split_t.model.get_output_embeddings()
    assert getattr(head._hf_hook, "offload", False), "the head was not offloaded"
    prompts = encode_prompts(one_t, f"{name}:heldout", 3, True)
    layers = one_d.model.target_layer_ids
    settings = CheckSettings(24, 0.0, None, 0, stop_tokens(one_t))
    want = spec_runs(
        one_d.model, one_t.model, prompts, settings, teachers=greedy_rows(one_t.model, prompts, 24, layers, CPU)
    )
    record = greedy_rows(split_t.model, prompts, 24, layers, CPU)
    calls = []
    real = head._hf_hook.pre_forward
    head._hf_hook.pre_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    got = spec_runs(one_d.model, split_t.model, prompts, settings, teachers=record)
    assert calls == []  # drafting never streamed the offloaded head
    for a, b in zip(want, got, strict=True):
        assert a.tokens == b.tokens and a.accepted == b.accepted and a.acceptance_lengths == b.acceptance_lengths
