"""Mixed precision end to end (#12): the tau map, per-Linear GPTQ, the `dynamic` export read back by verify,
compressed-tensors config groups, and `gptq --max-bytes/--max-tau-loss` on a tiny pair."""

import json
import random
import subprocess
import sys

import pytest
import torch
from tiny import save_drafter, save_pair_with_prompts

from dflash_quant.errors import UsageError
from dflash_quant.export.gptq_dynamic import layer_setting
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.quantize import mixed_plan as mp
from dflash_quant.quantize.drafter import quantize_drafter
from dflash_quant.quantize.mixed import Candidate, coded_bits_per_weight, min_bytes
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.settings import QuantSettings
from dflash_quant.quantize.spec import QuantSpec

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]


def test_tau_map_is_a_least_squares_line_through_the_origin():
    points = [{"loss": 1.0, "tau_loss": 0.2}, {"loss": 0.2, "tau_loss": 0.05}, {"loss": 0.01, "tau_loss": -0.01}]
    a = (1.0 * 0.2 + 0.2 * 0.05 + 0.01 * -0.01) / (1.0 + 0.04 + 0.0001)
    assert mp.slope(points) == pytest.approx(a)
    assert mp.loss_budget(points, 0.01) == pytest.approx(0.01 / a)
    assert mp.predict_tau_loss(points, 0.5) == pytest.approx(0.5 * a)
    # no measured loss at all: every measured loss is allowed, nothing more
    flat = [{"loss": 0.3, "tau_loss": 0.0}, {"loss": 0.1, "tau_loss": -0.01}]
    assert mp.loss_budget(flat, 0.01) == 0.3
    assert mp.predict_tau_loss(flat, 10.0) == 0.0


def _grids(cands):
    return list(dict.fromkeys(c.grid for c in cands))


def test_candidates_follow_the_widths():
    every = [Candidate(b, g) for b in (2, 3, 4, 8) for g in (32, 64, 128, -1)]
    assert _grids(mp.candidates_for([(256, 512), (512, 256)])) == every
    assert _grids(mp.candidates_for([(64, 64)])) == [Candidate(b, g) for b in (2, 3, 4, 8) for g in (32, 64, -1)]
    assert _grids(mp.candidates_for([(96, 96)])) == [Candidate(b, g) for b in (2, 3, 4, 8) for g in (32, -1)]
    assert _grids(mp.candidates_for([(40, 40)])) == [Candidate(4, -1), Candidate(8, -1)]  # 40*2, 40*3: no words
    # every grid is offered with each solver: plain, act-order (static groups), clip search, both
    full = mp.candidates_for([(256, 512), (512, 256)])
    assert len(full) == 4 * len(every)
    assert {(c.act, c.clip) for c in full if c.grid == Candidate(3, 128)} == set(mp.SOLVERS)
    # the tau map measures the default group, else the largest that fits, else per channel: each width plain,
    # and below 8 bits also act-order + clip (the map is fitted across the solvers the search mixes)
    tuned = [Candidate(b, 128, True, True) for b in (2, 3, 4)]
    assert mp.tau_points(full) == [Candidate(b, 128) for b in (2, 3, 4, 8)] + tuned
    assert mp.tau_points(mp.candidates_for([(40, 40)])) == [
        Candidate(4, -1),
        Candidate(8, -1),
        Candidate(4, -1, True, True),
    ]
    assert _grids(mp.tau_points(mp.candidates_for([(64, 64)]))) == [Candidate(b, 64) for b in (2, 3, 4, 8)]
    assert mp.fmt_cand(Candidate(3, 64, True, True)) == "3/64+act+clip"
    assert mp.fmt_cand(Candidate(3, -1, False, True)) == "3/-1+clip"


def _curve(per_setting: dict[str, tuple[float, list[float]]], base: list[float], steps: int = 100) -> dict:
    """A tau map with per-prompt data: `base` and each setting's tau per prompt, `steps` steps per prompt."""

    def per(taus):
        return {"tokens": [round(t * steps) for t in taus], "steps": [steps] * len(taus)}

    points = []
    for setting, (loss, taus) in per_setting.items():
        t, t0 = sum(taus) / len(taus), sum(base) / len(base)
        points.append({"setting": setting, "loss": loss, "tau_loss": 1 - t / t0, "per_prompt": per(taus)})
    return {"tau_bf16": sum(base) / len(base), "per_prompt": per(base), "points": points}


