"""The parity check's greedy reference from one teacher-forced forward (decode.target_check,
verify.reference_runs) equals the target-only decode (target_generate, baseline_runs) token for token, and
falls back to that decode, exactly, wherever a candidate is not the target's greedy output."""

import dataclasses

import pytest
import torch
from tiny import save_hybrid_target

from dflash_quant.loading.drafter import load_drafter
from dflash_quant.loading.runtime import default_prompt_spec, encode_prompts, load_pair, stop_tokens
from dflash_quant.loading.target import load_target
from dflash_quant.speculative.decode import GreedyResult, SpecResult, target_check, target_generate
from dflash_quant.speculative.verify import CheckSettings, baseline_runs, reference_runs, spec_runs, summarize


@pytest.fixture(scope="module")
def reference():
    drafter, target = load_pair("reference", None, torch.device("cpu"), torch.float32)
    prompts = encode_prompts(target, default_prompt_spec(target, "heldout"), 6, True, 48)
    settings = CheckSettings(48, 0.0, drafter.config.block_size, 0, stop_tokens(target))
    return drafter.model, target.model, prompts, settings


def _tokens(runs):
    return [r.tokens for r in runs]


def test_reference_equals_target_only_decoding(reference):
    drafter, target, prompts, settings = reference
    spec = spec_runs(drafter, target, prompts, settings)
    decoded = baseline_runs(target, prompts, settings)
    checked = reference_runs(target, prompts, _tokens(spec), settings, timed=2)
    assert _tokens(checked) == _tokens(decoded)
    assert [r.timed for r in checked] == [True, True, False, False, False, False]
    assert [dataclasses.replace(r, seconds=0.0) for r in checked[:2]] == [
        dataclasses.replace(r, seconds=0.0) for r in decoded[:2]
    ]  # the timed prompts are the decode itself
    for c, d in zip(checked[2:], decoded[2:], strict=True):
        assert c.target_forwards == 1 and len(c.margins) == len(c.tokens) == len(d.margins)
        assert max(abs(a - b) for a, b in zip(c.margins, d.margins, strict=True)) < 1e-3
        assert max(abs(a - b) for a, b in zip(c.top1_logits, d.top1_logits, strict=True)) < 1e-3
    # what the parity report computes from the reference: the same either way
    for key in ("tau", "per_position_acceptance", "lossless", "token_match_rate", "per_prompt", "lossless_status"):
        assert summarize("d", spec, checked, settings, 8)[key] == summarize("d", spec, decoded, settings, 8)[key]


def test_stop_tokens_end_the_reference_where_decoding_ends(reference):
    drafter, target, prompts, settings = reference
    ids = torch.tensor([prompts[0]])
    free = target_generate(target, ids, 24, [])
    stop = free.tokens[10]
    first = free.tokens.index(stop)
    stopped = target_generate(target, ids, 24, [stop])
    assert len(stopped.tokens) == first + 1
    checked = target_check(target, ids, stopped.tokens, 24, [stop])
    assert checked is not None and checked.tokens == stopped.tokens
    # a candidate that runs past the stop, or stops short of max_new_tokens without one, is not greedy's output
    assert target_check(target, ids, free.tokens, 24, [stop]) is None
    assert target_check(target, ids, free.tokens[:20], 24, []) is None
    assert target_check(target, ids, [], 24, []) is None


@pytest.mark.parametrize("where", [0, 5, 47])
def test_a_wrong_candidate_falls_back_to_the_exact_decode(reference, where):
    _, target, prompts, settings = reference
    decoded = baseline_runs(target, prompts[:2], settings)
    wrong = _tokens(decoded)
    wrong[1] = list(wrong[1])
    wrong[1][where] = (wrong[1][where] + 1) % 4096
    assert target_check(target, torch.tensor([prompts[1]]), wrong[1], 48, settings.stop_token_ids) is None
    got = reference_runs(target, prompts[:2], wrong, settings, timed=0)
    assert got[0].timed is False and got[0].tokens == decoded[0].tokens
    fallback = dataclasses.replace(got[1], seconds=0.0)
    assert fallback == dataclasses.replace(decoded[1], seconds=0.0)  # the decode itself, every field


