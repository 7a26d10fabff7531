"""int4 drafter kernels on CUDA (issue #16 part 3): one drafter step's GEMMs, and speculative tokens/s.

gemm: the 36 GEMMs of one Qwen3-8B-DFlash-b16 drafter step (fc 4096 x 5*4096; per layer q 4096x4096,
  k/v 1024x4096, o 4096x4096, gate/up 12288x4096, down 4096x12288; 5 layers), distinct random weights per
  layer, at 8 and 16 rows: bf16 (F.linear on the dequantized weights) against each int4 kernel. A `+fused`
  candidate runs k|v and gate|up as one GEMM each, `+qkv` q|k|v and gate|up (Int4QKV, the int4 drafter's runtime);
  `bf16+fused` / `bf16+qkv` are the bf16 baseline with the same fusion, and every candidate is also reported
  against them (vs_bf16+qkv). CUDA events
  around the whole step, warm-up first (autotuning included), candidates in alternating order every repeat,
  median and quartiles reported; once launched eagerly and once replayed from a CUDA graph (launch cost out).
  Each kernel's error against the fp32 dequantized matmul is reported per shape.
e2e: the reference pair's bf16 drafter against its GPTQ int4 artifact, dequantized and through each kernel,
  on cuda/bf16: warm-up each, rounds in alternating order, tokens/s per round (median and spread), and
  whether each kernel's greedy tokens equal the dequantized int4 drafter's.

python benchmarks/gpu_int4.py gemm --out gemm.json; python benchmarks/gpu_int4.py e2e ARTIFACT --out e2e.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_quant.kernels.int4_linear import Int4Codes, Int4Linear, concat_outputs, int4_matmul_error, kernel_problem

H, KV, INTER, CTX_LAYERS, LAYERS = 4096, 1024, 12288, 5, 5
# Spec-sheet memory bandwidth by device name, for the memory-bound floor (None elsewhere: no floor printed).
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}


def hbm_bytes_per_s(device_name: str) -> float | None:
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in device_name), None)


def step_shapes() -> list[tuple[str, int, int]]:
    """(name, out, in) of one drafter step's Linears, in execution order."""
    shapes = [("fc", H, CTX_LAYERS * H)]
    for i in range(LAYERS):
        shapes += [
            (f"{i}.q", H, H),
            (f"{i}.k", KV, H),
            (f"{i}.v", KV, H),
            (f"{i}.o", H, H),
            (f"{i}.gate", INTER, H),
            (f"{i}.up", INTER, H),
            (f"{i}.down", H, INTER),
        ]
    return shapes


def random_codes(out_f: int, in_f: int, group: int, sym: bool, gen: torch.Generator) -> Int4Codes:
    g = in_f // group
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8, device="cuda")
    scales = (torch.rand(g, out_f, generator=gen, device="cuda") * 0.02 + 0.001).to(torch.float16)
    if sym:
        zeros = torch.full((g, out_f), 8, dtype=torch.int64, device="cuda")
    else:
        zeros = torch.randint(1, 16, (g, out_f), generator=gen, device="cuda")
    g_idx = torch.arange(in_f, device="cuda") // group
    return Int4Codes(codes, zeros, scales, g_idx, group)


def fusion(kernel: str) -> str | None:
    """How a candidate groups the Linears of one input: `qkv` (q|k|v and gate|up as one GEMM each: Int4QKV),
    `fused` (k|v and gate|up), or None (one GEMM a Linear, as the bf16 drafter runs)."""
    base = kernel.split(":")[0]
    return "qkv" if base.endswith("+qkv") else "fused" if base.endswith("+fused") else None


def bf16_linear(codes: Int4Codes) -> torch.nn.Linear:
    """A bf16 Linear holding the dequantized weight (the baseline's GEMM)."""
    lin = torch.nn.Linear(codes.shape[1], codes.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(codes.dequantize().to(torch.bfloat16))
    return lin


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4)
    return {"median_ms": round(statistics.median(xs), 4), "q1_ms": round(q[0], 4), "q3_ms": round(q[2], 4)}


