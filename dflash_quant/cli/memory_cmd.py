"""`dflash-quant memory` (what an artifact takes) and `dflash-quant budget` (will it fit on a card)."""

from __future__ import annotations

import functools
from pathlib import Path

import typer
from rich.table import Table

from dflash_quant.cli.common import err_console, handle_errors, out_console, print_json
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.memory.gpus import fmt_bytes


def _check_out(out: Path, artifact: Path, baseline: Path | None) -> None:
    """--out elsewhere than the artifact's memory.json: never an input's file, never a file that is not a report."""
    import os

    from dflash_quant.io.atomic import check_not_an_input, resolve_output
    from dflash_quant.memory.report import MEMORY_JSON, is_memory_report

    if resolve_output(out) == resolve_output(artifact / MEMORY_JSON):
        return  # the artifact's own report, updated in place
    check_not_an_input(out, "--out", [artifact, *([baseline] if baseline is not None else [])])
    if os.path.lexists(out) and not is_memory_report(out):
        raise UsageError(
            f"--out {out} exists and is not a memory report (only a previous memory.json is replaced); choose another path"
        )


def _dflash2_lines(drafter: dict) -> list[str]:
    """A DFlash2 drafter's conv and selector bytes, which every engine keeps bf16, and their share."""

    q = drafter.get("quantized_by_part") or {}
    if not (q.get("conv") or q.get("selector_codebooks")):
        return []
    total = sum(q.values()) or 1
    fmt = drafter["quantized_format"]
    return [
        f"DFlash2 parts in the {fmt} drafter: conv {fmt_bytes(q['conv'])}, selector codebooks "
        f"{fmt_bytes(q['selector_codebooks'])} ({q['selector_codebooks'] / total:.1%} of the {fmt} drafter), "
        f"selector projection {fmt_bytes(q['selector_projection'])}, norms {fmt_bytes(q['norms'])}"
    ]


def _print_budget(rep) -> None:
    """rep: artifact.reports.Budget."""

    forms = list(rep.budgets)
    s = rep.settings
    title = f"{rep.gpu.name} ({fmt_bytes(rep.gpu.total_bytes)}), engine {rep.engine}"
    caption = f"context {s.context}, concurrency {s.concurrency}, K={s.spec_tokens}"
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("component")
    for f in forms:
        table.add_column(f"{f} drafter", justify="right")
    b = [rep.budgets[f] for f in forms]
    for name in b[0].components:
        table.add_row(name.replace("_", " "), *[fmt_bytes(x.components[name]) for x in b])
    table.add_section()
    table.add_row("allocator peak", *[fmt_bytes(x.allocator_peak_bytes) for x in b])
    table.add_row("required", *[fmt_bytes(x.required_bytes) for x in b])
    table.add_row(f"usable (x{b[0].utilization:.2f})", *[fmt_bytes(x.usable_bytes) for x in b])
    table.add_row("headroom", *[fmt_bytes(x.headroom_bytes) for x in b])
    table.add_row("room for drafter weights", *[fmt_bytes(x.drafter_room_bytes) for x in b])
    table.add_row("fits", *["yes" if x.fits else "NO" for x in b])
    table.add_row(
        f"max context (C={s.concurrency})", *[str(x.max_context) if x.max_context is not None else "none" for x in b]
    )
    table.add_row(f"max concurrency (ctx {s.context})", *[str(x.max_concurrency) for x in b])
    out_console.print(table)
    c, t, d = rep.caches, rep.target, rep.drafter
    lines = [
        f"target: {t.source} weights {fmt_bytes(t.weight_bytes)} ({t.weight_format}, {t.weights_from})",
        f"drafter: {d.source} bf16 {fmt_bytes(d.bf16_bytes)}, "
        f"{d.quantized_format} {fmt_bytes(d.quantized_bytes)} ({d.weights_from})",
        f"target KV {fmt_bytes(c.target_kv_bytes_per_token)}/token ({c.kv_dtype})"
        + (f", sliding layers capped at {c.target_sliding_window}" if c.target_sliding_window else "")
        + (
            f"; recurrent state {fmt_bytes(c.target_state_bytes_per_request)}/request "
            f"({c.target_state_slots} slots, {c.target_state_dtype})"
            if c.target_state_slots
            else ""
        ),
        f"drafter context KV {fmt_bytes(c.drafter_kv_bytes_per_token)}/token"
        + (f", sliding layers capped at {c.drafter_sliding_window}" if c.drafter_sliding_window else ""),
    ]
    lines += _dflash2_lines(rep.drafter.to_dict() if rep.drafter else {})
    for x in b:
        for note in x.notes or []:
            if note not in lines:
                lines.append(note)
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