def test_slope_bounds_bracket_the_fit_and_close_without_noise():
    rng = random.Random(1)
    base = [rng.randint(4, 10) / 2 for _ in range(40)]  # x 100 steps: whole token counts at 0.8 and 0.98
    # every prompt loses the same fraction: resampling prompts cannot move the slope
    exact = _curve({"2/128": (1.0, [t * 0.8 for t in base]), "4/128": (0.1, [t * 0.98 for t in base])}, base)
    lo, hi = mp.slope_bounds(exact)
    assert lo == pytest.approx(mp.slope(exact["points"]), abs=1e-9) == pytest.approx(hi, abs=1e-9)
    # prompts lose different fractions: the bounds open around the fitted slope, wider with more spread
    noisy = {s: (loss, [t * (1 - f + rng.gauss(0, 0.05)) for t in base]) for s, (loss, f) in
             {"2/128": (1.0, 0.2), "4/128": (0.1, 0.02)}.items()}  # fmt: skip
    curve = _curve(noisy, base)
    lo, hi = mp.slope_bounds(curve)
    assert lo < mp.slope(curve["points"]) < hi
    wider = _curve({s: (loss, [t * (1 + 2 * (r / t - 1)) for t, r in zip(base, taus, strict=True)]) for s, (loss, taus) in
                    noisy.items()}, base)  # fmt: skip
    wlo, whi = mp.slope_bounds(wider)
    assert whi - wlo > hi - lo
    # a map cached without per-prompt data has no bounds
    assert (
        mp.slope_bounds({"points": [{k: v for k, v in p.items() if k != "per_prompt"} for p in curve["points"]]})
        is None
    )


def test_cached_tau_map_keeps_the_per_prompt_data_of_its_bounds(tmp_path):
    from dflash_quant.quantize.mixed_table import load_curve, save_curve, save_table

    rng = random.Random(2)
    base = [rng.randint(4, 10) / 2 for _ in range(20)]
    curve = _curve({s: (loss, [t * (1 - f + rng.gauss(0, 0.05)) for t in base]) for s, (loss, f) in
                    {"2/128": (1.0, 0.2), "4/128": (0.1, 0.02)}.items()}, base)  # fmt: skip
    key, ckey = {"drafter": "x"}, {"dev_prompts": 20}
    save_table(tmp_path, {"fc": {Candidate(4, 128): (10, 0.1)}}, key)
    save_curve(tmp_path, key, ckey, curve)
    cached = load_curve(tmp_path, key, ckey)
    assert cached is not None and mp.slope_bounds(cached) == mp.slope_bounds(curve) is not None
    assert load_curve(tmp_path, key, {"dev_prompts": 21}) is None


def test_tau_goal_plans_on_the_upper_slope_above_the_bit_floor():
    points = [{"setting": "2/128", "loss": 1.0, "tau_loss": 0.2}, {"setting": "3/128", "loss": 0.2, "tau_loss": 0.04},
              {"setting": "4/128", "loss": 0.05, "tau_loss": 0.01}, {"setting": "8/128", "loss": 0.001, "tau_loss": 0.0}]  # fmt: skip
    # at the lower slope 0.19, 3-bit (0.038) misses 0.01 and 4-bit (0.0095) keeps it: floor 4
    assert mp.bits_floor(points, 0.01, 0.19) == 4
    assert mp.bits_floor(points, 0.05, 0.19) == 3
    assert mp.bits_floor(points, 1e-6, 0.19) == 8  # none keeps it: the widest
    # two Linears; a 3-bit pick is the cheapest way under the loss budget, but it is below the floor
    c = Candidate
    table = {
        "a": {c(3, 128): (30, 0.001), c(4, -1): (38, 0.02), c(4, 128): (40, 0.01), c(8, 128): (80, 0.0)},
        "b": {c(3, 128): (30, 0.03), c(4, -1): (38, 0.025), c(4, 128): (41, 0.01), c(8, 128): (80, 0.0)},
    }
    choice, budget, floor = mp.plan_tau_loss(table, points, (0.19, 0.25), 0.01)
    assert floor == 4 and budget == pytest.approx(0.01 / 0.25)  # the upper slope sets the budget
    assert choice.picks == {"a": c(4, 128), "b": c(4, -1)}  # loss 0.035 <= 0.04 at 78 bytes
    # without the floor the cheapest mix under that budget is all 3-bit
    assert min_bytes(table, budget).picks == {"a": c(3, 128), "b": c(3, 128)}
    # without bounds (an old cached map) the point slope plays both parts
    _, budget, _ = mp.plan_tau_loss(table, points, None, 0.01)
    assert budget == pytest.approx(0.01 / mp.slope(points))


