"""gptq-kl: GPTQ codes kept, scales (and codes, one step) tuned on the drafter's KL to its bf16 self and the target's
tokens, on the shipped reference pair."""

import copy
import json
import re
import subprocess
import sys

import pytest
import torch

from dflash_quant.calibration.capture import capture
from dflash_quant.errors import DFlashQuantError
from dflash_quant.loading.runtime import encode_prompts, load_pair
from dflash_quant.quantize.drafter import quantize_drafter
from dflash_quant.quantize.settings import QuantSettings
from dflash_quant.quantize.tune import (
    _kl,
    pack,
    packed_labels,
    packed_rows,
    position_weights,
    reached_rows,
    replay_rows,
    teacher_rows,
    tune_scales,
)
from dflash_quant.speculative.decode import target_generate


@pytest.fixture(scope="module")
def calibrated():
    """The reference pair (fp32, CPU) and a calibration on 6 prompts with the drafter's inputs recorded."""
    torch.manual_seed(0)
    drafter, target = load_pair("reference", None, torch.device("cpu"), torch.float32)
    prompts = encode_prompts(target, "reference:calib", 6, False, 24)
    stats = capture(drafter.model, target.model, prompts, 24, kv_hessian="block+context", keep_replay=True)
    return drafter, target, stats, prompts


def _quantized(calibrated, bits=3):
    drafter, target, stats, _ = calibrated
    model = copy.deepcopy(drafter.model)
    teacher = teacher_rows(model, stats.replay)
    settings = QuantSettings(bits=bits, group_size=128, min_rows=16)
    outcome = quantize_drafter(model, stats, settings)
    return model, teacher, outcome, target.model.get_output_embeddings()


def _replay_kl(model, replay, teacher, head) -> float:
    """Mean KL per row, computed the decode loop's way (one forward per call, cached context)."""
    total, rows = 0.0, 0
    with torch.no_grad():
        for calls, t in zip(replay, teacher, strict=True):
            h = torch.cat([r[0] for r in replay_rows(model, calls)])
            t_logp = torch.log_softmax(model.compute_logits(t, head), -1)
            total += float(_kl(model.compute_logits(h, head), t_logp))
            rows += t.shape[0]
    return total / rows


@pytest.mark.parametrize("variant", ["reference", "dflash2"])
def test_one_packed_forward_equals_the_decode_loops_calls(calibrated, tmp_path, variant):
    """The tuning objective sees what decoding computes: context cached call by call, shorter last blocks,
    DFlash2's causal/sliding layers and block-local convolutions."""
    from tiny import save_dflash2_drafter, save_target

    from dflash_quant.calibration.capture import capture as run_capture
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.target import load_target

    if variant == "reference":
        drafter, target, stats, _ = calibrated
        model, replay = drafter.model, stats.replay
    else:
        d = load_drafter(
            str(save_dflash2_drafter(tmp_path / "d", std=0.2)), device=torch.device("cpu"), dtype=torch.float32
        )
        t = load_target(str(save_target(tmp_path / "t")), device=torch.device("cpu"), dtype=torch.float32)
        prompts = [[5 + i, 9, 17 + i, 33, 8] for i in range(3)]
        replay = run_capture(d.model, t.model, prompts, 21, keep_replay=True).replay
        model = d.model
        assert any(layer.self_attn.sliding_window or layer.self_attn.is_causal for layer in model.layers)
    sizes = {c.noise.shape[1] for calls in replay for c in calls}
    assert len(sizes) > 1 or variant == "reference"  # a short last block is among the calls
    with torch.no_grad():
        for calls in replay:
            seq = torch.cat([r[0] for r in replay_rows(model, calls)])
            one = packed_rows(model, pack(model, calls))
            assert one.shape == seq.shape
            torch.testing.assert_close(one, seq, rtol=1e-4, atol=1e-4)