def time_steps(steps: dict[str, object], repeats: int) -> dict[str, list[float]]:
    """ms per call of each zero-argument callable, candidates alternating order every repeat."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps[n]()  # type: ignore[operator]
            end.record()
            end.synchronize()
            times[n].append(start.elapsed_time(end))
    return times


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def captured(fn):
    """fn recorded in a CUDA graph (after one run on a side stream); returns the graph's replay."""
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return g.replay


def cuda_variant(mod: torch.nn.Module, options: list[str]) -> None:
    """Our CUDA kernel's configuration changed by OPTIONS: `v3` development variant 3 of the kernel (int4_cuda.cu's
    dispatch) with its own split-K, `b4` the split-K rule's as if 4 blocks fit an SM, `x2` / `x0.5` the split-K
    scaled."""
    from dflash_quant.kernels.int4_cuda import config

    per_sm, scale = None, 1.0
    for option in options:
        if option[:1] in ("v", "b", "x") and option[1:]:
            value = option[1:]
            if option[0] == "v":
                mod._cuda_variant = int(value)
            elif option[0] == "b":
                per_sm = int(value)
            else:
                scale = float(value)
        else:
            raise ValueError(
                f"cuda variant {option!r}: use vN (kernel variant), bN (split as if N blocks an SM) or xF (split-K"
                " scaled), e.g. v3:b4"
            )
    split = config(mod.out_features, mod.in_features, mod.group_size, mod.qweight.device, mod._cuda_variant, per_sm)
    mod._cuda_split = max(1, round(split * scale))