def test_tuned_solvers_get_their_own_slope():
    rng = random.Random(3)
    base = [rng.randint(4, 10) / 2 for _ in range(40)]
    # plain points lose 0.2 x loss, act+clip points 0.4 x loss (per prompt with noise)
    spec = {"2/128": (1.0, 0.2), "4/128": (0.05, 0.01), "2/128+act+clip": (0.5, 0.2), "4/128+act+clip": (0.03, 0.012)}
    curve = _curve({s: (loss, [t * (1 - f + rng.gauss(0, 0.01)) for t in base]) for s, (loss, f) in spec.items()}, base)
    kinds = mp.kind_slope_bounds(curve)
    assert kinds is not None and set(kinds) == {"plain", "tuned"}
    for k, want in (("plain", 0.2), ("tuned", 0.4)):
        lo, fit, hi = kinds[k]
        assert lo < fit < hi and fit == pytest.approx(want, rel=0.1)
    assert mp.kind("4/-1+clip") == mp.kind(Candidate(4, -1, False, True)) == "tuned" and mp.kind("4/128") == "plain"
    # the tuned Linear looks cheapest by its loss alone; counted at its kind's slope it no longer fits
    c = Candidate
    table = {
        "a": {c(4, -1): (38, 0.03), c(4, -1, True, True): (38, 0.02), c(4, 128): (40, 0.02), c(8, 128): (80, 0.0)},
        "b": {c(4, -1): (38, 0.03), c(4, -1, True, True): (38, 0.02), c(4, 128): (40, 0.02), c(8, 128): (80, 0.0)},
    }
    points = curve["points"]
    shared, _, _ = mp.plan_tau_loss(table, points, (0.2, 0.2), 0.01)
    assert set(shared.picks.values()) == {c(4, -1, True, True)}  # 0.04 loss at 0.2: tau loss 0.008
    per_kind, budget, _ = mp.plan_tau_loss(table, points, (0.2, 0.2), 0.01, kinds)
    assert budget == pytest.approx(0.01 / kinds["plain"][2])
    assert c(4, -1, True, True) not in per_kind.picks.values() and per_kind.total_bytes > shared.total_bytes
    # its total_loss stays the plain sum of the picks' losses; the prediction weighs each by its kind
    assert per_kind.total_loss == pytest.approx(sum(table[n][p][1] for n, p in per_kind.picks.items()))
    fitted = {k: b[1] for k, b in kinds.items()}
    assert mp.mix_tau_loss(table, shared.picks, fitted, 0.2) == pytest.approx(0.04 * fitted["tuned"])
    assert mp.mix_tau_loss(table, per_kind.picks, fitted, 0.2) <= 0.01 + 1e-9
    # a map without per-prompt data has no kinds
    assert mp.kind_slope_bounds({"points": [{k: v for k, v in p.items() if k != "per_prompt"} for p in points]}) is None