def test_tuning_lowers_the_drafters_kl_and_keeps_a_plain_grid(calibrated):
    _, _, stats, _ = calibrated
    model, teacher, outcome, head = _quantized(calibrated)
    codes = {n: qw.codes.clone() for n, qw in outcome.weights.items()}
    zeros = {n: qw.zeros.clone() for n, qw in outcome.weights.items()}
    old_scales = {n: qw.scales.clone() for n, qw in outcome.weights.items()}
    before = _replay_kl(model, stats.replay, teacher, head)
    report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=2, lr=5e-3, codes=False)
    after = _replay_kl(model, stats.replay, teacher, head)

    assert not report.kept_gptq_scales and report.steps == 2 * len(stats.replay) and report.code_travel is None
    assert report.kl_before == pytest.approx(before, rel=1e-4)
    assert report.kl_after == pytest.approx(after, rel=1e-4)  # measured on what the module now holds
    assert after < 0.9 * before
    moved = 0
    for name, qw in outcome.weights.items():
        assert torch.equal(qw.codes, codes[name]) and torch.equal(qw.zeros, zeros[name])  # the grid's integers stay
        assert torch.equal(qw.scales, qw.scales.half().float())  # what GPTQ v1's fp16 scales hold, exactly
        assert (qw.scales > 0).all()
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize())  # the module holds the export
        moved += int(not torch.equal(qw.scales, old_scales[name]))
        assert report.scale_change[name] >= 0
    assert moved == len(outcome.weights)
    # the swap is undone: plain Linears, nothing left trainable that was not before
    assert all(type(model.get_submodule(n)).__name__ == "Linear" for n in outcome.weights)


def test_code_offsets_travel_at_most_their_budget_however_many_steps_run(calibrated):
    """Each signed step is --tune-code-travel / steps (at most 0.01): more prompts or passes do not move codes
    further (with a fixed step, 6x the calibration prompts let codes drift and the tuning lost to GPTQ)."""
    _, _, stats, _ = calibrated
    for epochs in (2, 12):
        model, teacher, outcome, head = _quantized(calibrated)
        codes = {n: qw.codes.clone() for n, qw in outcome.weights.items()}
        report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=epochs, code_travel=0.45)
        assert report.steps == epochs * len(stats.replay)
        assert report.code_step == pytest.approx(min(0.01, 0.45 / report.steps))
        # 0.45 < 0.5: no offset reaches a rounding boundary, so no code moves, at 12 steps or 72
        assert all(torch.equal(qw.codes, codes[n]) for n, qw in outcome.weights.items())
    model, teacher, outcome, head = _quantized(calibrated)
    codes = {n: qw.codes.clone() for n, qw in outcome.weights.items()}
    report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=12, code_travel=2.0)
    assert report.code_step == pytest.approx(0.01) and not report.kept_gptq_scales  # 72 steps: capped at 0.01
    moved = [float((qw.codes != codes[n]).float().mean()) for n, qw in outcome.weights.items()]
    assert max(moved) > 0 and moved == pytest.approx([report.codes_changed[n] for n in outcome.weights])
    for n, qw in outcome.weights.items():  # by at most one step, inside the grid
        assert (
            int((qw.codes.int() - codes[n].int()).abs().max()) <= 1
            and 0 <= int(qw.codes.min())
            and int(qw.codes.max()) <= 7
        )


def _kl_by_position(model, replay, teacher, head) -> torch.Tensor:
    """Mean KL at each block position (index 0: the first row after the anchor), the decode loop's way."""
    total, count = torch.zeros(16), torch.zeros(16)
    with torch.no_grad():
        for calls, t in zip(replay, teacher, strict=True):
            rows = [r[0] for r in replay_rows(model, calls)]
            t_logp = torch.log_softmax(model.compute_logits(t, head), -1)
            logq = torch.log_softmax(model.compute_logits(torch.cat(rows), head), -1)
            per_row = (t_logp.exp() * (t_logp - logq)).sum(-1)
            pos = torch.cat([torch.arange(r.shape[0]) for r in rows])
            total.index_add_(0, pos, per_row)
            count.index_add_(0, pos, torch.ones_like(per_row))
    return total[count > 0] / count[count > 0]


def test_position_decay_weighs_each_block_row_by_its_position(calibrated):
    """The loss reads the rows as acceptance does: position k weighs exp(-(k-1)/decay), so the report's KL, before
    and after, is that weighted mean of what the decode loop's forwards give."""
    assert torch.allclose(position_weights([4, 2], 2.0), torch.tensor([1.0, 0.6065307, 0.3678794, 1.0]))
    assert torch.equal(position_weights([3], 0.0), torch.ones(2))
    _, _, stats, _ = calibrated
    for decay in (0.0, 0.5):
        model, teacher, outcome, head = _quantized(calibrated)
        by_pos = _kl_by_position(model, stats.replay, teacher, head)
        sizes = [c.noise.shape[1] for calls in stats.replay for c in calls]
        n = torch.zeros(len(by_pos))
        for size in sizes:
            n[: size - 1] += 1
        w = torch.exp(-torch.arange(len(by_pos)) / decay) if decay else torch.ones(len(by_pos))
        report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=2, lr=5e-3,
                             position_decay=decay)  # fmt: skip
        assert report.kl_before == pytest.approx(float((by_pos * n * w).sum() / (n * w).sum()), rel=1e-4)
        after = _kl_by_position(model, stats.replay, teacher, head)
        assert report.kl_after == pytest.approx(float((after * n * w).sum() / (n * w).sum()), rel=1e-4)
        assert report.position_decay == decay and not report.kept_gptq_scales