def _print_calibration(rep) -> None:
    """rep: artifact.reports.CalibrationBudget."""

    assert rep.gpu is not None and rep.predicted is not None
    out_console.print(
        f"calibration of {rep.drafter} with {rep.target} on {rep.gpu.name} ({fmt_bytes(rep.gpu.total_bytes)}, "
        f"usable {fmt_bytes(rep.usable_bytes)}): prompts up to {rep.prompt_tokens} tokens + {rep.max_new_tokens} new"
    )
    for name, value in rep.predicted.items():
        out_console.print(f"  {name:<28} {fmt_bytes(value):>12}")
    out_console.print(f"  {'peak (' + str(rep.phase) + ')':<28} {fmt_bytes(rep.peak_bytes):>12}")
    if rep.fits:
        out_console.print("fits on one GPU as is")
        return
    fix = rep.fix
    assert fix is not None
    verdict = "fits with" if fix.fits else "does not fit even with"
    out_console.print(
        f"does not fit as is; {verdict}: {' '.join(fix.flags or [])} (GPU {fmt_bytes(fix.gpu_bytes)}, "
        f"host {fmt_bytes(fix.cpu_bytes)}, target on GPU {fmt_bytes(fix.target_on_gpu_bytes)})"
    )
    if fix.streamed_bytes:  # the price of the split: what the decode waits on, said before the run
        out_console.print(
            f"with them every target forward copies the ~{fmt_bytes(fix.streamed_bytes)} of target weights kept in "
            "host memory onto the GPU (calibration decodes one forward per token)",
            highlight=False,
            soft_wrap=True,
        )


def _print_mtp_comparison(rep: dict) -> None:

    cmp = rep["compare_mtp"]
    methods = cmp["methods"]
    names = list(methods)
    title = (f"{rep['gpu']['name']} ({fmt_bytes(rep['gpu']['total_bytes'])}), engine {cmp['engine']}: "
             "MTP vs DFlash")  # fmt: skip
    caption = f"context {cmp['context']}, concurrency {cmp['concurrency']}, DFlash K={cmp['dflash_spec_tokens']}"
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("term")
    for n in names:
        table.add_column(methods[n]["label"], justify="right")
    table.add_row("state slots (1 or 2 + K)", *[str(methods[n]["state_slots"]) for n in names])
    for term in methods[names[0]]["components"]:
        table.add_row(term.replace("_", " "), *[fmt_bytes(methods[n]["components"][term]) for n in names])
    table.add_section()
    table.add_row("required", *[fmt_bytes(methods[n]["required_bytes"]) for n in names])
    table.add_row("usable", *[fmt_bytes(methods[n]["usable_bytes"]) for n in names])
    table.add_row("headroom", *[fmt_bytes(methods[n]["headroom_bytes"]) for n in names])
    table.add_row("fits", *["yes" if methods[n]["fits"] else "NO" for n in names])
    table.add_row(
        f"max context (C={cmp['concurrency']})",
        *[str(methods[n]["max_context"]) if methods[n]["max_context"] is not None else "none" for n in names],
    )
    table.add_row(f"max concurrency (ctx {cmp['context']})", *[str(methods[n]["max_concurrency"]) for n in names])
    table.add_section()
    table.add_row("per request", *[fmt_bytes(methods[n]["per_request_bytes"]) for n in names])
    table.add_row("per request, speculation", *[fmt_bytes(methods[n]["per_request_speculation_bytes"]) for n in names])
    out_console.print(table)
    m = cmp["mtp"]
    lines = [f"MTP head: {m['layers']} layer(s), weights {fmt_bytes(m['weight_bytes'])} ({m['weights_from']}), "
             f"KV {fmt_bytes(m['kv_bytes_per_token'])}/token"]  # fmt: skip
    for n in names:
        pads = methods[n]["kv_padding_layers"]
        if pads:
            lines.append(
                f"{methods[n]['label']}: vLLM pads KV-cache groups with "
                + ", ".join(f"{v} x {k}" for k, v in pads.items())
                + " layer(s)"
            )
    for pair, c in cmp["crossover"].items():
        a, b = pair.split(" vs ")
        line = (f"{methods[a]['label']} vs {methods[b]['label']}: {methods[c['cheaper_at_1']]['label']} needs "
                f"{fmt_bytes(abs(c['difference_at_1_bytes']))} less at C=1; max concurrency "
                f"{c['max_concurrency'][a]} vs {c['max_concurrency'][b]}")  # fmt: skip
        if c["only_first_fits"]:
            lo, hi = c["only_first_fits"]
            line += f"; only {methods[a]['label']} fits at C={lo}" + (f"..{hi}" if hi > lo else "")
        if c["only_second_fits"]:
            lo, hi = c["only_second_fits"]
            line += f"; only {methods[b]['label']} fits at C={lo}" + (f"..{hi}" if hi > lo else "")
        line += (f"; cheaper method changes at C={c['order_changes_at']}" if c["order_changes_at"]
                 else "; the order never changes up to C=256")  # fmt: skip
        lines.append(line)
    lines += cmp["notes"]
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


