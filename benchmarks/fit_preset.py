"""`gptq --fit` on a preset pair, budget side only (no weights): which serving settings leave room, per K.

    python benchmarks/fit_preset.py [--target qwen3.5-27b] [--drafter qwen3.5-27b-dflash] [--gpu rtx4090]
                                    [--context 32768] [--target-weights int4] [--out RESULT.json]

What is measured here is the budget: the room each candidate setting leaves (memory/fit.py, the same code
`gptq --fit` runs) and the room the picked settings leave in `budget`. Without the drafter's weights the tau side
of the choice is not this drafter's: the loss per Linear is a stand-in (size x 4^-bits), the loss -> tau map uses
the reference pair's measured uniform 3/4-bit tau ratios, and tau_K uses the DFlash2 reference pair's measured
bf16 acceptance (benchmarks/studies/results/d2_3bit_heldout_gptq_default.json). A real `gptq --fit` measures both
on the drafter's development prompts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dflash_quant.memory import fit as mf
from dflash_quant.memory.budget import compute_budget
from dflash_quant.quantize import mixed_plan as mp
from dflash_quant.quantize.mixed import max_quality, packed_bytes

REF = Path(__file__).parent / "studies/results/d2_3bit_heldout_gptq_default.json"
REF_RATIOS = {3: 0.9573, 4: 0.9962}  # README "Mixed precision": uniform g128 on the reference pair, held-out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3.5-27b")
    ap.add_argument("--drafter", default="qwen3.5-27b-dflash")
    ap.add_argument("--gpu", default="rtx4090")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--target-weights", default="int4")
    ap.add_argument("--out", default="benchmarks/results/fit_qwen3.5-27b_rtx4090_32768.json")
    a = ap.parse_args()
    knobs = mf.ServingKnobs()
    t, d, s = mf.budget_for(a.target, a.drafter, a.gpu, a.context, a.target_weights, knobs)
    shapes = mf.drafter_linear_shapes(d.shape)
    cands = mp.candidates_for(list(shapes.values()))
    table = {n: {c: (packed_bytes(o, i, c), o * i * 4.0**-c.bits) for c in cands} for n, (o, i) in shapes.items()}
    rest = d.bf16_bytes - sum(2 * o * i for o, i in shapes.values())
    least = rest + sum(min(b for b, _ in c.values()) for c in table.values())
    top = sum(max(b for b, _ in c.values()) for c in table.values())
    u = {c.bits: c for c in mp.tau_points(cands) if not (c.act or c.clip)}  # the plain uniform settings
    want = rest + mp.uniform_loss(table, u[4])[0]
    points = [{"loss": mp.uniform_loss(table, u[b])[1], "tau_loss": 1 - r} for b, r in REF_RATIOS.items()]
    hist = mf.hist_from_positions(json.loads(REF.read_text())["parity"]["baseline"]["per_position_acceptance"])
    options, given_room = mf.fit_options(a.target, a.drafter, a.gpu, a.context, a.target_weights, knobs)

    def predict(o: mf.FitOption) -> float:
        ch = max_quality(table, min(o.room - rest, top))
        return mf.tau_at_k(hist, o.settings.spec_tokens) * (1 - mp.predict_tau_loss(points, ch.total_loss))

    best, scored = mf.choose(options, want, least, predict, a.gpu, a.context)
    pick = max_quality(table, min(best.room - rest, top))
    drafter_bytes = rest + pick.total_bytes
    b = compute_budget(t, replace(d.as_model("bf16"), weight_bytes=drafter_bytes), best.settings)
    rec = mf.choice_record(a.gpu, a.context, a.target_weights, best, given_room, len(options),
                           predicted_tau=round(predict(best), 4),
                           options=[{"spec_tokens": o.settings.spec_tokens, "changed": o.changed, "drafter_room": o.room,
                                     "predicted_tau_stand_in": round(p, 4)} for o, p in scored])  # fmt: skip
    out = {
        "command": f"python benchmarks/fit_preset.py --target {a.target} --drafter {a.drafter} --gpu {a.gpu} "
        f"--context {a.context} --target-weights {a.target_weights}",
        "budget_only": True,
        "stand_ins": "loss per Linear size x 4^-bits; tau map from the reference pair's uniform 3/4-bit ratios; "
        "tau_K from the DFlash2 reference pair's bf16 acceptance",
        "drafter_needs": {"uniform_4bit_bytes": want, "smallest_mix_bytes": least},
        "fit": rec.as_dict(),
        "picked_drafter_bytes": drafter_bytes,
        "picked_bits": sorted({f"{c.bits}/{c.group_size}" for c in pick.picks.values()}),
        "budget_at_pick": {"fits": b.fits, "headroom_bytes": b.headroom_bytes, "components": b.components},
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    gib = 1 << 30
    print(f"given settings: room {given_room / gib:.2f} GiB; picked K={best.settings.spec_tokens} "
          f"{best.changed}: room {best.room / 2**20:.1f} MiB, drafter {drafter_bytes / 2**20:.1f} MiB, "
          f"headroom {b.headroom_bytes / 2**20:.1f} MiB; flags: {' '.join(rec.engine_flags)}")  # fmt: skip
    for o, p in scored:
        print(
            f"  K={o.settings.spec_tokens:2d} room {o.room / 2**20:8.1f} MiB  tau (stand-in) {p:.3f}  {', '.join(o.changed)}"
        )


if __name__ == "__main__":
    main()
