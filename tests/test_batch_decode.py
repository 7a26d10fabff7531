"""Batched greedy speculative decoding (batch_decode) gives each prompt exactly the sequential loop's run."""

import pytest
import torch
from tiny import dflash2_raw_config, drafter_raw_config, hybrid_target_config, target_config
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from dflash_quant.models.config import parse_draft_config
from dflash_quant.models.model2 import build_drafter
from dflash_quant.speculative.batch_decode import batched_speculative_generate, unbatchable
from dflash_quant.speculative.decode import speculative_generate
from dflash_quant.speculative.lookup import LookupSettings
from dflash_quant.speculative.verify import CheckSettings, spec_runs, summarize

FIELDS = (
    "tokens",
    "accepted",
    "drafted",
    "acceptance_lengths",
    "drafter_drafts",
    "verify_rows",
    "row_accepted",
    "row_drafts",
    "target_forwards",
    "drafter_forwards",
    "verified_tokens",
)


def _run(r):
    return {f: getattr(r, f) for f in FIELDS}


def _sequential(drafter, target, prompts, max_new, stops=None, block=None):
    return [
        speculative_generate(drafter, target, torch.tensor([p]), max_new, stop_token_ids=stops, block_size=block)
        for p in prompts
    ]


def _assert_same(drafter, target, prompts, max_new, stops=None, block=None, batch=None):
    seq = _sequential(drafter, target, prompts, max_new, stops, block)
    batch = batch or len(prompts)
    got = []
    for i in range(0, len(prompts), batch):
        got += batched_speculative_generate(drafter, target, prompts[i : i + batch], max_new, stops, block)
    assert [_run(r) for r in got] == [_run(r) for r in seq]
    assert all(r.batch_rows == min(batch, len(prompts)) for r in got[:batch])
    return seq


def _prompts(n, seed=0, lo=3, hi=14):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 120, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(target_config()).eval()


def _drafter(seed=1, **over):
    torch.manual_seed(seed)
    raw = dflash2_raw_config(**over) if over.pop("v2", False) else drafter_raw_config(**over)
    return build_drafter(parse_draft_config(raw)).eval()


LAYERS = [
    {},  # full attention, non-causal block
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6, "use_sliding_window": True},
    {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 5, "is_causal": True},
]


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("block", [2, 4])
def test_tiny_pair_same_runs_as_sequential(tiny_target, layers, block):
    drafter = _drafter(**layers)
    assert unbatchable(drafter, tiny_target, 0.0, None) is None
    prompts = _prompts(5, seed=block)  # lengths differ: left padding in the prefill
    _assert_same(drafter, tiny_target, prompts, 21, block=block)


def test_tiny_dflash2_same_runs_as_sequential(tiny_target):
    drafter = _drafter(v2=True)
    _assert_same(drafter, tiny_target, _prompts(4, seed=3), 19)


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5, 9])
def test_max_new_tokens_edges(tiny_target, max_new):
    drafter = _drafter()
    seq = _assert_same(drafter, tiny_target, _prompts(3, seed=max_new), max_new)
    assert all(len(r.tokens) == max_new for r in seq)


def test_stop_tokens_end_rows_at_different_steps(tiny_target):
    drafter = _drafter()
    prompts = _prompts(6, seed=7)
    free = _sequential(drafter, tiny_target, prompts, 24)
    # stop on a token some rows produce early and others late or never
    stops = [free[0].tokens[3], free[2].tokens[10]]
    seq = _assert_same(drafter, tiny_target, prompts, 24, stops=stops, batch=4)
    ends = {len(r.tokens) for r in seq}
    assert len(ends) > 1 and min(ends) < 24  # rows did finish at different steps
    # batch size 1 and batches that split the prompts unevenly give the same runs
    _assert_same(drafter, tiny_target, prompts, 24, stops=stops, batch=1)


def test_first_token_a_stop_token(tiny_target):
    drafter = _drafter()
    prompts = _prompts(3, seed=11)
    first = _sequential(drafter, tiny_target, prompts[:1], 8)[0].tokens[0]
    seq = _assert_same(drafter, tiny_target, prompts, 8, stops=[first])
    assert seq[0].tokens == [first] and seq[0].target_forwards == 1