def _print_memory(rep) -> None:
    """rep: artifact.reports.MemoryReport."""

    w = rep.weights
    table = Table(title=f"memory: {rep.artifact}", title_justify="left")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    for name, n in w.by_module.items():
        table.add_row(name, fmt_bytes(n))
    table.add_section()
    base_parts = (rep.baseline.to_dict() if rep.baseline else {}).get("by_part") or {}
    for part, n in (w.to_dict().get("by_part") or {}).items():
        if n or base_parts.get(part):
            vs = f" (bf16 {fmt_bytes(base_parts[part])})" if part in base_parts else ""
            table.add_row(f"part: {part.replace('_', ' ')}", fmt_bytes(n) + vs)
    table.add_section()
    for dt, n in w.by_dtype.items():
        table.add_row(f"[{dt}]", fmt_bytes(n))
    table.add_row("total weights", fmt_bytes(w.total_bytes))
    table.add_row("on disk (all files)", fmt_bytes(rep.disk_bytes))
    if w.quantized_linears:
        table.add_row("dequantized to bf16", fmt_bytes(w.dequantized_bf16_bytes))
    b = rep.baseline
    if b:
        table.add_row("baseline bf16 weights", fmt_bytes(b.total_bytes))
        table.add_row("ratio quantized / baseline", f"{b.ratio:.3f}")
    r = rep.resident
    if r:
        table.add_row(f"resident on {r.device} ({r.method}, {r.form})", fmt_bytes(r.bytes))
        table.add_row("resident with an int4 kernel (packed)", fmt_bytes(r.packed_bytes))
    table.add_row("context KV per token (bf16)", fmt_bytes(rep.context_kv_bytes_per_token))
    bud = rep.budget_24gb
    if bud:
        for form, bb in bud.budgets.items():
            table.add_row(
                f"{bud.gpu.name} budget, {form} drafter",
                f"{'fits' if bb.fits else 'does NOT fit'}, headroom {fmt_bytes(bb.headroom_bytes)}, "
                f"max context {bb.max_context}",
            )
    out_console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("memory")
    @handle_errors
    def memory(
        artifact: Path = typer.Argument(..., help="Quantized artifact (or any drafter) directory."),
        baseline: Path | None = typer.Option(None, "--baseline", help="The bf16 drafter directory to compare with."),
        device: str = typer.Option(
            "cpu", "--device", help="Where to load it to measure resident memory: cpu|cuda|none."
        ),
        budget_target: str | None = typer.Option(
            None, "--budget-target", help="Also budget a 24 GB card for this target (preset, dir or config.json)."
        ),
        budget_gpu: str = typer.Option("rtx4090", "--budget-gpu", help="Card for the embedded budget."),
        budget_context: int = typer.Option(8192, "--budget-context", help="Context for the embedded budget."),
        budget_target_weights: str | None = typer.Option(
            "int4", "--budget-target-weights", help="Target weight format for the embedded budget."
        ),
        out: Path | None = typer.Option(None, "--out", help="Write memory.json here instead of into the artifact."),
        no_write: bool = typer.Option(False, "--no-write", help="Do not write memory.json."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    ) -> None:
        """Weight bytes by module and dtype, disk bytes, bf16 comparison, resident memory, context KV per token."""
        from dflash_quant.loading.drafter import measure_resident
        from dflash_quant.memory.report import build_memory_report, write_memory_json

        if not artifact.is_dir():
            raise DFlashQuantError(f"{artifact} is not a directory; pass the artifact directory written by `gptq`")
        if baseline is not None and not baseline.is_dir():
            raise DFlashQuantError(f"--baseline {baseline} is not a directory; pass the bf16 drafter directory")
        if out is not None and out.is_dir():
            raise UsageError(f"--out {out} is a directory; pass a file path such as {out / 'memory.json'}")
        if out is not None and not out.parent.is_dir():
            raise UsageError(f"--out {out}: its folder {out.parent} does not exist; create it or pick another path")
        if out is not None and not no_write:
            _check_out(out, artifact, baseline)
        dev = None if device.lower() in ("none", "") else device.lower()
        if dev not in (None, "cpu", "cuda") and not dev.startswith("cuda:"):
            raise UsageError(f"unknown --device {device!r}; use cpu, cuda or none")
        from dflash_quant.artifact.manifest import has_manifest, require_intact
        from dflash_quant.memory.plan import budget_objects, budget_report, with_mtp_comparison
        from dflash_quant.memory.report import MEMORY_JSON

        if has_manifest(artifact):  # an exported artifact: measure only what the export vouches for
            rewrites = not no_write and (out is None or out.resolve() == (artifact / MEMORY_JSON).resolve())
            require_intact(artifact, stage="memory", skip=(MEMORY_JSON,) if rewrites else ())
        budget = None
        if budget_target:
            t, d, settings = budget_objects(
                budget_target, str(artifact), budget_gpu, budget_context, 1, None, budget_target_weights,
                None, None, None, "vllm", None, None, None, 2048, 256, None, 0, 128,
            )  # fmt: skip
            from dflash_quant.artifact.sources import model_label

            budget = with_mtp_comparison(
                budget_report(
                    t, d, settings, target_label=model_label(budget_target), drafter_label=model_label(artifact)
                ),
                budget_target,
                t,
                d,
                settings,
            )
        err_console.print(f"measuring {artifact} ...", highlight=False, soft_wrap=True)
        measure = functools.partial(measure_resident, artifact, dev) if dev else None
        rep = build_memory_report(artifact, baseline=baseline, resident=measure, budget_24gb=budget)
        if not no_write:
            path = write_memory_json(rep, artifact, out)
            err_console.print(f"wrote {path}", highlight=False, soft_wrap=True)
        if as_json:
            print_json(rep.to_dict())
        else:
            _print_memory(rep)

    @app.command("budget")
    @handle_errors
    def budget(
        target: str = typer.Option(..., "--target", help="Target: preset name, model directory or config.json."),
        drafter: str = typer.Option(
            ..., "--drafter", help="Drafter: artifact dir, bf16 drafter dir, config.json or preset."
        ),
        gpu: str = typer.Option(
            "rtx4090", "--gpu", help="Card name (rtx3090, rtx4090, a10g, l4, h100, ...) or size (24GiB)."
        ),
        context: int = typer.Option(8192, "--context", help="Tokens per request (prompt + generated)."),
        concurrency: int = typer.Option(1, "--concurrency", help="Requests decoded at once."),
        spec_tokens: int | None = typer.Option(
            None, "--spec-tokens", help="K drafted tokens per step (default block_size - 1)."
        ),
        target_weights: str | None = typer.Option(
            None,
            "--target-weights",
            help="bf16|fp8|int8|int4 or a size (17.8GB); default: files, else the config dtype.",
        ),
        kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="KV cache dtype: auto|bf16|fp16|fp8."),
        drafter_kv_dtype: str | None = typer.Option(
            None, "--drafter-kv-dtype", help="Drafter KV dtype (default: --kv-dtype)."
        ),
        state_dtype: str | None = typer.Option(
            None,
            "--state-dtype",
            help="Linear-attention recurrent state dtype: auto (config mamba_ssm_dtype)|bf16|fp32.",
        ),
        engine: str = typer.Option(
            "vllm", "--engine", help="vllm (paged serving engine) or reference (this project's loop)."
        ),
        utilization: float | None = typer.Option(
            None, "--gpu-memory-utilization", help="Engine memory fraction (vllm default 0.90; reference 1.0)."
        ),
        runtime_overhead: str | None = typer.Option(
            None, "--runtime-overhead", help="Non-torch memory (default 0.75GiB)."
        ),
        cuda_graphs: str | None = typer.Option(
            None, "--cuda-graphs", help="CUDA-graph reserve (vllm default 0.5GiB; 0 = eager)."
        ),
        prefill_chunk: int = typer.Option(
            2048, "--prefill-chunk", help="Tokens per prefill forward (vLLM max_num_batched_tokens)."
        ),
        max_num_seqs: int = typer.Option(
            256, "--max-num-seqs", help="vLLM max_num_seqs (rows of the profiled sampler)."
        ),
        activation: str | None = typer.Option(
            None, "--activation", help="Override the activation estimate (e.g. 1.2GiB)."
        ),
        new_tokens: int = typer.Option(0, "--new-tokens", help="reference engine: generated tokens within --context."),
        group_size: int = typer.Option(128, "--group-size", help="GPTQ group size for int4 estimates."),
        prefix_caching: bool = typer.Option(
            True,
            "--prefix-caching/--no-prefix-caching",
            help="vllm, hybrid targets: prefix caching (vLLM's default) keeps 2 + K state pages per request, "
            "--no-prefix-caching (vllm serve --no-enable-prefix-caching) 1 + K.",
        ),
        compare_mtp: bool = typer.Option(
            False,
            "--compare-mtp",
            help="Side by side: no speculation, the target's MTP head (K=1..3), DFlash bf16/int4.",
        ),
        mtp_tokens: str | None = typer.Option(
            None, "--mtp-tokens", help="MTP K values for --compare-mtp (default 1,2,3)."
        ),
        mtp_weights: str | None = typer.Option(
            None, "--mtp-weights", help="MTP weight format bf16|fp8|int8|int4 (default: mtp.* in the files, else bf16)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout."),
        calibration: bool = typer.Option(
            False,
            "--calibration",
            help="Budget gptq's calibration instead of serving: bf16 target + drafter + fp32 Hessians + activations.",
        ),
        prompt_tokens: int = typer.Option(1024, "--prompt-tokens", help="--calibration: longest calibration prompt."),
        calib_new_tokens: int = typer.Option(
            64, "--calib-new-tokens", help="--calibration: gptq --max-new-tokens (tokens generated per prompt)."
        ),
        kv_hessian: str = typer.Option("block+context", "--kv-hessian", help="--calibration: block | block+context."),
        calib_batch: int = typer.Option(
            1, "--calib-batch", help="--calibration: gptq --calib-batch (prompts per batch)."
        ),
        teacher_forced: bool = typer.Option(
            False, "--teacher-forced", help="--calibration: gptq --teacher-forced (only the taps of each row are kept)."
        ),
    ) -> None:
        """Will the target + drafter fit on this card? Headroom, max context, max concurrency; bf16 vs int4 drafter."""
        from dflash_quant.memory.plan import budget_objects, budget_report, mtp_comparison, parse_mtp_tokens

        if calibration:
            from dflash_quant.memory.calibration import calibration_budget

            if kv_hessian not in ("block", "block+context"):
                raise UsageError(f"--kv-hessian must be block or block+context, got {kv_hessian!r}")
            crep = calibration_budget(
                target, drafter, gpu, prompt_tokens, calib_new_tokens, kv_hessian, target_weights,
                rows=calib_batch, teacher=teacher_forced,
            )  # fmt: skip
            if as_json:
                print_json(crep.to_dict())
            else:
                _print_calibration(crep)
            return
        t, d, settings = budget_objects(
            target, drafter, gpu, context, concurrency, spec_tokens, target_weights, kv_dtype, drafter_kv_dtype,
            state_dtype, engine, utilization, runtime_overhead, cuda_graphs, prefill_chunk, max_num_seqs,
            activation, new_tokens, group_size, prefix_caching=prefix_caching,
        )  # fmt: skip
        if compare_mtp or mtp_tokens is not None or mtp_weights is not None:
            if not compare_mtp:
                raise UsageError("--mtp-tokens and --mtp-weights only apply with --compare-mtp; add --compare-mtp")
            cmp = mtp_comparison(target, t, d, settings, parse_mtp_tokens(mtp_tokens), mtp_weights)
            rep = {**budget_report(t, d, settings).to_dict(), "compare_mtp": cmp}
            if as_json:
                print_json(rep)
            else:
                _print_mtp_comparison(rep)
            return
        rep = budget_report(t, d, settings)
        if as_json:
            print_json(rep.to_dict())
        else:
            _print_budget(rep)
