"""`dflash-quant verify`: the speculative decode check, optionally two drafters side by side."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from dflash_quant.cli.common import (
    device_map_option,
    device_option,
    handle_errors,
    int4_kernel_option,
    max_memory_option,
    note,
    out_console,
    print_json,
    progress_bar,
    stage_progress,
)
from dflash_quant.errors import UsageError, check_count, check_temperature, check_tolerance
from dflash_quant.kernels.int4_choice import check_int4_kernel


def _table(summaries: list[dict], par: dict | None) -> Table:
    table = Table(title="speculative decode check", show_lines=False)
    table.add_column("metric")
    for s in summaries:
        table.add_column(s["drafter"], overflow="fold")
    rows = [
        ("tau (mean acc+1)", "tau"),
        ("lossless", "lossless"),
        ("lossless status", "lossless_status"),
        ("token match rate", "token_match_rate"),
        ("steps", "steps"),
        ("new tokens", "new_tokens"),
        ("spec tok/s", "spec_tokens_per_s"),
        ("target-only tok/s", "baseline_tokens_per_s"),
        ("speedup", "speedup"),
    ]
    if any(s.get("target_replay_forwards") for s in summaries):  # hybrid target: show the rollback cost
        rows += [
            ("target replay forwards", "target_replay_forwards"),
            ("replayed tokens", "replayed_tokens"),
            ("replay seconds", "replay_seconds"),
        ]
    for label, key in rows:
        table.add_row(label, *[str(s.get(key)) for s in summaries])
    n_pos = len(summaries[0]["per_position_acceptance"])
    for k in range(n_pos):
        table.add_row(f"accept @ pos {k + 1}", *[str(s["per_position_acceptance"][k]) for s in summaries])
    if par is not None:
        table.add_row("tau ratio", "", str(par["tau_ratio"]))
    looks: list[dict] = [s["lookup"] for s in summaries if s.get("lookup")]
    if looks and len(looks) == len(summaries):
        for label, key in (
            ("tau with lookup", "tau"),
            ("lookup tau ratio", "tau_ratio"),
            ("lossless with lookup", "lossless"),
            ("steps using lookup", "lookup_step_share"),
            ("target tokens verified vs without", "verified_tokens_ratio"),
            ("lookup search seconds", "lookup_seconds"),
            ("speedup with lookup", "speedup"),
        ):
            table.add_row(label, *[str(lk.get(key)) for lk in looks])
        for source in ("drafter", "lookup"):
            key = f"per_position_acceptance_{source}"
            for k in range(max(len(lk[key]) for lk in looks)):
                table.add_row(f"lookup run: {source} @ pos {k + 1}", *[str((lk[key] + [None] * 99)[k]) for lk in looks])
    return table


def _category_table(summaries: list[dict]) -> Table | None:
    """tau per prompt category, with and without lookup when it ran."""
    cats = summaries[-1].get("by_category")
    if not cats:
        return None
    table = Table(title="tau by prompt category")
    table.add_column("category")
    for s in summaries:
        table.add_column(s["drafter"], overflow="fold")
        if s.get("lookup"):
            table.add_column("with lookup (ratio, share of steps)", overflow="fold")
    for cat in cats:
        row = [cat]
        for s in summaries:
            row.append(str(s["by_category"][cat]["tau"]))
            if s.get("lookup"):
                c = s["lookup"]["by_category"][cat]
                row.append(f"{c['tau']} ({c['tau_ratio']}, {c['lookup_step_share']})")
        table.add_row(*row)
    return table


TEACHER_ROWS = 16  # prompts per batched greedy decode of the target (verify --teacher-forced)


def _teacher_report(drafters, tgt, encoded, settings, block, categories, compare, tolerance) -> dict:
    """verify --teacher-forced: every drafter against the target's greedy continuation of each prompt."""
    from dflash_quant.speculative.teacher import greedy_rows_batched
    from dflash_quant.speculative.verify import by_category, parity, spec_runs, summarize, untimed

    device = next(drafters[-1].model.parameters()).device
    layers = sorted({i for d in drafters for i in d.model.target_layer_ids})
    teachers = greedy_rows_batched(tgt.model, encoded, settings.max_new_tokens, layers, device, TEACHER_ROWS)
    summaries = []
    for d in drafters:
        runs = spec_runs(d.model, tgt.model, encoded, settings, teachers=teachers)
        summaries.append(untimed(summarize(d.source.id, runs, None, settings, block)))
        if cats := by_category(runs, categories):
            summaries[-1]["by_category"] = cats
    report = {
        "num_prompts": len(encoded),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": 0.0,
        "block_size": block,
        "teacher_forced": True,
        "summary": summaries[-1],
        "target_quantization": tgt.quantization.to_dict() if tgt.quantization is not None else None,
    }
    if compare:
        report["baseline"] = summaries[0]
        report["parity"] = parity(summaries[0], summaries[1], tolerance, greedy=False)
    return report