def test_each_recorded_call_carries_the_targets_tokens_at_its_block_positions(calibrated):
    """Labels are the target's own greedy output at every block position (accepted by the drafter or not),
    -1 past the run's end: what the label-based tuning losses score against."""
    _, target, stats, prompts = calibrated
    checked = 0
    for ids, calls in zip(prompts, stats.replay, strict=True):
        greedy = target_generate(target.model, torch.tensor([ids]), 24).tokens
        seq = [*ids, *greedy]
        for call in calls:
            pos = call.positions[0, -call.noise.shape[1] :].tolist()
            want = [seq[p] if p < len(seq) else -1 for p in pos]
            assert call.labels is not None and call.labels.tolist() == want
            checked += sum(w >= 0 for w in want[1:])
    assert checked > 100
    assert packed_labels(stats.replay[0]).numel() == sum(c.noise.shape[1] - 1 for c in stats.replay[0])


def test_reached_rows_are_those_after_a_run_of_target_tokens():
    """Row k of a block counts only if rows 1..k-1 drafted the target's token; rows past the run's end never."""
    teacher = torch.tensor([5, 6, 9, 8, 1, 2, 3])  # blocks of 4 and 4 rows: 3 + 3 scored rows, then 1 (size 2)
    labels = torch.tensor([5, 7, 9, 1, 2, -1, 4])
    got = reached_rows([4, 4, 2], teacher[:7], labels)
    # block 1: 5=5 hit, 6!=7 miss -> rows 1, 2 reached, 3 not; block 2: 8!=1 -> only row 1; block 3: row 1 always
    assert got.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_reached_rows_and_the_target_term_are_the_loss_the_report_reads(calibrated):
    """rows="reached" scores only the rows the bf16 drafter reaches, and target_weight adds the cross-entropy to
    the target's token on them: the report's loss before tuning is that, computed the decode loop's way."""
    _, _, stats, _ = calibrated
    for rows, weight in (("reached", 0.0), ("all", 0.5), ("reached", 0.5)):
        model, teacher, outcome, head = _quantized(calibrated)
        total, count = 0.0, 0.0
        with torch.no_grad():
            for calls, t in zip(stats.replay, teacher, strict=True):
                t_logits = model.compute_logits(t, head)
                q_logits = model.compute_logits(torch.cat([r[0] for r in replay_rows(model, calls)]), head)
                labels = packed_labels(calls)
                sizes = [c.noise.shape[1] for c in calls]
                w = reached_rows(sizes, t_logits.argmax(-1), labels) if rows == "reached" else torch.ones(len(labels))
                t_logp = torch.log_softmax(t_logits, -1)
                per_row = (t_logp.exp() * (t_logp - torch.log_softmax(q_logits, -1))).sum(-1)
                ce = torch.nn.functional.cross_entropy(q_logits, labels.clamp(min=0), reduction="none")
                total += float((w * (per_row + weight * ce * (labels >= 0))).sum())
                count += float(w.sum())
        report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=2, lr=5e-3, rows=rows,
                             target_weight=weight)  # fmt: skip
        assert report.kl_before == pytest.approx(total / count, rel=1e-4)
        assert report.kl_after < report.kl_before
    # the bf16 drafter misses some drafts, so "reached" scores a strict subset of the rows
    model, teacher, _, head = _quantized(calibrated)
    n_all = sum(len(packed_labels(c)) for c in stats.replay)
    n_reached = sum(
        float(reached_rows([c.noise.shape[1] for c in calls], model.compute_logits(t, head).argmax(-1),
                           packed_labels(calls)).sum())
        for calls, t in zip(stats.replay, teacher, strict=True)
    )  # fmt: skip
    assert 0 < n_reached < n_all