def test_kl_line_takes_its_floor_from_the_tuned_points_and_fits_above_it():
    """gptq-kl: tuning recovers nearly all of a 3/4-bit loss and only part of a 2-bit one. The floor comes from
    each tuned point's own measured tau loss (lower bound), and the slope is fitted on the points at or above it:
    a line through the 2-bit point would keep the plan at 4 bits."""
    rng = random.Random(5)
    base = [rng.randint(4, 10) / 2 for _ in range(200)]
    spec = {"2/128+act+clip+kl": (0.8, 0.12), "3/128+act+clip+kl": (0.16, 0.005), "4/128+act+clip+kl": (0.04, 0.0)}
    curve = _curve({s: (loss, [t * (1 - f + rng.gauss(0, 0.01)) for t in base]) for s, (loss, f) in spec.items()}, base)
    pts = curve["points"]
    own = mp.point_bounds(curve, pts)
    assert own is not None
    for p in pts:  # each bound brackets the point's measured tau loss
        lo, hi = own[p["setting"]]
        assert lo < p["tau_loss"] < hi
    got = mp.kl_line(curve, pts, 0.01)
    assert got is not None
    floor, used, (lo, fit, hi) = got.floor, got.points, got.slopes
    assert got.point_bounds == own  # the bounds the floor was read from
    assert floor == 3 and [p["setting"] for p in used] == list(spec)[1:]
    assert lo < fit < hi and fit == pytest.approx(mp.slope(used)) and fit < mp.slope(pts) / 3
    # the 3-bit point is shown to miss a tighter goal: floor 4, fitted on the 4-bit point alone
    tight = mp.kl_line(curve, pts, 0.002)
    assert tight is not None and tight.floor == 4 and len(tight.points) == 1
    # the plan takes the floor given, not the one the line's lower slope would set
    c = Candidate
    table = {n: {c(3, 128): (30, 0.028), c(4, 128): (40, 0.02)} for n in ("a", "b")}
    choice, budget, got_floor = mp.plan_tau_loss(table, pts, (0.1, 0.2), 0.01, floor=3)
    assert got_floor == 3 and budget == pytest.approx(0.05) and choice.total_bytes == 70
    assert mp.plan_tau_loss(table, pts, (0.1, 0.2), 0.01)[2] == 4  # 0.1 x 0.16 misses 0.01
    assert mp.kl_line({"points": [{k: v for k, v in p.items() if k != "per_prompt"} for p in pts]}, pts, 0.01) is None
    # 200 prompts resolve a 1 % goal; 8 noisy ones do not, and the plan says so and how to fix it
    assert got.resolution_note(0.01) is None
    few = base[:8]
    noisy = _curve({s: (loss, [t * (1 - f + rng.gauss(0, 0.08)) for t in few]) for s, (loss, f) in spec.items()}, few)
    noisy_line = mp.kl_line(noisy, noisy["points"], 0.01)
    assert noisy_line is not None
    note = noisy_line.resolution_note(0.01)
    assert note is not None and "8 dev prompts" in note and "4/128+act+clip+kl" in note
    assert "--mix-dev-prompts 128" in note


def test_the_card_carries_the_plans_caveat():
    """A plan's notes (dev prompts too coarse for the goal) reach the card, not only stderr."""
    from pathlib import Path

    from dflash_quant.model_cards.sections import section_mixed

    results = Path(__file__).resolve().parents[1] / "benchmarks/results/mixed_kl_floor_reference.json"
    mix = json.loads(results.read_text())["mixed"]
    assert "Note:" not in section_mixed({"provenance": {"mixed": mix}, "parity": None})
    note = "the 32 dev prompts measure tau to +-0.022 (uniform 4/128+act+clip+kl), coarser than --max-tau-loss 0.01"
    assert f"Note: {note}." in section_mixed({"provenance": {"mixed": {**mix, "notes": [note]}}, "parity": None})


def test_goal_flags_are_exclusive_and_checked():
    for goal, msg in [
        (mp.MixedGoal(max_tau_loss=0.01, max_bytes=10), "exclusive"),
        (mp.MixedGoal(max_tau_loss=1.0), r"in \(0, 1\)"),
        (mp.MixedGoal(fit_gpu="rtx4090"), "needs --context"),
        (mp.MixedGoal(max_bytes=10, context=10), "only apply with --fit"),
        (mp.MixedGoal(max_bytes=10, max_bits_per_weight=3.25), "exclusive"),
        (mp.MixedGoal(max_bits_per_weight=0.5), r"in \(1, 16\]"),
    ]:
        with pytest.raises(UsageError, match=msg):
            goal.check()


