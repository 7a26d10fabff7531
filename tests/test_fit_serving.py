"""`gptq --fit` (#12): the serving settings searched when the given ones leave no room, on the Qwen3.5-27B
preset (budget only: no 27B weights here) and end to end on the tiny pair, with `budget` agreeing."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import save_pair_with_prompts

from dflash_quant.memory import fit as mf
from dflash_quant.memory.budget import compute_budget, required_bytes
from dflash_quant.quantize import mixed_plan as mp
from dflash_quant.quantize.mixed import max_quality, packed_bytes

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
REF_RESULT = Path(__file__).parent.parent / "benchmarks/studies/results/d2_3bit_heldout_gptq_default.json"


def test_tau_at_k_caps_each_step_at_k_plus_one():
    hist = {"1": 2, "2": 1, "4": 1}  # acceptance lengths, bonus token included
    assert mf.tau_at_k(hist, 3) == (1 * 2 + 2 + 4) / 4
    assert mf.tau_at_k(hist, 1) == (1 * 2 + 2 + 2) / 4  # min(L, 2)
    assert mf.tau_at_k(hist, 0) == 1.0
    # = 1 + sum_{i<=K} P(accept >= i): P(>=1) = 2/4, P(>=2) = 1/4, P(>=3) = 1/4
    assert mf.tau_at_k(hist, 3) == 1 + 2 / 4 + 1 / 4 + 1 / 4


def test_candidates_are_in_cost_order_and_keep_given_settings():
    _, _, s = mf.budget_for("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", mf.ServingKnobs())
    cands = mf.candidates(s, mf.ServingKnobs(), has_state=True)
    changed = [c for _, c in cands]
    assert changed[:8] == [
        [], ["no_prefix_caching"], ["kv_fp8"], ["state_bf16"], ["no_prefix_caching", "kv_fp8"],
        ["no_prefix_caching", "state_bf16"], ["kv_fp8", "state_bf16"], ["no_prefix_caching", "kv_fp8", "state_bf16"],
    ]  # fmt: skip
    assert changed[8] == ["spec_tokens 15 -> 14"] and len(cands) == 15 * 8
    # a given setting is never searched: K and the KV dtype fixed, only the state and prefix caching move
    knobs = mf.ServingKnobs(spec_tokens=15, kv_dtype="auto")
    _, _, s2 = mf.budget_for("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", knobs)
    fixed = mf.candidates(s2, knobs, has_state=True)
    assert [c for _, c in fixed] == [[], ["no_prefix_caching"], ["state_bf16"], ["no_prefix_caching", "state_bf16"]]
    assert all(c.spec_tokens == 15 and c.kv_dtype is None for c, _ in fixed)
    assert mf.engine_flags(replace(s, kv_dtype="fp8", state_dtype="bf16", prefix_caching=False, spec_tokens=5)) == [
        """--speculative-config '{"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": 5}'""",
        "--kv-cache-dtype fp8", "--mamba-ssm-cache-dtype bfloat16", "--no-enable-prefix-caching",
    ]  # fmt: skip


def _preset_table():
    """The 27B drafter preset's real Linear shapes with GPTQ v1 bytes per candidate. No weights exist here, so
    the loss per candidate is a stand-in (size x 4^-bits): the budget is what this test checks."""
    _, d, _ = mf.budget_for("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", mf.ServingKnobs())
    shapes = mf.drafter_linear_shapes(d.shape)
    cands = mp.candidates_for(list(shapes.values()))
    table = {n: {c: (packed_bytes(o, i, c), o * i * 4.0**-c.bits) for c in cands} for n, (o, i) in shapes.items()}
    rest = d.bf16_bytes - sum(2 * o * i for o, i in shapes.values())
    return table, cands, rest


def _reference_acceptance_hist() -> dict:
    """Acceptance lengths of the shipped DFlash2 reference pair's bf16 drafter, measured on held-out prompts
    (per-position P(accept >= i) -> counts per length): a real curve for the tau side of this budget test."""
    p = json.loads(REF_RESULT.read_text())["parity"]["baseline"]["per_position_acceptance"]
    hist = mf.hist_from_positions(p)
    assert mf.tau_at_k(hist, len(p)) == pytest.approx(1 + sum(p), abs=1e-3)
    return hist


def test_fit_on_the_27b_preset_picks_settings_the_budget_says_fit():
    """The issue's criterion, budget side: the defaults (K=15, bf16 KV, fp32 state, prefix caching) leave no
    room on a 24 GiB card at 32768 tokens; the search picks settings that do, and `budget` with the same
    settings fits the picked drafter."""
    table, cands, rest = _preset_table()
    least = rest + sum(min(b for b, _ in c.values()) for c in table.values())
    top = sum(max(b for b, _ in c.values()) for c in table.values())
    four = [c for c in mp.tau_points(cands) if c.bits == 4 and not (c.act or c.clip)][0]
    want = rest + mp.uniform_loss(table, four)[0]
    options, given_room = mf.fit_options(
        "qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", mf.ServingKnobs()
    )
    assert given_room < -3 * 2**30  # -3.26 GiB: nothing fits as given
    # tau side: the reference pair's measured uniform ratios (4-bit 0.9962, 3-bit 0.9573, README) placed at this
    # drafter's stand-in losses, and its measured acceptance lengths
    points = [{"loss": mp.uniform_loss(table, c)[1], "tau_loss": 1 - r}
              for c, r in zip([c for c in mp.tau_points(cands) if c.bits in (3, 4) and not (c.act or c.clip)], (0.9573, 0.9962), strict=True)]  # fmt: skip
    hist = _reference_acceptance_hist()

    def predict(o):
        ch = max_quality(table, min(o.room - rest, top))
        return mf.tau_at_k(hist, o.settings.spec_tokens) * (1 - mp.predict_tau_loss(points, ch.total_loss))

    best, scored = mf.choose(options, want, least, predict, "rtx4090", 32768)
    assert best.changed and best.settings.spec_tokens < 15  # the settings as given cannot be kept
    assert all(best_p >= p for best_p in [predict(best)] for _, p in scored)
    choice = max_quality(table, min(best.room - rest, top))
    drafter_bytes = rest + choice.total_bytes
    assert least <= drafter_bytes <= best.room
    t, d, _ = mf.budget_for("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", mf.ServingKnobs())
    b = compute_budget(t, replace(d.as_model("bf16"), weight_bytes=drafter_bytes), best.settings)
    assert b.fits and b.headroom_bytes == best.room - drafter_bytes
    # and per K the cheapest setting was taken: nothing earlier in the cost order at that K leaves `want`
    for o, _ in scored:
        at_k = [x for x in options if x.settings.spec_tokens == o.settings.spec_tokens]
        if o.room >= want:
            assert all(x.room < want for x in at_k if x.rank < o.rank)
        else:
            assert o.room == max(x.room for x in at_k)


def test_budget_cli_agrees_with_the_fit_on_the_27b_preset():
    """`dflash-quant budget` given the flags the fit chose reports the same room (CLI subprocess)."""
    table, cands, rest = _preset_table()
    least = rest + sum(min(b for b, _ in c.values()) for c in table.values())
    options, _ = mf.fit_options("qwen3.5-27b", "qwen3.5-27b-dflash", "rtx4090", 32768, "int4", mf.ServingKnobs())
    best, _ = mf.choose(options, least, least, lambda o: float(o.settings.spec_tokens), "rtx4090", 32768)
    st = mf._settings_dict(best.settings)
    args = ["budget", "--target", "qwen3.5-27b", "--drafter", "qwen3.5-27b-dflash", "--gpu", "rtx4090", "--context",
            "32768", "--target-weights", "int4", "--spec-tokens", str(st["spec_tokens"]), "--kv-dtype", st["kv_dtype"],
            "--state-dtype", st["state_dtype"], "--prefix-caching" if st["prefix_caching"] else "--no-prefix-caching",
            "--json"]  # fmt: skip
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, check=True)
    rep = json.loads(out.stdout)
    b = rep["budgets"]["int4"]
    room = b["usable_bytes"] - (b["required_bytes"] - b["components"]["drafter_weights"])
    assert room == b["drafter_room_bytes"] == best.room >= least
    assert rep["settings"]["prefix_caching"] is st["prefix_caching"]
    # the largest K that leaves room for the smallest mix: one more token does not
    above = [o for o in options if o.settings.spec_tokens == best.settings.spec_tokens + 1]
    assert above and max(o.room for o in above) < least


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair_with_prompts(tmp_path_factory.mktemp("fit"))


@pytest.mark.slow
def test_gptq_fit_cli_changes_the_kv_dtype_and_budget_agrees(pair):
    """A card sized so that the defaults leave no room for the drafter and fp8 KV does: `gptq --fit` picks
    fp8 KV, says so in provenance, the card and on stderr, and `budget` on the artifact fits with
    --kv-dtype fp8 (and the same K) and not without."""
    d, t, root = str(pair["drafter"]), str(pair["target"]), pair["root"]
    tt, dd, s = mf.budget_for(t, d, "24GiB", 4096, None, mf.ServingKnobs())
    req = required_bytes(tt, replace(dd.as_model("bf16"), weight_bytes=0), s, 4096, 1)[0]
    fp8 = required_bytes(tt, replace(dd.as_model("bf16"), weight_bytes=0), replace(s, kv_dtype="fp8"), 4096, 1)[0]
    assert req - fp8 > 3 * dd.bf16_bytes  # fp8 frees more than the whole bf16 drafter
    gpu = str(-(-(req + dd.bf16_bytes - (req - fp8) // 2) * 10 // 9))  # defaults short, fp8 room to spare
    out = root / "out"
    args = [
        "gptq", d, "--target", t, "--calib-prompts", str(root / "calib.txt"), "--eval-prompts", str(root / "eval.txt"),
        "--max-new-tokens", "16", "--eval-max-new-tokens", "12", "--mix-dev-prompts", "4", "--mix-dev-new-tokens",
        "12", "--no-check-cache", "-o", str(out), "--calib-cache", str(root / "calib"), "--json",
        "--fit", gpu, "--context", "4096", "--spec-tokens", "2",
    ]  # fmt: skip
    run = subprocess.run([*CLI, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    fit = json.loads((out / "provenance.json").read_text())["mixed"]["serving"]
    # K given (2, below the drafter's block - 1 = 3): kept; only the KV dtype was free to change
    assert fit["changed"] == ["kv_fp8"] and fit["given_room"] < 0 < fit["drafter_room"]
    assert fit["settings"]["kv_dtype"] == "fp8" and fit["settings"]["spec_tokens"] == 2
    assert "--kv-cache-dtype fp8" in fit["engine_flags"] and '"num_speculative_tokens": 2' in fit["engine_flags"][0]
    assert [o["spec_tokens"] for o in fit["options"]] == [2]
    # tau at K=2 estimated from the full block and measured with a 3-token block (one more decode)
    assert isinstance(fit["tau_bf16_at_k_measured"], float) and fit["tau_bf16_at_k"] <= fit["tau_bf16_full"]
    assert "fit: K=2, changed: kv_fp8" in run.stderr and "--kv-cache-dtype fp8" in run.stderr
    card = (out / "README.md").read_text()
    assert "**Sized for serving**" in card and "--kv-cache-dtype fp8" in card
    json.loads(run.stdout)  # stdout stays one JSON document

    def budget(*extra):
        cmd = ["budget", "--target", t, "--drafter", str(out), "--gpu", gpu, "--context", "4096", "--spec-tokens", "2",
               "--json", *extra]  # fmt: skip
        rep = json.loads(subprocess.run([*CLI, *cmd], capture_output=True, text=True, check=True).stdout)
        return rep["budgets"][rep["drafter"]["quantized_format"]]

    assert budget("--kv-dtype", "fp8")["fits"]
    assert not budget()["fits"]