@handle_errors
def verify(
    drafter: str = typer.Argument(
        ..., help="Drafter dir, Hub id, quantized artifact, or a shipped pair: 'reference', 'reference-dflash2'."
    ),
    target: str | None = typer.Option(
        None, "--target", "-t", help="Target dir or Hub id (default: the drafter's recorded target)."
    ),
    prompts: str | None = typer.Option(
        None, help="builtin[:calib|:heldout], reference:heldout, or a .txt/.jsonl file."
    ),
    num_prompts: int | None = typer.Option(None, help="Use only the first N prompts."),
    max_new_tokens: int = typer.Option(64, min=1, help="New tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy (the parity signal); >0 = rejection sampling."),
    block_size: int | None = typer.Option(
        None, help="Draft block size (default: the drafter's; only smaller is allowed)."
    ),
    seed: int = typer.Option(0, help="Sampling seed for temperature > 0."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    dtype: str = typer.Option("auto", help="auto (cpu: float32, cuda: bfloat16), float32, bfloat16, float16."),
    int4_kernel: str = int4_kernel_option(),
    chat_template: bool = typer.Option(
        True, "--chat-template/--no-chat-template", help="Apply the tokenizer's chat template."
    ),
    compare: str | None = typer.Option(
        None, help="A second drafter to run on the same prompts (e.g. the bf16 source)."
    ),
    tolerance: float = typer.Option(0.03, help="Parity tolerance on the tau ratio with --compare, in [0, 1)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    check_cache: Path | None = typer.Option(
        None, help="Where target-only and drafter runs are cached (default ~/.cache/dflash-quant/check)."
    ),
    no_check_cache: bool = typer.Option(False, "--no-check-cache", help="Neither read nor write the run cache."),
    teacher_forced: bool = typer.Option(
        False,
        "--teacher-forced/--no-teacher-forced",
        help="Run the drafters against the target's greedy continuation, decoded once for 16 prompts at a time "
        "(hybrid or offloaded targets): tau and per-position acceptance, not losslessness or speed.",
    ),
    lookup: bool = typer.Option(
        False,
        "--lookup/--no-lookup",
        help="Also run each drafter with the lookup proposer (history n-gram matches) and report both.",
    ),
    lookup_mode: str = typer.Option(
        "both",
        help="Which proposal a step verifies: both | prefer | agree | extend (see dflash_quant/speculative/lookup.py).",
    ),
    lookup_min_ngram: int = typer.Option(2, help="Shortest history suffix a lookup match needs."),
    lookup_max_ngram: int = typer.Option(4, help="Longest history suffix searched."),
    lookup_tokens: int | None = typer.Option(
        None,
        "--lookup-max-tokens",
        "--lookup-tokens",
        help="Lookup tokens per step at most (mode `both`: the lookup row's length, default 24, "
        "at least block size - 1; other modes: default block size - 1).",
    ),
) -> None:
    """Run speculative decoding with DRAFTER on TARGET and report tau, per-position acceptance and losslessness."""
    # torch/transformers load here, not at start-up, so --help and usage errors stay fast.
    import torch

    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import (
        default_prompt_spec,
        encode_prompts,
        load_pair,
        prompt_categories,
        resolve_device,
        resolve_dtype,
        stop_tokens,
    )
    from dflash_quant.models.checks import check_pair
    from dflash_quant.speculative.lookup import LookupSettings
    from dflash_quant.speculative.verify import (
        CheckSettings,
        baseline_runs,
        by_category,
        lookup_summary,
        parity,
        spec_runs,
        summarize,
        warm_up,
    )

    # every argument is checked before a model is loaded
    check_temperature(temperature)
    check_tolerance(tolerance)
    check_count(num_prompts, "--num-prompts")
    check_int4_kernel(int4_kernel)
    if block_size is not None and block_size < 2:
        raise UsageError(f"--block-size {block_size} is too small; a draft block needs at least 2 tokens")
    look = LookupSettings(lookup_mode, lookup_min_ngram, lookup_max_ngram, lookup_tokens) if lookup else None
    if look is not None:
        look.check()
    if teacher_forced and (lookup or temperature > 0):
        raise UsageError(
            "--teacher-forced replays the target's greedy continuation; drop --lookup and --temperature, or drop "
            "--teacher-forced"
        )
    from dflash_quant.models.placement import make_placement

    placement = make_placement(device_map, max_memory)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded, tgt = load_pair(drafter, target, dev, dt, placement)
    drafters = [loaded]
    if compare is not None:
        other = load_drafter(compare, device=dev, dtype=dt)
        check_pair(other.config, tgt.model)
        drafters = [other, loaded]  # baseline first, like a recovery table
    from dflash_quant.kernels.int4_linear import run_key, use_int4_kernel

    kernels = {d.source.id: use_int4_kernel(d.model, d.source.path, d.quantization, int4_kernel) for d in drafters}
    block = block_size or min(d.config.block_size for d in drafters)
    for d in drafters:
        if not 2 <= block <= d.config.block_size:
            raise UsageError(
                f"--block-size {block} must be between 2 and the drafter's block size {d.config.block_size}"
            )
    if look is not None:
        look.check(block)
    settings = CheckSettings(max_new_tokens, temperature, block, seed, stop_tokens(tgt))
    spec = prompts or default_prompt_spec(tgt, "heldout")
    encoded = encode_prompts(tgt, spec, num_prompts, chat_template, max_new_tokens)
    categories = prompt_categories(spec, num_prompts)

    from dflash_quant.io.weights import weights_sha256
    from dflash_quant.speculative.check_cache import CheckCache, cached_runs, check_key, default_dir, model_identity
    from dflash_quant.speculative.decode import GreedyResult, SpecResult

    if teacher_forced:
        report = _teacher_report(drafters, tgt, encoded, settings, block, categories, compare, tolerance)
        report.update({"target": tgt.source.id, "prompt_set": spec, "device": str(dev)})
        report["dtype"] = str(dt).replace("torch.", "")
        if json_out:
            print_json(report)
        else:
            out_console.print(
                _table([*([report["baseline"]] if compare else []), report["summary"]], report.get("parity"))
            )
            out_console.print("teacher-forced: tau and acceptance only; losslessness and speed not measured")
        return
    cache = CheckCache(None if no_check_cache else (check_cache or default_dir()))
    key = check_key(target=model_identity(tgt.source.path), prompts=encoded, settings=settings, device=dev, dtype=dt)
    summaries, cached = [], {}
    with progress_bar() as bar:
        warm_up(drafters[0].model, tgt.model, encoded[0], settings)

        def bar_task(label):
            return stage_progress(bar, label, len(encoded))

        base = cached_runs(
            cache,
            "baseline",
            key,
            GreedyResult,
            lambda: baseline_runs(tgt.model, encoded, settings, bar_task("target-only baseline")),
        )
        cached["target_only"] = cache.events["baseline"]
        for d in drafters:
            dkey = check_key(
                target=key["target"],
                prompts=encoded,
                settings=settings,
                device=dev,
                dtype=dt,
                drafter=weights_sha256(d.source.path),
            )
            if (int4_key := run_key(kernels[d.source.id])) is not None:  # an int4 kernel sums in another order
                dkey["int4_kernel"] = int4_key
            runs = cached_runs(
                cache,
                "spec",
                dkey,
                SpecResult,
                lambda d=d: spec_runs(d.model, tgt.model, encoded, settings, bar_task(f"speculative: {d.source.id}")),
            )
            cached[d.source.id] = cache.events["spec"]
            summaries.append(summarize(d.source.id, runs, base, settings, block))
            if cats := by_category(runs, categories):
                summaries[-1]["by_category"] = cats
            if look is not None:
                with_lookup = CheckSettings(max_new_tokens, temperature, block, seed, settings.stop_token_ids, look)
                looked = spec_runs(
                    d.model, tgt.model, encoded, with_lookup, bar_task(f"speculative + lookup: {d.source.id}")
                )
                summaries[-1]["lookup"] = lookup_summary(
                    summaries[-1], runs, looked, base, with_lookup, block, categories
                )
    par = (
        parity(summaries[0], summaries[1], tolerance, temperature == 0, exact=dt == torch.float32) if compare else None
    )
    report = {
        "target": tgt.source.id,
        "prompt_set": spec,
        "num_prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "block_size": block,
        "device": str(dev),
        "dtype": str(dt).replace("torch.", ""),
        "summary": summaries[-1],
        "target_quantization": tgt.quantization.to_dict() if tgt.quantization is not None else None,
        "cache": cached,  # "hit": that run and its timings come from an earlier run (ignore them for speed)
        "drafter_kernel": kernels[loaded.source.id],
    }
    if placement is not None:
        from dflash_quant.models.devmap import device_summary

        report["target_placement"] = {**placement.describe(), **(device_summary(tgt.model) or {})}
    if compare:
        report["baseline"] = summaries[0]
        report["parity"] = par
    if json_out:
        print_json(report)
    else:
        out_console.print(_table(summaries, par))
        if tgt.quantization is not None:
            from dflash_quant.artifact.reports import target_quant_label

            out_console.print(f"target weights: {target_quant_label(tgt.quantization.to_dict())}")
        for d in drafters:
            if d.quantization:  # how a quantized drafter ran: an int4 kernel, or dequantized and why
                k = kernels[d.source.id]
                how = (
                    f"{k['kernel']} int4 kernel ({k['linears']} Linears)"
                    if k["linears"]
                    else f"dequantized ({k['reason']})"
                )
                out_console.print(f"drafter {d.source.id}: {how}", highlight=False, soft_wrap=True)
        if (cat_table := _category_table(summaries)) is not None:
            out_console.print(cat_table)
    exact = dt == torch.float32
    # fp32: any difference fails; reduced precision: only a divergence the numerics cannot explain
    runs_checked = summaries + [s["lookup"] for s in summaries if s.get("lookup")]
    not_lossless = [
        s for s in runs_checked if s["lossless"] is False and (exact or s.get("lossless_status") == "diverged")
    ]
    failed = bool(not_lossless) or (par is not None and not par["passed"])
    for s in summaries:
        if not exact and s.get("lossless_status") == "near-ties":
            note(
                f"{s['drafter']}: lossless up to {s.get('logits_dtype')} numerics "
                f"(token match rate {s['token_match_rate']:.4f}; every divergence at a near-tie)"
            )
    if failed:
        reasons = (par or {}).get("reasons") or ["greedy output is not lossless"]
        note("; ".join(reasons), tag="check failed:", style="red")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