def test_picks_quantize_each_linear_on_its_own_grid(tmp_path):
    drafter = load_drafter(save_drafter(tmp_path / "d", std=0.2), device="cpu", dtype=torch.float32)
    names = drafter.model.linear_names()
    picks = {n: [(2, 32), (3, 32), (8, -1), (4, 64)][i % 4] for i, n in enumerate(names)}
    source = {n: drafter.model.get_submodule(n).weight.detach().clone() for n in names}
    outcome = quantize_drafter(drafter.model, None, QuantSettings(method="rtn", group_size=32), picks=picks)
    assert [e["name"] for e in outcome.layers] == [n for n in names]  # execution order kept across the split
    for entry in outcome.layers:
        bits, group = picks[entry["name"]]
        assert (entry["bits"], entry["group_size"]) == (bits, group)
        want = rtn_quantize(source[entry["name"]], QuantSpec(bits, group)).dequantize()
        assert torch.equal(drafter.model.get_submodule(entry["name"]).weight, want)


def test_layer_setting_reads_dynamic_first_match():
    qcfg = {"bits": 4, "group_size": 128, "dynamic": {r"+:^a\.q$": {"bits": 2}, r"+:^a\..*$": {"group_size": 32}}}
    assert layer_setting(qcfg, "a.q") == (2, 128)
    assert layer_setting(qcfg, "a.k") == (4, 32)
    assert layer_setting(qcfg, "b.k") == (4, 128)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair_with_prompts(tmp_path_factory.mktemp("mixed"))