def test_label_losses_need_recorded_target_tokens(calibrated):
    _, _, stats, _ = calibrated
    model, teacher, outcome, head = _quantized(calibrated)
    bare = [[type(c)(c.noise, c.ctx, c.positions) for c in calls] for calls in stats.replay]
    with pytest.raises(DFlashQuantError, match="no target tokens"):
        tune_scales(model, outcome.weights, bare, teacher, head, epochs=1, rows="reached")


def test_tuned_norms_are_plain_parameters_that_lower_the_kl_further(calibrated):
    """--tune-norms: each RMSNorm's weight gets a per-channel multiplier; the result is a plain Parameter again
    (what the export writes), and the KL ends below the Linears-only tuning's on the same steps."""
    from dflash_quant.quantize.tune import norm_modules

    _, _, stats, _ = calibrated
    after = {}
    for norms in (False, True):
        model, teacher, outcome, head = _quantized(calibrated)
        before = {n: m.weight.detach().clone() for n, m in norm_modules(model)}
        grads = {n: m.weight.requires_grad for n, m in norm_modules(model)}
        assert before
        report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=2, lr=1e-3, norms=norms)
        assert not report.kept_gptq_scales
        after[norms] = _replay_kl(model, stats.replay, teacher, head)
        assert report.kl_after == pytest.approx(after[norms], rel=1e-4)  # measured on what the modules now hold
        for n, m in norm_modules(model):
            assert isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad == grads[n]
            assert torch.equal(m.weight, before[n]) != norms  # moved only when tuned
            assert torch.equal(model.state_dict()[f"{n}.weight"], m.weight)  # what the export writes
        assert report.norms == norms and bool(report.norm_change) == norms
    assert after[True] < after[False]


def _hessian_error(weights, originals, stats) -> float:
    """Mean over Linears of tr(E H E^T) / tr(W H W^T), E = quantized - bf16 weight (GPTQ's objective)."""
    errs = []
    for name, qw in weights.items():
        w, h = originals[name], stats.for_linear(name).xtx
        e = qw.dequantize() - w
        errs.append(float(((e @ h) * e).sum() / ((w @ h) * w).sum()))
    return sum(errs) / len(errs)


def test_the_anchor_holds_the_tuning_near_gptqs_objective(calibrated):
    drafter, _, stats, _ = calibrated
    originals = {n: drafter.model.get_submodule(n).weight.detach().clone() for n, _ in drafter.model.named_modules()
                 if isinstance(drafter.model.get_submodule(n), torch.nn.Linear)}  # fmt: skip
    errors = {}
    for weight in (0.0, 1000.0):
        model, teacher, outcome, head = _quantized(calibrated)
        anchors = {n: (originals[n], stats.for_linear(n).xtx) for n in outcome.weights}
        report = tune_scales(model, outcome.weights, stats.replay, teacher, head, epochs=2, lr=5e-3,
                             anchors=anchors, anchor_weight=weight)  # fmt: skip
        assert not report.kept_gptq_scales
        errors[weight] = _hessian_error(outcome.weights, originals, stats)
    assert errors[1000.0] < errors[0.0]


def test_a_drafter_already_at_its_teacher_keeps_the_gptq_scales(calibrated):
    """Never worse on the replay: with the quantized drafter as its own teacher the KL is 0 and stays the best."""
    _, _, stats, _ = calibrated
    model, _, outcome, head = _quantized(calibrated)
    own = teacher_rows(model, stats.replay)
    scales = {n: qw.scales.clone() for n, qw in outcome.weights.items()}
    report = tune_scales(model, outcome.weights, stats.replay, own, head, epochs=1, lr=5e-3)
    assert report.kept_gptq_scales and report.kl_after == report.kl_before
    assert all(torch.equal(qw.scales, scales[n]) for n, qw in outcome.weights.items())
    assert all(torch.equal(model.get_submodule(n).weight, qw.dequantize()) for n, qw in outcome.weights.items())


def test_a_mixed_precision_drafter_is_tuned_within_each_linears_grid(calibrated):
    """After a mix (per-Linear bits and groups) every Linear keeps its own grid: codes within its own range."""
    drafter, target, stats, _ = calibrated
    model = copy.deepcopy(drafter.model)
    rows = teacher_rows(model, stats.replay)
    names = model.linear_names()
    picks = {n: ((2, 64) if i % 3 == 0 else (4, 128) if i % 3 == 1 else (3, 128)) for i, n in enumerate(names)}
    outcome = quantize_drafter(model, stats, QuantSettings(bits=4, group_size=128, min_rows=16), picks=picks)
    head = target.model.get_output_embeddings()
    report = tune_scales(model, outcome.weights, stats.replay, rows, head, epochs=1)
    assert report.kl_after < report.kl_before
    for name, qw in outcome.weights.items():
        bits, group = picks[name]
        assert qw.spec.bits == bits and qw.n_groups == qw.in_features // group
        assert int(qw.codes.max()) <= 2**bits - 1
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize())