def test_disagreeing_timed_decode_redoes_every_prompt(reference, monkeypatch):
    """If a prompt's one-forward check and its one-token decode disagree, no prompt keeps its check."""
    _, target, prompts, settings = reference
    decoded = baseline_runs(target, prompts[:3], settings)
    import dflash_quant.speculative.verify as verify

    real = verify.target_generate

    def skewed(*a, **k):
        r = real(*a, **k)
        return dataclasses.replace(r, tokens=[*r.tokens[:-1], (r.tokens[-1] + 1) % 4096])

    monkeypatch.setattr(verify, "target_generate", skewed)
    got = reference_runs(target, prompts[:3], _tokens(decoded), settings, timed=1)
    assert all(r.timed for r in got) and len(got) == 3


def test_speed_baseline_uses_only_the_decoded_prompts():
    spec = [
        SpecResult(tokens=[1, 2, 3, 4], acceptance_lengths=[4], accepted=[3], drafted=[3], seconds=1.0),
        SpecResult(tokens=[1, 2], acceptance_lengths=[2], accepted=[1], drafted=[3], seconds=1.0),
    ]
    runs = [
        GreedyResult(tokens=[1, 2, 3, 4], seconds=2.0, target_forwards=4),
        GreedyResult(tokens=[1, 2], seconds=0.01, target_forwards=1, timed=False),
    ]
    out = summarize("d", spec, runs, CheckSettings(4, 0.0, 4), 4)
    assert out["baseline_timed_prompts"] == 1
    assert out["baseline_seconds"] == 2.0 and out["baseline_tokens_per_s"] == 2.0
    assert out["speedup"] == 1.5 and out["lossless"] is True  # spec: 6 tokens in 2 s


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrid_target_reference_equals_decoding(tiny_pair, tmp_path, family):
    target = load_target(save_hybrid_target(tmp_path / family, family)).model
    drafter = load_drafter(tiny_pair[0]).model
    prompts = [torch.randint(3, 120, (7,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    settings = CheckSettings(24, 0.0, drafter.block_size, 0, [])
    spec = spec_runs(drafter, target, prompts, settings)
    decoded = baseline_runs(target, prompts, settings)
    checked = reference_runs(target, prompts, _tokens(spec), settings, timed=0)
    assert _tokens(spec) == _tokens(decoded) == _tokens(checked)
    assert not any(r.timed for r in checked)


def test_gptq_parity_report_equals_the_full_baseline_path(tmp_path):
    """`gptq` with the one-forward reference writes the same parity verdict, tau, acceptance and codes as
    `--full-baseline` (every prompt decoded target-only); only timings and the timed-prompt count differ."""
    import json

    from safetensors.torch import load_file

    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq

    reports = {}
    for full in (True, False):
        out = tmp_path / f"full-{full}"
        job = GptqJob(
            output=out,
            calib_num_prompts=3,
            calib_max_new_tokens=16,
            eval_num_prompts=6,
            eval_max_new_tokens=24,
            device="cpu",
            full_baseline=full,
            check_cache=tmp_path / "cache",  # shared: the full baseline's entry must not serve as the reference
            write_card=False,
        )
        run_gptq(job)
        reports[full] = (json.loads((out / "parity.json").read_text()), load_file(out / "model.safetensors"))
    (old, old_codes), (new, new_codes) = reports[True], reports[False]
    assert old_codes.keys() == new_codes.keys()
    assert all(torch.equal(old_codes[k], new_codes[k]) for k in old_codes)
    for key in ("passed", "tau_ratio", "per_position_ratio", "lossless", "lossless_status", "reasons"):
        assert old[key] == new[key], key
    for side in ("baseline", "quantized"):
        for key in ("tau", "per_position_acceptance", "acceptance_histogram", "lossless", "token_match_rate"):
            assert old[side][key] == new[side][key], (side, key)
        assert old[side]["per_prompt"] == new[side]["per_prompt"]
        assert new[side]["baseline_timed_prompts"] == 4 and old[side]["baseline_timed_prompts"] == 6
    assert old["cache"] == {"target_only": "miss", "bf16_drafter": "miss"}
    assert new["cache"] == {"target_only": "miss", "bf16_drafter": "hit"}