def gptq(pair, out, *extra):
    args = [
        "gptq", str(pair["drafter"]), "--target", str(pair["target"]), "--calib-prompts", str(pair["root"] / "calib.txt"),
        "--eval-prompts", str(pair["root"] / "eval.txt"), "--max-new-tokens", "16", "--eval-max-new-tokens", "12",
        "--mix-dev-prompts", "4", "--mix-dev-new-tokens", "12", "--no-check-cache", "-o", str(pair["root"] / out),
        "--calib-cache", str(pair["root"] / "calib"), "--json", *extra,
    ]  # fmt: skip
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_gptq_max_bytes_writes_a_mix_that_verify_and_export_load(pair, tmp_path):
    from safetensors.torch import load_file

    # uniform 3-bit as the budget, as in the README measurement
    u3 = gptq(pair, "u3", "--bits", "3", "--group-size", "32")
    assert u3.returncode == 0, u3.stderr
    budget = json.loads(u3.stdout)["quant_report"]["drafter_bytes_quantized"]
    r = gptq(pair, "mix", "--max-bytes", str(budget))
    assert r.returncode == 0, r.stderr
    art = pair["root"] / "mix"
    prov = json.loads((art / "provenance.json").read_text())["mixed"]
    report = json.loads((art / "quant_report.json").read_text())
    assert report["drafter_bytes_quantized"] <= budget
    assert prov["predicted_bytes"] == report["quantized_bytes"]  # the byte formula is the written size
    picked = {e["name"]: f"{e['bits']}/{e['group_size']}" for e in report["layers"]}
    # a pick is its grid plus how GPTQ solved it (+act, +clip); the layers report the grid
    assert picked == {n: s.split("+")[0] for n, s in prov["picks"].items()} and len(set(picked.values())) > 1
    # the tau map: uniform 2/3/4/8 (and 2/3/4 act-order + clip) at the largest group of the tiny widths (64),
    # measured on the dev prompts
    # (a random tiny drafter accepts ~nothing: tau ~1)
    tuned = ["2/64+act+clip", "3/64+act+clip", "4/64+act+clip"]  # the map spans the solvers the search mixes
    assert [p["setting"] for p in prov["tau_calibration"]] == ["2/64", "3/64", "4/64", "8/64", *tuned]
    assert all(p["tau"] >= 1 and p["tau_bf16"] >= 1 for p in prov["tau_calibration"])
    # GPTQ v1 `dynamic`: every Linear's setting read back with vLLM's first-match rule decodes its tensors
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["dynamic"] and qcfg["dflash_quant"]["mixed"] is True
    for name, setting in picked.items():
        assert "/".join(map(str, layer_setting(qcfg, name))) == setting
    loaded = load_drafter(art, device="cpu", dtype=torch.float32)  # what verify loads
    tensors = load_file(art / "model.safetensors")
    from dflash_quant.io.gptq_v1 import unpack_gptq_v1

    for name, setting in picked.items():
        bits, group = map(int, setting.split("/"))
        parts = {p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        assert torch.equal(loaded.model.get_submodule(name).weight, unpack_gptq_v1(parts, bits, group))
    # compressed-tensors: one config group per setting, read back to the same weights
    ct = tmp_path / "ct"
    e = subprocess.run(
        [*CLI, "export", str(art), "--format", "compressed-tensors", "-o", str(ct)], capture_output=True, text=True
    )
    assert e.returncode == 0, e.stderr
    qcfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    groups = qcfg["config_groups"]
    assert len(groups) == len(set(picked.values()))
    # the consumer's own reading: the library parses the config, and its matcher puts each Linear in one group
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    parsed = QuantizationConfig.model_validate(qcfg)
    tensor_names = {
        k[: -len(".weight_packed")] for k in load_file(str(ct / "model.safetensors")) if k.endswith("_packed")
    }
    assert len(tensor_names) == len(picked)
    for module in tensor_names:
        hits = [g for g in parsed.config_groups.values() if any(match_name(module, t) for t in g.targets)]
        assert len(hits) == 1, (module, [g.targets for g in hits])
        short = next(n for n in picked if module.endswith(n))
        w = hits[0].weights
        group = -1 if str(getattr(w.strategy, "value", w.strategy)) == "channel" else w.group_size  # per channel
        assert f"{w.num_bits}/{group}" == picked[short], module
    again = load_drafter(ct, device="cpu", dtype=torch.float32)
    for name in picked:
        torch.testing.assert_close(again.model.get_submodule(name).weight, loaded.model.get_submodule(name).weight)
    # GGUF holds one setting: refused in one line, naming the nearest uniform setting
    g = subprocess.run(
        [*CLI, "export", str(art), "--format", "gguf", "-o", str(tmp_path / "g")], capture_output=True, text=True
    )
    assert g.returncode == 2 and "per-Linear mixed-precision" in g.stderr and "nearest" in g.stderr
    # the card names the picks and the engines that cannot load the mix
    card = (art / "README.md").read_text()
    assert "Mixed precision" in card and prov["nearest_uniform"] in card
    assert f"{prov['bits_per_weight']:.3f} bits per weight without g_idx" in card


@pytest.mark.slow
def test_gptq_max_tau_loss_plans_on_the_cached_maps_bounds(pair):
    """--max-tau-loss after another goal on the same --calib-cache: the map comes from the cache with its
    per-prompt data, so the plan has its bootstrap bounds, and the record is consistent with the picks."""
    first = gptq(pair, "mix-first", "--max-bytes", "10MB", "--no-verify", "--no-card")
    assert first.returncode == 0, first.stderr
    cached = json.loads((pair["root"] / "calib" / "sensitivity.json").read_text())["tau_calibration"]
    assert len(cached["per_prompt"]["tokens"]) == 4 and all(
        len(p["per_prompt"]["steps"]) == 4 for p in cached["points"]
    )
    r = gptq(pair, "mix-tau", "--max-tau-loss", "0.05")  # reads that map
    assert r.returncode == 0, r.stderr
    art = pair["root"] / "mix-tau"
    prov = json.loads((art / "provenance.json").read_text())["mixed"]
    lo, hi = prov["slope_bounds"]
    slope = prov["tau_calibration"][0]["slope"]
    assert lo <= slope <= hi
    assert prov["loss_budget"] >= prov["predicted_loss"]
    assert all(int(s.split("/")[0]) >= prov["bits_floor"] for s in prov["picks"].values())
    assert prov["predicted_tau_ratio_low"] <= prov["predicted_tau_ratio"]
    card = (art / "README.md").read_text()
    assert f"no Linear below {prov['bits_floor']} bits" in card and "with the slope's upper bound" in card
    # a bits-per-weight budget on the same cache: between uniform 3- and 4-bit at group 64 the pick mixes widths
    r = gptq(pair, "mix-bpw", "--max-bits-per-weight", "3.5", "--no-verify", "--no-card")
    assert r.returncode == 0, r.stderr
    art = pair["root"] / "mix-bpw"
    prov = json.loads((art / "provenance.json").read_text())["mixed"]
    report = json.loads((art / "quant_report.json").read_text())
    shapes = [tuple(e["shape"]) for e in report["layers"]]
    assert prov["goal"] == "max_bits_per_weight" and prov["predicted_bytes"] == report["quantized_bytes"]
    assert prov["bits_per_weight"] == pytest.approx(coded_bits_per_weight(shapes, report["quantized_bytes"]), abs=1e-4)
    assert 3.0 < prov["bits_per_weight"] <= 3.5
    assert {int(s.split("/")[0]) for s in prov["picks"].values()} >= {4}  # wider Linears where the budget allows
    r = gptq(pair, "mix-bpw-low", "--max-bits-per-weight", "1.5", "--no-verify", "--no-card")
    assert r.returncode == 2 and "--max-bits-per-weight 1.5 is below the smallest mix" in r.stderr
    assert not (pair["root"] / "mix-bpw-low").exists()


@pytest.mark.slow
def test_gptq_kl_mix_plans_on_the_tuned_drafters_line(pair):
    """--method gptq-kl with --max-tau-loss: the map also measures the act-order + clip uniform drafters after the
    tuning (tuned on the calibration prompts after the dev ones), and the plan counts every Linear on that line."""
    r = gptq(pair, "mix-kl", "--method", "gptq-kl", "--max-tau-loss", "0.05", "--tune-epochs", "1")
    assert r.returncode == 0, r.stderr
    art = pair["root"] / "mix-kl"
    prov = json.loads((art / "provenance.json").read_text())["mixed"]
    settings = [p["setting"] for p in prov["tau_calibration"]]
    kl = ["2/64+act+clip+kl", "3/64+act+clip+kl", "4/64+act+clip+kl"]
    assert settings[-3:] == kl and mp.kind(kl[0]) == "kl"
    # each tuned point sits at the loss of the grid it started from, beside that grid's untuned point
    by = {p["setting"]: p for p in prov["tau_calibration"]}
    for s in kl:
        assert by[s]["loss"] == by[s[: -len("+kl")]]["loss"]
    lo, fit, hi = prov["solver_slopes"]["kl"]
    assert lo <= fit <= hi
    for s in kl:  # the bounds the floor was read from, each around its point's tau loss
        low, high = by[s]["tau_loss_bounds"]
        assert low <= by[s]["tau_loss"] <= high
    keeps = [int(s.split("/")[0]) for s in kl if by[s]["tau_loss_bounds"][0] <= 0.05]
    assert prov["bits_floor"] == min(keeps, default=4)  # none keeps it: the widest tuned point
    assert all(p["slope"] == pytest.approx(fit, abs=1e-6) for p in prov["tau_calibration"])  # the line planned on
    # the budget from the kl line's upper slope (a line showing no tau loss allows every measured loss)
    want = 0.05 / hi if hi > 0 else max(by[s]["loss"] for s in kl)
    assert prov["loss_budget"] == pytest.approx(want, rel=1e-4)
    assert all(int(s.split("/")[0]) >= prov["bits_floor"] for s in prov["picks"].values())
    report = json.loads((art / "quant_report.json").read_text())
    assert report["tuning"]["steps"] > 0  # the mix itself was tuned after the pick
    # the cached map is keyed by the tuning: a plain GPTQ goal on the same cache measures its own map
    plain = gptq(pair, "mix-plain", "--max-tau-loss", "0.05", "--no-verify", "--no-card")
    assert plain.returncode == 0, plain.stderr
    again = json.loads((pair["root"] / "mix-plain" / "provenance.json").read_text())["mixed"]
    assert not any(p["setting"].endswith("+kl") for p in again["tau_calibration"])
