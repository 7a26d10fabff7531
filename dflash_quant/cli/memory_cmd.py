"""`dflash-quant memory` (what an artifact takes) and `dflash-quant budget` (will it fit on a card)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from dflash_quant.cli.common import err_console, handle_errors, out_console, print_json
from dflash_quant.errors import UsageError
from dflash_quant.memory.plan import budget_objects as _budget_objects
from dflash_quant.memory.plan import budget_report


def _print_budget(rep: dict) -> None:
    from dflash_quant.memory.gpus import fmt_bytes

    forms = list(rep["budgets"])
    s = rep["settings"]
    title = f"{rep['gpu']['name']} ({fmt_bytes(rep['gpu']['total_bytes'])}), engine {rep['engine']}"
    caption = f"context {s['context']}, concurrency {s['concurrency']}, K={s['spec_tokens']}"
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("component")
    for f in forms:
        table.add_column(f"{f} drafter", justify="right")
    first = rep["budgets"][forms[0]]
    for name in first["components"]:
        table.add_row(name.replace("_", " "), *[fmt_bytes(rep["budgets"][f]["components"][name]) for f in forms])
    table.add_section()
    table.add_row("allocator peak", *[fmt_bytes(rep["budgets"][f]["allocator_peak_bytes"]) for f in forms])
    table.add_row("required", *[fmt_bytes(rep["budgets"][f]["required_bytes"]) for f in forms])
    table.add_row(
        f"usable (x{first['utilization']:.2f})", *[fmt_bytes(rep["budgets"][f]["usable_bytes"]) for f in forms]
    )
    table.add_row("headroom", *[fmt_bytes(rep["budgets"][f]["headroom_bytes"]) for f in forms])
    table.add_row("fits", *["yes" if rep["budgets"][f]["fits"] else "NO" for f in forms])
    table.add_row(
        f"max context (C={s['concurrency']})",
        *[str(rep["budgets"][f]["max_context"]) if rep["budgets"][f]["max_context"] is not None else "none"
          for f in forms],  # fmt: skip
    )
    table.add_row(f"max concurrency (ctx {s['context']})", *[str(rep["budgets"][f]["max_concurrency"]) for f in forms])
    out_console.print(table)
    c = rep["caches"]
    lines = [
        f"target: {rep['target']['source']} weights {fmt_bytes(rep['target']['weight_bytes'])} "
        f"({rep['target']['weight_format']}, {rep['target']['weights_from']})",
        f"drafter: {rep['drafter']['source']} bf16 {fmt_bytes(rep['drafter']['bf16_bytes'])}, "
        f"{rep['drafter']['quantized_format']} {fmt_bytes(rep['drafter']['quantized_bytes'])} ({rep['drafter']['weights_from']})",
        f"target KV {fmt_bytes(c['target_kv_bytes_per_token'])}/token ({c['kv_dtype']})"
        + (f", sliding layers capped at {c['target_sliding_window']}" if c["target_sliding_window"] else "")
        + (
            f"; recurrent state {fmt_bytes(c['target_state_bytes_per_request'])}/request "
            f"({c['target_state_slots']} slots, {c['target_state_dtype']})"
            if c["target_state_slots"]
            else ""
        ),
        f"drafter context KV {fmt_bytes(c['drafter_kv_bytes_per_token'])}/token"
        + (f", sliding layers capped at {c['drafter_sliding_window']}" if c["drafter_sliding_window"] else ""),
    ]
    for f in forms:
        for note in rep["budgets"][f]["notes"]:
            if note not in lines:
                lines.append(note)
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


def _print_memory(rep: dict) -> None:
    from dflash_quant.memory.gpus import fmt_bytes

    w = rep["weights"]
    table = Table(title=f"memory: {rep['artifact']}", title_justify="left")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    for name, n in w["by_module"].items():
        table.add_row(name, fmt_bytes(n))
    table.add_section()
    for dt, n in w["by_dtype"].items():
        table.add_row(f"[{dt}]", fmt_bytes(n))
    table.add_row("total weights", fmt_bytes(w["total_bytes"]))
    table.add_row("on disk (all files)", fmt_bytes(rep["disk_bytes"]))
    if w["quantized_linears"]:
        table.add_row("dequantized to bf16", fmt_bytes(w["dequantized_bf16_bytes"]))
    b = rep.get("baseline")
    if b:
        table.add_row("baseline bf16 weights", fmt_bytes(b["total_bytes"]))
        table.add_row("ratio quantized / baseline", f"{b['ratio']:.3f}")
    r = rep.get("resident")
    if r:
        table.add_row(f"resident on {r['device']} ({r['method']}, {r['form']})", fmt_bytes(r["bytes"]))
        table.add_row("resident with an int4 kernel (packed)", fmt_bytes(r["packed_bytes"]))
    table.add_row("context KV per token (bf16)", fmt_bytes(rep["context_kv_bytes_per_token"]))
    bud = rep.get("budget_24gb")
    if bud:
        for form, bb in bud["budgets"].items():
            table.add_row(
                f"{bud['gpu']['name']} budget, {form} drafter",
                f"{'fits' if bb['fits'] else 'does NOT fit'}, headroom {fmt_bytes(bb['headroom_bytes'])}, "
                f"max context {bb['max_context']}",
            )
    out_console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("memory")
    @handle_errors
    def memory(
        artifact: Path = typer.Argument(..., help="Quantized artifact (or any drafter) directory."),
        baseline: Optional[Path] = typer.Option(None, "--baseline", help="The bf16 drafter directory to compare with."),
        device: str = typer.Option("cpu", "--device", help="Where to load it to measure resident memory: cpu|cuda|none."),
        budget_target: Optional[str] = typer.Option(
            None, "--budget-target", help="Also budget a 24 GB card for this target (preset, dir or config.json)."
        ),
        budget_gpu: str = typer.Option("rtx4090", "--budget-gpu", help="Card for the embedded budget."),
        budget_context: int = typer.Option(8192, "--budget-context", help="Context for the embedded budget."),
        budget_target_weights: Optional[str] = typer.Option(
            "int4", "--budget-target-weights", help="Target weight format for the embedded budget."
        ),
        out: Optional[Path] = typer.Option(None, "--out", help="Write memory.json here instead of into the artifact."),
        no_write: bool = typer.Option(False, "--no-write", help="Do not write memory.json."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    ) -> None:
        """Weight bytes by module and dtype, disk bytes, bf16 comparison, resident memory, context KV per token."""
        from dflash_quant.errors import DFlashQuantError
        from dflash_quant.memory.report import build_memory_report, write_memory_json

        if not artifact.is_dir():
            raise DFlashQuantError(f"{artifact} is not a directory; pass the artifact directory written by `gptq`")
        if baseline is not None and not baseline.is_dir():
            raise DFlashQuantError(f"--baseline {baseline} is not a directory; pass the bf16 drafter directory")
        if out is not None and out.is_dir():
            raise UsageError(f"--out {out} is a directory; pass a file path such as {out / 'memory.json'}")
        if out is not None and not out.parent.is_dir():
            raise UsageError(f"--out {out}: its folder {out.parent} does not exist; create it or pick another path")
        dev = None if device.lower() in ("none", "") else device.lower()
        if dev not in (None, "cpu", "cuda") and not dev.startswith("cuda:"):
            raise UsageError(f"unknown --device {device!r}; use cpu, cuda or none")
        from dflash_quant.export.manifest import has_manifest, require_intact
        from dflash_quant.memory.report import MEMORY_JSON

        if has_manifest(artifact):  # an exported artifact: measure only what the export vouches for
            rewrites = not no_write and (out is None or out.resolve() == (artifact / MEMORY_JSON).resolve())
            require_intact(artifact, stage="memory", skip=(MEMORY_JSON,) if rewrites else ())
        budget = None
        if budget_target:
            t, d, settings = _budget_objects(
                budget_target, str(artifact), budget_gpu, budget_context, 1, None, budget_target_weights,
                None, None, None, "vllm", None, None, None, 2048, 256, None, 0, 128,
            )  # fmt: skip
            budget = budget_report(t, d, settings)
        err_console.print(f"measuring {artifact} ...", highlight=False)
        rep = build_memory_report(artifact, baseline=baseline, device=dev, budget_24gb=budget)
        if not no_write:
            path = write_memory_json(rep, artifact, out)
            err_console.print(f"wrote {path}", highlight=False)
        if as_json:
            print_json(rep)
        else:
            _print_memory(rep)

    @app.command("budget")
    @handle_errors
    def budget(
        target: str = typer.Option(..., "--target", help="Target: preset name, model directory or config.json."),
        drafter: str = typer.Option(..., "--drafter", help="Drafter: artifact dir, bf16 drafter dir, config.json or preset."),
        gpu: str = typer.Option("rtx4090", "--gpu", help="Card name (rtx3090, rtx4090, a10g, l4, h100, ...) or size (24GiB)."),
        context: int = typer.Option(8192, "--context", help="Tokens per request (prompt + generated)."),
        concurrency: int = typer.Option(1, "--concurrency", help="Requests decoded at once."),
        spec_tokens: Optional[int] = typer.Option(None, "--spec-tokens", help="K drafted tokens per step (default block_size - 1)."),
        target_weights: Optional[str] = typer.Option(
            None, "--target-weights", help="bf16|fp8|int8|int4 or a size (17.8GB); default: files, else the config dtype."
        ),
        kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV cache dtype: auto|bf16|fp16|fp8."),
        drafter_kv_dtype: Optional[str] = typer.Option(None, "--drafter-kv-dtype", help="Drafter KV dtype (default: --kv-dtype)."),
        state_dtype: Optional[str] = typer.Option(
            None, "--state-dtype", help="Linear-attention recurrent state dtype: auto (config mamba_ssm_dtype)|bf16|fp32."
        ),
        engine: str = typer.Option("vllm", "--engine", help="vllm (paged serving engine) or reference (this project's loop)."),
        utilization: Optional[float] = typer.Option(
            None, "--gpu-memory-utilization", help="Engine memory fraction (vllm default 0.90; reference 1.0)."
        ),
        runtime_overhead: Optional[str] = typer.Option(None, "--runtime-overhead", help="Non-torch memory (default 0.75GiB)."),
        cuda_graphs: Optional[str] = typer.Option(None, "--cuda-graphs", help="CUDA-graph reserve (vllm default 0.5GiB; 0 = eager)."),
        prefill_chunk: int = typer.Option(2048, "--prefill-chunk", help="Tokens per prefill forward (vLLM max_num_batched_tokens)."),
        max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="vLLM max_num_seqs (rows of the profiled sampler)."),
        activation: Optional[str] = typer.Option(None, "--activation", help="Override the activation estimate (e.g. 1.2GiB)."),
        new_tokens: int = typer.Option(0, "--new-tokens", help="reference engine: generated tokens within --context."),
        group_size: int = typer.Option(128, "--group-size", help="GPTQ group size for int4 estimates."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout."),
    ) -> None:
        """Will the target + drafter fit on this card? Headroom, max context, max concurrency; bf16 vs int4 drafter."""
        t, d, settings = _budget_objects(
            target, drafter, gpu, context, concurrency, spec_tokens, target_weights, kv_dtype, drafter_kv_dtype,
            state_dtype, engine, utilization, runtime_overhead, cuda_graphs, prefill_chunk, max_num_seqs,
            activation, new_tokens, group_size,
        )  # fmt: skip
        rep = budget_report(t, d, settings)
        if as_json:
            print_json(rep)
        else:
            _print_budget(rep)