def test_unbatchable_reasons(tiny_target):
    drafter = _drafter()
    assert "temperature" in unbatchable(drafter, tiny_target, 0.7, None)
    assert "lookup" in unbatchable(drafter, tiny_target, 0.0, LookupSettings())
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(hybrid_target_config()).eval()
    assert "plain attention" in unbatchable(drafter, hybrid, 0.0, None)
    windowed = Qwen3ForCausalLM(
        target_config(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 4)
    ).eval()
    assert "plain attention" in unbatchable(drafter, windowed, 0.0, None)


def test_spec_runs_falls_back_for_hybrid_target():
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(hybrid_target_config()).eval()
    drafter = _drafter()
    prompts = _prompts(6, seed=2)
    one = spec_runs(drafter, hybrid, prompts, CheckSettings(max_new_tokens=12))
    many = spec_runs(drafter, hybrid, prompts, CheckSettings(max_new_tokens=12, batch=4))
    assert [_run(r) for r in many] == [_run(r) for r in one]
    assert all(r.batch_rows == 1 for r in many)


def test_spec_runs_batched_record(tiny_target):
    drafter = _drafter()
    prompts = _prompts(11, seed=4)
    settings = CheckSettings(max_new_tokens=10, batch=4)
    one = spec_runs(drafter, tiny_target, prompts, CheckSettings(max_new_tokens=10))
    many = spec_runs(drafter, tiny_target, prompts, settings, timed=3)
    assert [_run(r) for r in many] == [_run(r) for r in one]
    assert [r.batch_rows for r in many] == [1] * 3 + [4] * 4 + [4] * 4
    rec = summarize("d", many, None, settings, 4)
    assert rec == {**rec, "spec_timed_prompts": 3, "spec_batch": 4, "spec_batched_prompts": 8}
    alone_tokens = sum(len(r.tokens) for r in many[:3])
    assert rec["spec_tokens_per_s"] == round(alone_tokens / sum(r.seconds for r in many[:3]), 2)
    assert rec["spec_batched_seconds"] == pytest.approx(sum(r.seconds for r in many[3:]), abs=1e-3)
    plain = summarize("d", one, None, CheckSettings(max_new_tokens=10), 4)
    assert "spec_batch" not in plain
    for key in ("tau", "per_position_acceptance", "acceptance_histogram", "steps", "target_forwards"):
        assert rec[key] == plain[key]


def _reference(name):
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import default_prompt_spec, encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target

    target = load_target("reference:target")  # float32
    prompts = encode_prompts(target, default_prompt_spec(target, "heldout"), 12, True, 48, "a", "b")
    return load_drafter(name).model, target.model, prompts, stop_tokens(target)


@pytest.mark.slow
def test_reference_pair_fp32_same_runs():
    drafter, target, prompts, stops = _reference("reference")
    seq = _assert_same(drafter, target, prompts, 48, stops=stops, batch=5)
    steps = {len(r.acceptance_lengths) for r in seq}
    assert len(steps) > 1  # prompts finished at different steps
    assert len({a for r in seq for a in r.accepted}) > 3  # rows accepted different numbers of drafts


@pytest.mark.slow
def test_reference_dflash2_drafter_on_qwen3_target_same_runs():
    # The DFlash2 reference pair's own target is hybrid (falls back, tested above); its drafter (selector, conv)
    # runs batched against the Qwen3 reference target, which has the same width, vocabulary and layer count.
    drafter, target, prompts, stops = _reference("reference-dflash2")
    _assert_same(drafter, target, prompts[:6], 32, stops=stops)


def test_caches_are_compacted_and_runs_unchanged(tiny_target, monkeypatch):
    import dflash_quant.speculative.batch_decode as bd

    calls = []
    real = bd._compact

    def spy(slot_pos, tensors):
        out = real(slot_pos, tensors)
        calls.append((slot_pos.shape[1], out.shape[1]))
        return out

    monkeypatch.setattr(bd, "_compact", spy)
    _assert_same(_drafter(), tiny_target, _prompts(5, seed=9), 30)
    assert calls and all(after < before for before, after in calls)  # rejected slots were dropped