@pytest.mark.parametrize("gguf_type", ["Q3_K", "Q2_K", "Q4_K", "IQ4_NL"])
def test_a_kquant_grid_is_tuned_within_llama_cpps_layout(calibrated, gguf_type):
    """On a llama.cpp grid the fp16 super-block d (and dmin) move, the integer sub-block scales and mins stay, codes
    move at most one step (IQ4_NL's codebook indices not at all), and the module holds what the GGUF will store."""
    from dflash_quant.quantize.kquant import quantize_drafter_kquant

    drafter, target, stats, _ = calibrated
    model = copy.deepcopy(drafter.model)
    rows = teacher_rows(model, stats.replay)
    outcome = quantize_drafter_kquant(model, stats, QuantSettings(bits=4, min_rows=16), gguf_type, scale_search=0)
    old = {
        n: (qw.d.clone(), qw.dmin.clone(), qw.sc.clone(), qw.m.clone(), qw.codes.clone())
        for n, qw in outcome.weights.items()
    }
    head = target.model.get_output_embeddings()
    before = _replay_kl(model, stats.replay, rows, head)
    # at 4.5 bits (IQ4_NL's blocks of 32) the default --tune-lr moves every scale by more than the grid errs
    lr = 5e-4 if gguf_type == "IQ4_NL" else 2e-3
    report = tune_scales(model, outcome.weights, stats.replay, rows, head, epochs=2, lr=lr)
    after = _replay_kl(model, stats.replay, rows, head)
    assert not report.kept_gptq_scales and after < 0.9 * before
    assert report.kl_after == pytest.approx(after, rel=1e-4)
    for name, qw in outcome.weights.items():
        d, dmin, sc, m, codes = old[name]
        assert torch.equal(qw.sc, sc) and torch.equal(qw.m, m)  # the integer sub-block scales stay
        assert torch.equal(qw.d, qw.d.half().float()) and torch.equal(qw.dmin, qw.dmin.half().float())
        assert torch.equal(qw.d == 0, d == 0)
        if qw.grid.has_min:  # d and dmin share the block's multiplier: the block scales around zero
            live = (d != 0) & (dmin != 0)
            assert torch.allclose((qw.d / d)[live], (qw.dmin / dmin)[live], rtol=2e-3)
        else:
            assert torch.equal(qw.dmin, dmin)
        moved = (qw.codes.long() - codes.long()).abs()
        assert int(moved.max()) <= (0 if gguf_type == "IQ4_NL" else 1)
        assert int(qw.codes.max()) <= qw.grid.levels - 1
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize())
    assert any(not torch.equal(qw.d, old[n][0]) for n, qw in outcome.weights.items())


def test_tuning_without_recorded_inputs_is_refused(calibrated):
    from dflash_quant.errors import DFlashQuantError

    model, teacher, outcome, head = _quantized(calibrated)
    with pytest.raises(DFlashQuantError, match="replay"):
        tune_scales(model, outcome.weights, [], [], head)


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash_quant.cli.app", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


