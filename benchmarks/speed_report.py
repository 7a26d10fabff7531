"""Issue #16's measurements in one JSON and one plot, from the result files the benchmarks wrote.

  python benchmarks/speed_report.py [--results DIR] [--out-json F] [--out-png F]

Reads (each optional; a missing file leaves its panel out and is named in the JSON):
  bench_gptq_h200_batched.json   GPTQ: textbook vs ours, same run (benchmarks/bench_gptq.py)
  int4_gemm_h200_cuda_final.json     one drafter step's GEMMs at 16 rows, bf16 vs int4 (benchmarks/gpu_int4.py)
  prefill_h200.json              time to first token with/without the drafter (benchmarks/bench_prefill.py)
  quickstart_speed_*.json        `make quickstart` and a recipe re-run vs the old version (bench_quickstart.py)
  gpu_main_job_h200.json         the main job on the GPU vs the 2-core CPU (benchmarks/gpu_speed.sh)
Every ratio is against a baseline measured in the same run as the number it divides.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def summarize(results: Path, quickstart: str) -> dict:
    out: dict = {"missing": []}
    gptq = _load(results / "bench_gptq_h200_batched.json")
    if gptq:
        out["gptq"] = {
            "device": gptq["device"],
            "textbook_s": round(gptq["ours"]["gptq_s"], 2),
            "batched_s": round(gptq["ours_batched"]["gptq_s"], 2),
            "ratio": round(gptq["ours_batched"]["gptq_s"] / gptq["ours"]["gptq_s"], 3),
            "goal": "<= 0.33",
        }
    else:
        out["missing"].append("bench_gptq_h200_batched.json")
    gemm = _load(results / "int4_gemm_h200_cuda_final.json")
    if gemm:
        row = gemm["rows"]["16"]
        # our CUDA kernel where it ran, else the first int4 candidate
        kernel = (
            "cuda+fused" if "cuda+fused" in row["cuda_graph"] else next(k for k in row["cuda_graph"] if k != "bf16")
        )
        out["int4_gemm_16_rows"] = {
            "device": gemm["gpu"],
            "kernel": kernel,
            **{
                mode: {
                    "bf16_ms": row[mode]["bf16"]["median_ms"],
                    "int4_ms": row[mode][kernel]["median_ms"],
                    "ratio": row[mode][kernel]["vs_bf16"],
                }
                for mode in ("cuda_graph", "eager")
            },
            "goal": "<= 0.5",
        }
    else:
        out["missing"].append("int4_gemm_h200_cuda_final.json")
    prefill = _load(results / "prefill_h200.json")
    if prefill:
        out["prefill"] = {
            "device": prefill["device"],
            "rows": [
                {
                    "prompt_tokens": r["prompt_tokens"],
                    "target_only_ms": round(r["target_only_ttft_s"] * 1e3, 1),
                    **{k: r[k] for k in r if k.endswith("_overhead")},
                }
                for r in prefill["rows"]
            ],
        }
    else:
        out["missing"].append("prefill_h200.json")
    qs = _load(results / quickstart)
    if qs:
        out["quickstart"] = {
            "file": quickstart,
            "old_commit": qs["old_commit"][:7],
            "new_commit": qs["new_commit"][:7],
            "cpu_ratio_first": qs["cpu_ratio_first_new_over_old"],
            "cpu_ratio_rerun_vs_old_first": qs["cpu_ratio_second_new_over_old_first"],
            "wall_ratio_first": qs["ratio_first_new_over_old"],
            "goals": {"first": "<= 0.5", "rerun": "<= 0.33"},
        }
    else:
        out["missing"].append(quickstart)
    main_job = _load(results / "gpu_main_job_h200.json")
    if main_job:
        out["gpu_main_job"] = main_job
    else:
        out["missing"].append("gpu_main_job_h200.json")
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    panels = [k for k in ("gptq", "int4_gemm_16_rows", "prefill", "quickstart") if k in summary]
    fig = Figure(figsize=(4.2 * max(len(panels), 1), 3.6), dpi=100)
    for i, key in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        s = summary[key]
        if key == "gptq":
            ax.bar(["textbook", "ours"], [s["textbook_s"], s["batched_s"]], color=["#999999", "#1f77b4"])
            ax.set_ylabel("seconds")
            ax.set_title(f"GPTQ, 8B drafter shapes ({s['ratio']:.3f}x)")
        elif key == "int4_gemm_16_rows":
            modes = ["cuda_graph", "eager"]
            xs = range(len(modes))
            ax.bar([x - 0.2 for x in xs], [s[m]["bf16_ms"] for m in modes], 0.4, label="bf16", color="#999999")
            ax.bar([x + 0.2 for x in xs], [s[m]["int4_ms"] for m in modes], 0.4, label="int4 (ours)", color="#1f77b4")
            ax.set_xticks(list(xs), ["CUDA graph", "eager"])
            ax.set_ylabel("ms per drafter step")
            ax.set_title(f"step GEMMs, 16 rows ({s['cuda_graph']['ratio']:.3f}x graph)")
            ax.legend(frameon=False)
        elif key == "prefill":
            rows = s["rows"]
            labels = [f"{r['prompt_tokens'] // 1024}k" for r in rows]
            for name, color in (
                ("bf16_overhead", "#999999"),
                ("int4_overhead", "#ff7f0e"),
                ("int4_kernel_overhead", "#1f77b4"),
            ):
                if name in rows[0]:
                    ax.plot(
                        labels,
                        [100 * r[name] for r in rows],
                        marker="o",
                        label=name.removesuffix("_overhead"),
                        color=color,
                    )
            ax.set_ylabel("TTFT added by the drafter, %")
            ax.set_title("prefill with the drafter")
            ax.legend(frameon=False)
        else:
            ax.bar(["first run", "re-run"], [s["cpu_ratio_first"], s["cpu_ratio_rerun_vs_old_first"]], color="#1f77b4")
            for y, style in ((0.5, "--"), (0.33, ":")):
                ax.axhline(y, color="#444444", linestyle=style, linewidth=1)
            ax.set_ylabel(f"CPU time / {s['old_commit']}'s first run")
            ax.set_title("quickstart (2-core CPU)")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--quickstart", default="quickstart_speed_batched.json", help="bench_quickstart.py result file")
    ap.add_argument("--out-json", type=Path, default=RESULTS / "speed_summary.json")
    ap.add_argument("--out-png", type=Path, default=RESULTS / "speed_summary.png")
    args = ap.parse_args(argv)
    summary = summarize(args.results, args.quickstart)
    args.out_json.write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, args.out_png)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