# ------------------------------------------------------------------------------------------ calibration


def _capture(drafter, target, prompts, batch, **kw):
    from dflash_quant.calibration.capture import capture

    return capture(
        drafter, target, prompts, kw.pop("max_new", 20), stop_token_ids=kw.pop("stops", None), batch=batch, **kw
    )


def _same_hessians(a, b):
    assert a.steps == b.steps and a.mean_tau == b.mean_tau and a.prompts == b.prompts
    assert a.rows() == b.rows()  # padding rows excluded: exactly the sequential rows
    for key, acc in a.hessians.items():
        # the same rows summed in another order (and batched matmuls): equal up to fp32 rounding
        scale = float(acc.xtx.abs().max())
        torch.testing.assert_close(b.hessians[key].xtx, acc.xtx, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("kv_hessian", ["block", "block+context"])
def test_batched_capture_same_hessian_rows(tiny_target, kv_hessian, layers):
    # the Hessians see the drafter's inner activations: a wrong mask shows here even where a random drafter's
    # drafts are rejected either way
    drafter = _drafter(**layers)
    prompts = _prompts(7, seed=5)
    stops = [_sequential(drafter, tiny_target, prompts[:1], 20)[0].tokens[6]]
    one = _capture(drafter, tiny_target, prompts, 1, kv_hessian=kv_hessian, stops=stops)
    many = _capture(drafter, tiny_target, prompts, 4, kv_hessian=kv_hessian, stops=stops)
    _same_hessians(one, many)


def test_batched_capture_dflash2_extras(tiny_target):
    drafter = _drafter(v2=True)
    extra = ("layers.0.attention_conv.kernel_projection", "candidate_selector.hidden_projection")
    prompts = _prompts(5, seed=6)
    one = _capture(drafter, tiny_target, prompts, 1, extra=extra)
    many = _capture(drafter, tiny_target, prompts, 5, extra=extra)
    assert set(extra) <= set(many.hessians)
    _same_hessians(one, many)


def test_batched_capture_checkpoints_where_sequential_does(tiny_target):
    drafter = _drafter()
    prompts = _prompts(8, seed=8)
    seen = {1: [], 3: []}
    for batch in seen:
        _capture(
            drafter,
            tiny_target,
            prompts,
            batch,
            checkpoint=lambda s, b=batch: seen[b].append(s.done),
            checkpoint_every=3,
        )
    assert seen[3] == seen[1] == [3, 6]


def test_batched_capture_replay_and_hybrid_fall_back(tiny_target):
    drafter = _drafter()
    prompts = _prompts(3, seed=1)
    kept = _capture(drafter, tiny_target, prompts, 3, keep_replay=True)
    assert kept.replay is not None and [len(r) for r in kept.replay] == [
        len(r.acceptance_lengths) for r in _sequential(drafter, tiny_target, prompts, 20)
    ]
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(hybrid_target_config()).eval()
    _same_hessians(_capture(drafter, hybrid, prompts, 1), _capture(drafter, hybrid, prompts, 3))


def test_batched_capture_reference_pair_and_predicted_peak():
    from dflash_quant.calibration.peak import predict_run
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target

    d, t = load_drafter("reference"), load_target("reference:target")
    ids = encode_prompts(t, "reference:calib", 6, True)
    one = _capture(d.model, t.model, ids, 1, max_new=48, stops=stop_tokens(t), kv_hessian="block+context")
    many = _capture(
        d.model, t.model, ids, 6, max_new=48, stops=stop_tokens(t), kv_hessian="block+context", measure=True
    )
    _same_hessians(one, many)
    cpu = torch.device("cpu")
    pred, comparable = predict_run(
        t.model, d.model, t.source.path, d.raw_config, ids, 48, torch.float32, "block+context", cpu, cpu, rows=6
    )
    assert abs(many.memory["measured_bytes"] / comparable - 1) < 0.05, (many.memory, pred.terms)


# ------------------------------------------------------------------------------------------ pipeline


@pytest.mark.slow
def test_gptq_batched_check_and_calibration_match_one_by_one(tmp_path):
    """A whole `gptq` on the reference pair with batches (the CPU default) and one by one: same calibration
    rows and bf16 check, the record says what ran batched, and the check cache keys the two apart."""
    import json

    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq

    def run(name, check_batch, calib_batch):
        out = tmp_path / name
        job = GptqJob(
            output=out,
            calib_num_prompts=7,
            calib_max_new_tokens=24,
            eval_num_prompts=9,
            eval_max_new_tokens=32,
            device="cpu",
            check_cache=tmp_path / "check",
            check_batch=check_batch,
            calib_batch=calib_batch,
        )
        run_gptq(job)
        parity = json.loads((out / "parity.json").read_text())
        calibration = json.loads((out / "provenance.json").read_text())["calibration"]
        return parity, calibration

    one, cal_one = run("one", 1, 1)
    many, cal_many = run("many", None, None)  # CPU default: 16 rows (here all 7 calibration / 5 checked prompts)
    assert cal_many["batch_rows"] == 7 and "batch_rows" not in cal_one
    assert cal_many["rows"] == cal_one["rows"] and cal_many["steps"] == cal_one["steps"]
    assert cal_many["mean_tau_bf16"] == cal_one["mean_tau_bf16"]
    assert 0.95 < cal_many["memory"]["ratio"] < 1.05  # the predicted peak counts the rows
    b1, b16 = one["baseline"], many["baseline"]
    assert many["cache"]["bf16_drafter"] == "miss"  # a batched bf16 run is not the one-by-one run's entry
    for key in ("tau", "per_position_acceptance", "acceptance_histogram", "lossless", "steps", "per_prompt"):
        assert b16[key] == b1[key], key
    assert b16["lossless"] is True and many["quantized"]["lossless"] is True
    assert (b16["spec_timed_prompts"], b16["spec_batch"], b16["spec_batched_prompts"]) == (4, 5, 5)
    assert "spec_batch" not in b1
    card = (tmp_path / "many" / "README.md").read_text()
    assert "timed on the first 4 prompts" in card and "batches of up to 5 prompts" in card
    assert "timed on the first" not in (tmp_path / "one" / "README.md").read_text()


def test_batch_defaults_and_fallbacks(tiny_target):
    from types import SimpleNamespace

    from dflash_quant.pipeline.batching import CPU_BATCH, calib_rows, default_batch

    assert default_batch(None, torch.device("cpu")) == CPU_BATCH == 16
    assert default_batch(None, torch.device("cuda")) == 1 and default_batch(3, torch.device("cuda")) == 3
    drafter = SimpleNamespace(model=_drafter())
    job = SimpleNamespace(
        calib_batch=None, calib_max_new_tokens=8, quant=SimpleNamespace(sequential=False), teacher_forced=False
    )
    forty, five = [[1, 2, 3]] * 40, [[1, 2, 3]] * 5
    assert calib_rows(job, drafter, SimpleNamespace(model=tiny_target), forty) == 16
    assert calib_rows(job, drafter, SimpleNamespace(model=tiny_target), five) == 5
    job.quant.sequential = True  # replays per-prompt drafter calls: one by one
    assert calib_rows(job, drafter, SimpleNamespace(model=tiny_target), forty) == 1
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(hybrid_target_config()).eval()
    job.quant.sequential = False
    assert calib_rows(job, drafter, SimpleNamespace(model=hybrid), forty) == 1
    job.teacher_forced = True  # the teacher decodes any target's prompts as rows, --sequential's too
    assert calib_rows(job, drafter, SimpleNamespace(model=hybrid), forty) == 16
    job.quant.sequential = True
    assert calib_rows(job, drafter, SimpleNamespace(model=hybrid), five) == 5


def test_gpu_rows_fit_in_memory():
    import json
    from types import SimpleNamespace

    from dflash_quant.pipeline.batching import GPU_BATCH, row_bytes, rows_that_fit
    from dflash_quant.reference import pair_dir

    gib = 1 << 30
    assert rows_that_fit(64, gib // 64, 4 * gib) == 64  # 1 GiB of rows in 2 GiB allowed
    assert rows_that_fit(64, gib, 20 * gib) == 8  # 8 GiB <= 10 GiB, 16 GiB is not
    assert rows_that_fit(64, 40 * gib, 20 * gib) == 1  # one row always (one request is what a user runs)
    # the predicted bytes of a row grow with the prompt and the new tokens, as the batch's caches do
    ref = pair_dir("reference")
    target = SimpleNamespace(source=SimpleNamespace(path=ref / "target"))
    drafter = SimpleNamespace(model=_drafter(), raw_config=json.loads((ref / "drafter" / "config.json").read_text()))
    short, long = row_bytes(target, drafter, [[1] * 64], 64), row_bytes(target, drafter, [[1] * 1024], 64)
    assert 0 < short < long and row_bytes(target, drafter, [[1] * 64], 512) > short
    # the reference pair's whole check fits GPU_BATCH rows in a small share of any GPU
    assert rows_that_fit(GPU_BATCH, short, 8 * gib) == GPU_BATCH


def test_cuda_attention_backends(monkeypatch):
    import torch.backends.cuda as tbc

    from dflash_quant.errors import UsageError
    from dflash_quant.loading.runtime import SDPA_ENV, _cuda_attention

    saved = (tbc.flash_sdp_enabled(), tbc.mem_efficient_sdp_enabled(), tbc.math_sdp_enabled(), tbc.cudnn_sdp_enabled())
    try:
        monkeypatch.delenv(SDPA_ENV, raising=False)
        _cuda_attention()  # default: cuDNN's per-shape plans off, the rest on
        assert (tbc.flash_sdp_enabled(), tbc.mem_efficient_sdp_enabled(), tbc.math_sdp_enabled()) == (True, True, True)
        assert not tbc.cudnn_sdp_enabled()
        monkeypatch.setenv(SDPA_ENV, "math, cudnn")
        _cuda_attention()
        assert (tbc.flash_sdp_enabled(), tbc.math_sdp_enabled(), tbc.cudnn_sdp_enabled()) == (False, True, True)
        for bad in ("flash,fast", " , "):
            monkeypatch.setenv(SDPA_ENV, bad)
            with pytest.raises(UsageError, match=f"{SDPA_ENV}=.* must list some of flash, efficient, math, cudnn"):
                _cuda_attention()
    finally:
        tbc.enable_flash_sdp(saved[0])
        tbc.enable_mem_efficient_sdp(saved[1])
        tbc.enable_math_sdp(saved[2])
        tbc.enable_cudnn_sdp(saved[3])


def test_check_rows_on_cuda(monkeypatch):
    from dflash_quant.pipeline.batching import CPU_BATCH, GPU_BATCH, check_rows

    gib = 1 << 30
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)  # no cap
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    small, huge = (lambda: gib // 100), (lambda: 100 * gib)
    assert check_rows(None, cpu, torch.float32, small) == CPU_BATCH
    # bf16/fp16 on CUDA: one by one (batched half-precision numerics widen the tau ratio's spread) unless asked
    assert check_rows(None, cuda, torch.bfloat16, small) == 1 and check_rows(None, cuda, torch.float16, small) == 1
    assert check_rows(8, cuda, torch.bfloat16, small) == 8
    # fp32 on CUDA: GPU_BATCH rows, fewer when they would not fit in half the free memory
    assert check_rows(None, cuda, torch.float32, small) == GPU_BATCH
    assert check_rows(None, cuda, torch.float32, huge) == 1
    # under --gpu-memory-limit (22 of 141 GiB, 20 held): rows fit half of the 2 GiB the cap leaves, not of 80
    tenth = lambda: gib // 10  # noqa: E731
    assert check_rows(None, cuda, torch.float32, tenth) == GPU_BATCH
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 22 / 141)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * gib)
    assert check_rows(None, cuda, torch.float32, tenth) == 8