@pytest.mark.slow
def test_gptq_kl_artifact_records_the_method_and_verifies(tmp_path):
    out = tmp_path / "kl3"
    small = ["--num-prompts", "6", "--max-new-tokens", "24", "--eval-num-prompts", "3", "--eval-max-new-tokens", "24"]
    res = _cli(
        "gptq",
        "--bits",
        "3",
        "--method",
        "gptq-kl",
        "--tune-epochs",
        "1",
        "--output",
        str(out),
        *small,
        "--tolerance",
        "0.5",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    tuning = result["quant_report"]["tuning"]
    assert tuning["steps"] == 6 and tuning["kl_after"] <= tuning["kl_before"]
    # 6 prompts: the run says it was tuned on too few, and how to give more
    assert tuning["prompts"] == 6 and "gptq-kl was tuned on 6 calibration prompts" in res.stderr
    assert "--calib-prompts" in res.stderr
    report = json.loads((out / "quant_report.json").read_text())
    methods = {layer["method"] for layer in report["layers"]}
    assert methods == ({"gptq"} if tuning["kept_gptq_scales"] else {"gptq-kl"})
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["quantization"]["method"] == "gptq-kl" and prov["quantization"]["tune_epochs"] == 1
    assert prov["quantization"]["tune_lr"] == 0.002  # the v1 grids' default, recorded as used
    card = (out / "README.md").read_text()
    assert "| method | gptq-kl |" in card and "scale tuning (gptq-kl)" in card
    # the default loss, as chosen on the development split, is what the report and card say was tuned
    assert tuning["rows"] == "reached" and tuning["target_weight"] == 3.0
    assert prov["quantization"]["tune_rows"] == "reached" and prov["quantization"]["tune_target"] == 3.0
    assert "3 x cross-entropy to the target's token, on the rows the bf16 drafter reaches" in card
    # the artifact is a plain GPTQ v1 checkpoint: verify reloads it and measures it lossless
    check = _cli("verify", str(out), "--num-prompts", "2", "--max-new-tokens", "16", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["summary"]["lossless"] is True


@pytest.mark.slow
def test_gptq_kl_on_a_kquant_mix_writes_the_tuned_gguf(tmp_path):
    """`--method gptq-kl --gguf-type Q2_K_MIX` (llama.cpp's Q2_K mix): the GGUF holds the tuned grid, its report names
    the method per Linear, and verify reloads the file and finds the same drafter."""
    out = tmp_path / "q2k"
    small = ["--num-prompts", "6", "--max-new-tokens", "24", "--eval-num-prompts", "3", "--eval-max-new-tokens", "24"]
    res = _cli(
        "gptq", "--method", "gptq-kl", "--format", "gguf", "--gguf-type", "Q2_K_MIX", "--tune-epochs", "1",
        "--output", str(out), *small, "--tolerance", "0.5", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    tuning = result["quant_report"]["tuning"]
    assert tuning["steps"] == 6 and tuning["kl_after"] <= tuning["kl_before"]
    report = json.loads((out / "quant_report.json").read_text())
    assert {layer["method"] for layer in report["layers"]} == ({"gptq"} if tuning["kept_gptq_scales"] else {"gptq-kl"})
    assert {layer["gguf_type"] for layer in report["layers"]} == {"Q2_K", "Q3_K"}  # llama.cpp's per-tensor mix
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["quantization"]["tune_lr"] == 0.001  # the k-quant grids' default, recorded as used
    ggufs = [p for p in out.glob("*.gguf") if not p.name.endswith(".imatrix.gguf")]
    assert len(ggufs) == 1
    check = _cli("verify", str(out), "--num-prompts", "3", "--max-new-tokens", "24", "--json")
    assert check.returncode == 0, check.stderr
    summary = json.loads(check.stdout)["summary"]
    assert summary["lossless"] is True
    # the reloaded GGUF drafts exactly as the drafter gptq measured (same weights, same prompts)
    assert summary["tau"] == pytest.approx(result["parity"]["quantized"]["tau"], abs=1e-9)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "gptq-kl", "--tune-epochs", "0"], "--tune-epochs must be >= 1"),
        (["--method", "gptq-kl", "--tune-lr", "2"], "--tune-lr must be in (0, 1)"),
        (["--method", "gptq-kl", "--tune-code-travel", "0"], "--tune-code-travel must be in (0, 100]"),
        (["--method", "gptq-kl", "--tune-position-decay", "-1"], "--tune-position-decay must be in [0, 1000]"),
        (["--method", "gptq-kl", "--tune-rows", "some"], "--tune-rows must be one of all, reached"),
        (["--method", "gptq-kl", "--tune-target", "-1"], "--tune-target must be in [0, 100]"),
        (
            ["--method", "gptq-kl", "--format", "gguf", "--gguf-type", "Q3_K", "--desc-act"],
            "drop --sequential/--desc-act",
        ),
        (["--method", "rtn", "--max-tau-loss", "0.01"], "drop --method rtn"),
    ],
)
def test_bad_tuning_options_are_one_line_errors(tmp_path, args, message):
    out = tmp_path / "never"
    res = _cli("gptq", "--output", str(out), *args)
    assert res.returncode == 2
    # progress lines ("[hh:mm:ss] loading ...") are not part of the error
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", ln)]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not out.exists()