def gemm(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = step_shapes()
    kernels = [k for k in args.kernels.split(",") if k]
    # candidate -> its step: (input width, module, kind of Linear) in execution order
    plans: dict[str, list[tuple[int, torch.nn.Module, str]]] = {"bf16": []}
    errors: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    int4_bytes = bf16_bytes = 0
    t0 = time.perf_counter()
    kept: dict[str, Int4Codes] = {}

    def add(kernel: str, codes: Int4Codes, kind: str) -> None:
        if kernel in skipped:
            return
        base = kernel.split(":")[0].split("+")[0]
        problem = None if base == "bf16" else kernel_problem(base, codes, torch.device("cuda"))
        if problem is None:
            try:
                if base == "bf16":  # bf16+fused / bf16+qkv: the baseline with the same Linears fused
                    if ":" in kernel:
                        raise ValueError(f"{kernel}: a bf16 baseline takes no options")
                    mod: torch.nn.Module = bf16_linear(codes)
                else:
                    mod = Int4Linear(codes, None, base)
                if ":" in kernel and base == "cuda":  # a config variant: xF times the split, vN a kernel variant
                    cuda_variant(mod, kernel.split(":")[1:])
                elif ":" in kernel and isinstance(mod, Int4Linear):  # a forced gemlite matmul type
                    mtype = kernel.split(":")[1]
                    glm = mod._gemlite
                    mod.forward = lambda x, glm=glm, mtype=mtype: glm.forward_manual(x.contiguous(), mtype)  # type: ignore[method-assign]
                shape_key = "x".join(str(v) for v in codes.shape)
                errors.setdefault(kernel, {}).setdefault(shape_key, round(int4_matmul_error(mod, codes, 16), 6))
                plans.setdefault(kernel, []).append((codes.shape[1], mod, kind))
            except Exception as exc:  # noqa: BLE001  # a candidate that fails is reported, not fatal
                problem = f"{type(exc).__name__}: {exc}"[:300]
        if problem is not None:
            skipped[kernel] = problem
            plans.pop(kernel, None)

    for name, out_f, in_f in shapes:
        kind = name.split(".")[-1]
        codes = random_codes(out_f, in_f, args.group_size, args.sym, gen)
        lin = bf16_linear(codes)
        plans["bf16"].append((in_f, lin, kind))
        bf16_bytes += out_f * in_f * 2
        int4_bytes += out_f * in_f // 2 + 2 * 2 * out_f * (in_f // args.group_size)  # codes + fp16 scales/zeros
        shape_key = f"{out_f}x{in_f}"
        if shape_key not in errors.setdefault("bf16", {}):
            errors["bf16"][shape_key] = round(int4_matmul_error(lin, codes, 16), 6)
        for kernel in kernels:
            mode = fusion(kernel)
            if mode is None or kind in ("fc", "o", "down") or (kind == "q" and mode == "fused"):
                add(kernel, codes, kind)
            elif kind in ("q", "k", "gate"):
                kept[kind] = codes
            elif kind == "v" and mode == "qkv":
                add(kernel, concat_outputs([kept["q"], kept["k"], codes]), "qkv")
            elif kind == "v":
                add(kernel, concat_outputs([kept["k"], codes]), "kv")
            elif kind == "up":
                add(kernel, concat_outputs([kept["gate"], codes]), "gateup")
        if kind in ("v", "up"):  # every fused candidate has its group
            for member in ("q", "k") if kind == "v" else ("gate",):
                kept.pop(member, None)
        del codes
        print(f"{time.perf_counter() - t0:.1f}s built {name} {out_f}x{in_f}", flush=True)
    bandwidth = hbm_bytes_per_s(torch.cuda.get_device_name())
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "group_size": args.group_size,
        "sym": args.sym,
        "gemms_per_step": {k: len(p) for k, p in plans.items()},
        "weight_bytes": {"bf16": bf16_bytes, "int4": int4_bytes},
        "hbm_bytes_per_s": bandwidth,
        "memory_floor_ms": {
            "bf16": round(bf16_bytes / bandwidth * 1e3, 4) if bandwidth else None,
            "int4": round(int4_bytes / bandwidth * 1e3, 4) if bandwidth else None,
        },
        "max_rel_error_vs_fp32_dequant": errors,
        "skipped": skipped,
        "rows": {},
    }
    for rows in args.rows:
        xs = {w: torch.randn(rows, w, device="cuda", dtype=torch.bfloat16) for w in sorted({s[2] for s in shapes})}

        def make(plan, kinds=None, xs=xs):
            calls = [(xs[w], mod) for w, mod, kind in plan if kinds is None or kind in kinds]

            def step():
                for x, mod in calls:
                    mod(x)

            return step

        with torch.no_grad():
            eager = {}
            for k, plan in plans.items():
                try:  # warm-up: autotuning, compilation, allocator
                    for _ in range(3):
                        make(plan)()
                    torch.cuda.synchronize()
                    eager[k] = make(plan)
                except Exception as exc:  # noqa: BLE001  # a candidate that fails is reported, not fatal
                    skipped[f"{k}@{rows}"] = f"{type(exc).__name__}: {exc}"[:300]
            t_eager = time_steps(eager, args.repeats)
            graphs, graph_fail = {}, {}
            for k, run_step in eager.items():
                try:
                    graphs[k] = captured(run_step)
                except Exception as exc:  # noqa: BLE001
                    graph_fail[k] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
            t_graph = time_steps(graphs, args.repeats)
            # per kind of Linear (the 5 layers' distinct matrices, so no weight is re-read from L2): graph time
            per_kind: dict[str, dict[str, float]] = {}
            for k in graphs:
                for kind in dict.fromkeys(kd for _, _, kd in plans[k]):
                    n = sum(1 for _, _, kd in plans[k] if kd == kind)
                    try:
                        ts = time_steps({k: captured(make(plans[k], {kind}))}, max(5, args.repeats // 3))
                    except Exception:  # noqa: BLE001, S112  # reported in cuda_graph_failed already
                        continue
                    per_kind.setdefault(kind, {})[k] = round(statistics.median(ts[k]) / n, 4)
        entry: dict = {"eager": {}, "cuda_graph": {}, "cuda_graph_failed": graph_fail, "graph_ms_per_gemm": per_kind}
        for mode, times in (("eager", t_eager), ("cuda_graph", t_graph)):
            base = statistics.median(times["bf16"]) if "bf16" in times else None
            # every candidate also against each bf16 baseline with fused Linears (bf16+fused, bf16+qkv)
            fused_bases = {b: statistics.median(ts) for b, ts in times.items() if b.startswith("bf16+")}
            for k, ts in times.items():
                entry[mode][k] = {**quartiles(ts), "vs_bf16": round(statistics.median(ts) / base, 3) if base else None}
                for b, t in fused_bases.items():
                    entry[mode][k][f"vs_{b}"] = round(statistics.median(ts) / t, 3)
        result["rows"][str(rows)] = entry
        print(f"rows {rows}: " + json.dumps(entry), flush=True)
        save(args.out, result)  # a step cut short by its time limit keeps what it measured
    try:
        from dflash_quant.kernels.int4_triton import tuned_configs

        result["triton_configs"] = tuned_configs()
    except Exception as exc:  # noqa: BLE001
        result["triton_configs"] = f"unavailable: {exc}"
    result["cuda_configs"] = {  # split-K per shape of each cuda candidate
        k: sorted(
            {f"{m.out_features}x{m.in_features}: split {m._cuda_split}" for _, m, _ in p if hasattr(m, "_cuda_split")}
        )
        for k, p in plans.items()
        if k.startswith("cuda")
    }
    return result


def race(drafters: dict, target, prompts, settings, rounds: int, device: torch.device) -> dict[str, dict]:
    """Speculative tokens/s of each drafter on the same prompts: warm-up each, rounds in alternating order."""
    from dflash_quant.speculative.verify import spec_runs, warm_up

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    names = list(drafters)
    rates: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    tau: dict[str, float] = {}
    with torch.no_grad():
        for m in drafters.values():
            warm_up(m, target, prompts[0], settings)
        for r in range(rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                sync()
                t0 = time.perf_counter()
                runs = spec_runs(drafters[n], target, prompts, settings)
                sync()
                dt = time.perf_counter() - t0
                rates[n].append(sum(len(x.tokens) for x in runs) / dt)
                tokens[n] = [x.tokens for x in runs]
                steps = sum(len(x.acceptance_lengths) for x in runs)
                tau[n] = sum(sum(x.acceptance_lengths) for x in runs) / max(steps, 1)
    base = statistics.median(rates["bf16"])
    return {
        n: {
            "tokens_per_s_median": round(statistics.median(rates[n]), 2),
            "tokens_per_s_min": round(min(rates[n]), 2),
            "tokens_per_s_max": round(max(rates[n]), 2),
            "vs_bf16": round(statistics.median(rates[n]) / base, 3),
            "tau": round(tau[n], 4),
            "tokens_equal_int4_dequant": tokens[n] == tokens.get("int4-dequant"),
        }
        for n in names
    }


def e2e(args) -> dict:
    from dflash_quant.kernels.int4_linear import use_int4_kernel
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import encode_prompts, stop_tokens
    from dflash_quant.loading.target import load_target
    from dflash_quant.speculative.verify import CheckSettings

    device, dtype = torch.device(args.device), torch.bfloat16
    target = load_target("reference:target", device=device, dtype=dtype)
    prompts = encode_prompts(target, "reference:heldout", args.num_prompts, False, args.max_new_tokens)
    drafters: dict[str, torch.nn.Module] = {}
    kernel_info: dict[str, dict] = {}
    bf16 = load_drafter("reference", device=device, dtype=dtype)
    drafters["bf16"] = bf16.model
    block = bf16.config.block_size
    for label in ["dequant", *args.kernels.split(",")]:
        choice, _, option = label.partition(":")  # KERNEL:nofuse: one GEMM a Linear; KERNEL:qkv: q|k|v as one
        loaded = load_drafter(args.artifact, device=device, dtype=dtype)
        try:
            info = use_int4_kernel(
                loaded.model,
                loaded.source.path,
                loaded.quantization,
                choice,
                fuse=option != "nofuse",
                qkv=option == "qkv",
            )
        except Exception as exc:  # noqa: BLE001
            kernel_info[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        kernel_info[label] = info
        drafters[f"int4-{label}"] = loaded.model
    settings = CheckSettings(args.max_new_tokens, 0.0, block, 0, stop_tokens(target))
    return {
        "pair": "reference",
        "device": str(device),
        "artifact": str(args.artifact),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "kernels": kernel_info,
        "drafters": race(drafters, target.model, prompts, settings, args.rounds, device),
    }


def e2e_full(args) -> dict:
    """The same race at full size: a random Qwen3-8B target and a Qwen3-8B-DFlash-b16-shaped drafter (the
    pair of bench_prefill.py), its int4 form RTN 4-bit g128 sym (GPTQ's grid; speed does not depend on
    how the codes were chosen). Random weights accept almost nothing (tau ~1), so every step runs the
    drafter on a full block and commits about one token: the drafter's share of a step is what differs."""
    import importlib.util

    from dflash_quant.kernels.int4_linear import use_int4_codes
    from dflash_quant.models.model import DFlashDrafter
    from dflash_quant.quantize.rtn import rtn_quantize
    from dflash_quant.quantize.spec import QuantSpec
    from dflash_quant.speculative.verify import CheckSettings

    spec = importlib.util.spec_from_file_location("bench_prefill", Path(__file__).with_name("bench_prefill.py"))
    assert spec is not None and spec.loader is not None
    bench_prefill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_prefill)
    device, dtype = torch.device(args.device), torch.bfloat16
    target, drafter = bench_prefill.build(device, dtype, args.small)
    group = 128 if not args.small else 32
    deq = DFlashDrafter(drafter.config).to(device=device, dtype=dtype).eval()
    deq.load_state_dict(drafter.state_dict())
    codes = {}
    with torch.no_grad():
        for name in deq.linear_names():
            mod = deq.get_submodule(name)
            qw = rtn_quantize(mod.weight.float(), QuantSpec(4, group, True), name=name)
            mod.weight.copy_(qw.dequantize().to(dtype))
            codes[name] = (Int4Codes(qw.codes, qw.zeros, qw.scales, qw.g_idx.long(), group), None)
    drafters: dict[str, torch.nn.Module] = {"bf16": drafter, "int4-dequant": deq}
    kernel_info: dict[str, dict] = {}
    for label in args.kernels.split(","):
        kernel, _, option = label.partition(":")
        model = DFlashDrafter(drafter.config).to(device=device, dtype=dtype).eval()
        model.load_state_dict(deq.state_dict())
        try:
            kernel_info[label] = use_int4_codes(model, codes, [kernel], fuse=option != "nofuse", qkv=option == "qkv")
        except Exception as exc:  # noqa: BLE001
            kernel_info[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        drafters[f"int4-{label}"] = model
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.num_prompts)]
    settings = CheckSettings(args.max_new_tokens, 0.0, drafter.block_size, 0, [])
    return {
        "pair": "random Qwen3-8B target + Qwen3-8B-DFlash-b16-shaped drafter" if not args.small else "small",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "kernels": kernel_info,
        "drafters": race(drafters, target, prompts, settings, args.rounds, device),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16])
    g.add_argument("--group-size", type=int, default=128)
    g.add_argument("--asym", dest="sym", action="store_false")
    g.add_argument(
        "--kernels",
        default="cuda+fused,triton+fused,gemlite,tinygemm",
        help="KERNEL (cuda | triton | gemlite | tinygemm), KERNEL+fused (k/v and gate/up as one GEMM each), "
        "KERNEL+qkv (q/k/v and gate/up, Int4QKV, as the int4 drafter runs them), bf16+fused / bf16+qkv (bf16 baselines "
        "fused alike), gemlite:TYPE (a forced gemlite matmul type, e.g. GEMV_REVSPLITK) or cuda:OPT[:OPT] (xF: F "
        "times our CUDA kernel's split-K, bN: the split rule's as if N blocks fit an SM, vN: its development variant "
        "N: cuda+fused:x0.5:v2)",
    )
    g.add_argument("--repeats", type=int, default=30)
    g.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("e2e")
    e.add_argument("artifact", type=Path)
    e.add_argument(
        "--kernels",
        default="triton,triton:nofuse,tinygemm",
        help="KERNEL (k|v and gate|up fused), KERNEL:nofuse or KERNEL:qkv (q|k|v too: the runtime's default), "
        "comma-separated",
    )
    e.add_argument("--num-prompts", type=int, default=16)
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--rounds", type=int, default=3)
    e.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (kernels: dequant)")
    e.add_argument("--out", type=Path, required=True)
    f = sub.add_parser("e2e-full")
    f.add_argument(
        "--kernels", default="triton,triton:nofuse", help="KERNEL, KERNEL:nofuse or KERNEL:qkv, comma-separated"
    )
    f.add_argument("--num-prompts", type=int, default=4)
    f.add_argument("--prompt-tokens", type=int, default=256)
    f.add_argument("--max-new-tokens", type=int, default=32)
    f.add_argument("--rounds", type=int, default=3)
    f.add_argument("--device", default="cuda")
    f.add_argument("--small", action="store_true", help="tiny shapes (smoke test on CPU)")
    f.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {"gemm": gemm, "e2e": e2e, "e2e-full": e2e_full}[args.cmd](args)
    save(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
