"""Quantization wall time for a DFlash drafter with Qwen3-8B-DFlash-b16 shapes: our GPTQ vs GPTQModel's.

Times (a) Hessian accumulation over synthetic, correlated calibration rows and (b) GPTQ of all 36 matrices
(fc + 5 layers x q,k,v,o,gate,up,down) at --bits/--group-size; also reports the mean relative output error
||X(W-Wq)^T||^2/||XW^T||^2 of ours, GPTQModel's and round-to-nearest. Weights are random.

  python benchmarks/bench_gptq.py --device cuda --out bench.json
  python benchmarks/bench_gptq.py --device cpu --small --out /tmp/bench.json   # smoke test, < 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.quantize.gptq import (
    gptq_quantize,
    gptq_quantize_shared,  # noqa: E402
    relative_output_error,
)
from dflash_quant.quantize.gptq_batched import gptq_quantize_groups  # noqa: E402
from dflash_quant.quantize.rtn import rtn_quantize
from dflash_quant.quantize.spec import QuantSpec

# GPTQModel 7.x turns on group-aware act-order (GAR) by default; the baseline runs the plain algorithm like ours.
_GPTQMODEL_PLAIN = {"act_group_aware": False}

FULL = dict(hidden=4096, kv=1024, inter=12288, n_ctx_layers=5, layers=5, rows=4096)
SMALL = dict(hidden=128, kv=32, inter=384, n_ctx_layers=5, layers=2, rows=512)
# a quarter of the 8B drafter's width: GPTQModel side by side on a CPU in minutes, not hours
MEDIUM = dict(hidden=1024, kv=256, inter=3072, n_ctx_layers=5, layers=2, rows=2048)


def drafter_matrices(hidden, kv, inter, n_ctx_layers, layers, **_):
    """[(name, out, in, input_group)]; matrices of one input_group see the same calibration rows."""
    mats = [("fc", hidden, hidden * n_ctx_layers, "fc")]
    for i in range(layers):
        p = f"layers.{i}"
        mats += [
            (f"{p}.self_attn.q_proj", hidden, hidden, f"{p}.attn_in"),
            (f"{p}.self_attn.k_proj", kv, hidden, f"{p}.attn_in"),
            (f"{p}.self_attn.v_proj", kv, hidden, f"{p}.attn_in"),
            (f"{p}.self_attn.o_proj", hidden, hidden, f"{p}.o_in"),
            (f"{p}.mlp.gate_proj", inter, hidden, f"{p}.mlp_in"),
            (f"{p}.mlp.up_proj", inter, hidden, f"{p}.mlp_in"),
            (f"{p}.mlp.down_proj", hidden, inter, f"{p}.down_in"),
        ]
    return mats


def calibration(rows, width, seed, device):
    """Correlated, non-isotropic rows: a low-rank shared part, per-channel scales over 2 decades, noise."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rank = min(256, width)
    z = torch.randn(rows, rank, generator=g)
    mix = torch.randn(rank, width, generator=g) / rank**0.5
    scale = torch.logspace(-1, 1, width)[torch.randperm(width, generator=g)]
    x = (z @ mix + 0.2 * torch.randn(rows, width, generator=g)) * scale
    return x.to(device=device, dtype=torch.bfloat16)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def gptqmodel_runner():
    """A per-layer driver for GPTQModel's own GPTQ class, or (None, reason)."""
    try:
        import gptqmodel
        from gptqmodel.quantization.config import QuantizeConfig
        from gptqmodel.quantization.gptq import GPTQ
    except Exception as exc:  # any import failure means: no baseline in this environment
        return None, f"gptqmodel not importable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    def run(weight, x, bits, group_size, damp):
        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        lin.weight.data.copy_(weight)
        cfg = QuantizeConfig(
            bits=bits, group_size=group_size, sym=True, desc_act=False, damp_percent=damp, **_GPTQMODEL_PLAIN
        )
        g = GPTQ(lin, cfg)
        g.quantizer.configure(perchannel=True)
        _, t_acc = timed(lambda: g.add_batch(x.unsqueeze(0), None), weight.device)
        res, t_q = timed(lambda: g.quantize(blocksize=128), weight.device)
        q = res[0].float()
        g.free()
        return q, t_acc, t_q

    return run, f"gptqmodel {gptqmodel.__version__}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test on CPU)")
    ap.add_argument("--medium", action="store_true", help="quarter-width shapes (the CPU side-by-side with GPTQModel)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--rows", type=int, default=None, help="calibration rows per layer (default 4096, small 512)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed repeats (median reported); default 3 small, 2 full"
    )
    ap.add_argument("--no-gptqmodel", action="store_true", help="skip the GPTQModel baseline")
    ap.add_argument(
        "--desc-act",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="act-order (`gptq --desc-act`); the GPTQModel baseline always runs without",
    )
    ap.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="batched solver's column loop: Triton on CUDA when available (auto), or torch",
    )
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    shapes = dict(SMALL if args.small else MEDIUM if args.medium else FULL)
    if args.rows:
        shapes["rows"] = args.rows
    repeats = args.repeats or (3 if args.small or args.medium else 2)
    spec = QuantSpec(args.bits, args.group_size, True)
    mats = drafter_matrices(**shapes)
    groups = sorted({m[3] for m in mats}, key=[m[3] for m in mats].index)
    width = {m[3]: m[2] for m in mats}
    torch.manual_seed(0)
    weights = {name: (torch.randn(out, inn, device=device) * inn**-0.5) for name, out, inn, _ in mats}
    calib = {grp: calibration(shapes["rows"], width[grp], seed, device) for seed, grp in enumerate(groups)}

    # Warm-up: cuBLAS/cuSOLVER handles and allocator, on one small problem.
    w0 = torch.randn(64, 256, device=device)
    a0 = HessianAccumulator(256)
    a0.add(torch.randn(64, 256, device=device))
    gptq_quantize(w0, a0, QuantSpec(args.bits, -1, True))
    # ... and the batched solver's kernels (Triton compiles once per block width and grid settings).
    a1 = HessianAccumulator(512)
    a1.add(torch.randn(600, 512, device=device))
    for grp in (4, 1):
        gptq_quantize_groups(
            [([torch.randn(64, 512, device=device)], a1.hessian(), ["w"])] * grp,
            spec,
            desc_act=args.desc_act,
            damp_percent=args.damp,
            kernel=args.kernel,
        )

    # (a) Hessian accumulation: one accumulator per distinct input (q/k/v and gate/up share theirs).
    acc_times = []
    for _ in range(repeats):

        def accumulate():
            accs = {}
            for grp in groups:
                accs[grp] = HessianAccumulator(width[grp], name=grp)
                accs[grp].add(calib[grp])
            return accs

        accs, t = timed(accumulate, device)
        acc_times.append(t)
    hessians = {grp: accs[grp].hessian() for grp in groups}

    # (b) GPTQ of all matrices.
    q_times, per_matrix, ours = [], {}, {}
    for _ in range(repeats):
        total = 0.0
        for name, _, _, grp in mats:
            qw, t = timed(
                partial(
                    gptq_quantize,
                    weights[name],
                    hessians[grp],
                    spec,
                    desc_act=args.desc_act,
                    damp_percent=args.damp,
                    name=name,
                ),
                device,
            )
            per_matrix[name] = t
            ours[name] = qw
            total += t
        q_times.append(total)
    # (c) What `dflash-quant gptq` runs: Linears sharing an input (q/k/v, gate/up) in one GPTQ pass.
    members = {grp: [m[0] for m in mats if m[3] == grp] for grp in groups}
    shared_times, shared = [], {}
    for _ in range(repeats):

        def quantize_shared():
            for grp in groups:
                qws = gptq_quantize_shared(
                    [weights[n] for n in members[grp]],
                    hessians[grp],
                    spec,
                    names=members[grp],
                    desc_act=args.desc_act,
                    damp_percent=args.damp,
                )
                shared.update(zip(members[grp], qws, strict=True))

        _, t = timed(quantize_shared, device)
        shared_times.append(t)
    # (d) The batched solver (what `gptq` runs now): every shared-input group, same-shape groups as one batch.
    batched_times, batched = [], {}
    for _ in range(repeats):

        def quantize_batched():
            solved = gptq_quantize_groups(
                [([weights[n] for n in members[grp]], hessians[grp], members[grp]) for grp in groups],
                spec,
                desc_act=args.desc_act,
                damp_percent=args.damp,
                kernel=args.kernel,
            )
            for grp, qws in zip(groups, solved, strict=False):
                batched.update(zip(members[grp], qws, strict=False))

        _, t = timed(quantize_batched, device)
        batched_times.append(t)

    def differing(a, b):
        return sum(
            int((a[n].codes != b[n].codes).sum())
            + int((a[n].scales != b[n].scales).sum())
            + int((a[n].zeros != b[n].zeros).sum())
            for n in a
        )

    rtn, t_rtn = timed(lambda: {n: rtn_quantize(weights[n], spec) for n, *_ in mats}, device)

    def mean_err(deq):
        errs = [relative_output_error(weights[n], deq[n], hessians[g]) for n, _, _, g in mats]
        return sum(errs) / len(errs)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": "small" if args.small else "medium (quarter width)" if args.medium else "Qwen3-8B-DFlash-b16",
        "matrices": len(mats),
        "weights": sum(o * i for _, o, i, _ in mats),
        "rows_per_layer": shapes["rows"],
        "bits": args.bits,
        "group_size": args.group_size,
        "damp": args.damp,
        "repeats": repeats,
        "ours": {
            "hessian_s": statistics.median(acc_times),
            "gptq_s": statistics.median(q_times),
            "gptq_runs_s": q_times,
            "slowest_matrices_s": dict(sorted(per_matrix.items(), key=lambda kv: -kv[1])[:5]),
            "rel_output_error_mean": mean_err({n: q.dequantize() for n, q in ours.items()}),
            "fallbacks": [n for n, q in ours.items() if q.fallback],
        },
        "ours_shared_input": {
            "gptq_s": statistics.median(shared_times),
            "gptq_runs_s": shared_times,
            "passes": len(groups),
            "rel_output_error_mean": mean_err({n: q.dequantize() for n, q in shared.items()}),
        },
        "ours_batched": {
            "kernel": args.kernel,
            "gptq_s": statistics.median(batched_times),
            "gptq_runs_s": batched_times,
            "ratio_to_textbook": statistics.median(batched_times) / statistics.median(q_times),
            "ratio_to_shared_input": statistics.median(batched_times) / statistics.median(shared_times),
            "differing_codes_scales_zeros_vs_textbook": differing(batched, ours),
            "differing_codes_scales_zeros_vs_shared_input": differing(batched, shared),
            "rel_output_error_mean": mean_err({n: q.dequantize() for n, q in batched.items()}),
        },
        "desc_act": args.desc_act,
        "rtn": {"seconds": t_rtn, "rel_output_error_mean": mean_err({n: q.dequantize() for n, q in rtn.items()})},
    }

    runner, note = (None, "skipped (--no-gptqmodel)") if args.no_gptqmodel else gptqmodel_runner()
    if runner is None:
        result["gptqmodel"] = {"skipped": note}
    else:
        # GPTQModel has no shared-Hessian API per layer: each matrix accumulates its own from the same rows.
        acc_runs, q_runs, deq = [], [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(repeats):
                ta = tq = 0.0
                for name, _, _, grp in mats:
                    q, a, b = runner(weights[name], calib[grp], args.bits, args.group_size, args.damp)
                    deq[name] = q
                    ta, tq = ta + a, tq + b
                acc_runs.append(ta)
                q_runs.append(tq)
        result["gptqmodel"] = {
            "version": note,
            "hessian_s": statistics.median(acc_runs),
            "gptq_s": statistics.median(q_runs),
            "gptq_runs_s": q_runs,
            "rel_output_error_mean": mean_err(deq),
            "note": "per matrix add_batch (36 Hessians; ours shares 21); fp32 scales (ours rounds to fp16 first)",
        }

    g = result["gptqmodel"]
    print(
        f"{result['matrices']} matrices, {result['weights'] / 1e9:.3f} B weights, {shapes['rows']} rows/layer, "
        f"{args.bits}-bit g{args.group_size}, {result['device']}, torch {result['torch']}, median of {repeats}"
    )
    print(f"{'method':<22}{'hessian s':>12}{'gptq s':>12}{'rel out err':>14}")
    print(
        f"{'dflash-quant':<22}{result['ours']['hessian_s']:>12.3f}{result['ours']['gptq_s']:>12.3f}"
        f"{result['ours']['rel_output_error_mean']:>14.5f}"
    )
    sh = result["ours_shared_input"]
    print(
        f"{'dflash-quant shared':<22}{'-':>12}{sh['gptq_s']:>12.3f}{sh['rel_output_error_mean']:>14.5f}"
        f"   ({sh['passes']} passes; ratio to per-matrix {sh['gptq_s'] / result['ours']['gptq_s']:.3f})"
    )
    bt = result["ours_batched"]
    print(
        f"{'dflash-quant batched':<22}{'-':>12}{bt['gptq_s']:>12.3f}{bt['rel_output_error_mean']:>14.5f}"
        f"   (ratio to textbook {bt['ratio_to_textbook']:.4f}; differing codes/scales/zeros vs textbook "
        f"{bt['differing_codes_scales_zeros_vs_textbook']})"
    )
    if "skipped" in g:
        print(f"{'gptqmodel':<22}  {g['skipped']}")
    else:
        print(
            f"{'gptqmodel':<22}{g['hessian_s']:>12.3f}{g['gptq_s']:>12.3f}{g['rel_output_error_mean']:>14.5f}"
            f"   (batched / gptqmodel {bt['gptq_s'] / g['gptq_s']:.4f})"
        )
        g["ratio_batched_to_gptqmodel"] = bt["gptq_s"] / g["gptq_s"]
    print(
        f"{'round-to-nearest':<22}{'-':>12}{result['rtn']['seconds']:>12.3f}{result['rtn']['rel_output_error_mean']:>14.5f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
