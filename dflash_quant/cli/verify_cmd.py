"""`dflash-quant verify`: the speculative decode check, optionally two drafters side by side."""

from __future__ import annotations

from functools import partial

import typer
from rich.progress import Progress
from rich.table import Table

from dflash_quant.cli.common import err_console, handle_errors, out_console, print_json
from dflash_quant.errors import UsageError


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
        rows += [("target replay forwards", "target_replay_forwards"), ("replayed tokens", "replayed_tokens"),
                 ("replay seconds", "replay_seconds")]
    for label, key in rows:
        table.add_row(label, *[str(s.get(key)) for s in summaries])
    n_pos = len(summaries[0]["per_position_acceptance"])
    for k in range(n_pos):
        table.add_row(f"accept @ pos {k + 1}", *[str(s["per_position_acceptance"][k]) for s in summaries])
    if par is not None:
        table.add_row("tau ratio", "", str(par["tau_ratio"]))
    return table


@handle_errors
def verify(
    drafter: str = typer.Argument(..., help="Drafter dir, Hub id, quantized artifact, or a shipped pair: 'reference', 'reference-dflash2'."),
    target: str | None = typer.Option(None, "--target", "-t", help="Target dir or Hub id (default: the drafter's recorded target)."),
    prompts: str | None = typer.Option(None, help="builtin[:calib|:heldout], reference:heldout, or a .txt/.jsonl file."),
    num_prompts: int | None = typer.Option(None, help="Use only the first N prompts."),
    max_new_tokens: int = typer.Option(64, min=1, help="New tokens per prompt."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy (the parity signal); >0 = rejection sampling."),
    block_size: int | None = typer.Option(None, help="Draft block size (default: the drafter's; only smaller is allowed)."),
    seed: int = typer.Option(0, help="Sampling seed for temperature > 0."),
    device: str = typer.Option("auto", help="auto, cpu or cuda[:N]."),
    dtype: str = typer.Option("auto", help="auto (cpu: float32, cuda: bfloat16), float32, bfloat16, float16."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Apply the tokenizer's chat template."),
    compare: str | None = typer.Option(None, help="A second drafter to run on the same prompts (e.g. the bf16 source)."),
    tolerance: float = typer.Option(0.03, min=0.0, max=1.0, help="Parity tolerance on the tau ratio with --compare."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Run speculative decoding with DRAFTER on TARGET and report tau, per-position acceptance and losslessness."""
    # torch/transformers load here, not at start-up, so --help and usage errors stay fast.
    import torch

    from dflash_quant.loading import check_pair, load_drafter
    from dflash_quant.runtime import (
        default_prompt_spec,
        encode_prompts,
        load_pair,
        resolve_device,
        resolve_dtype,
        stop_tokens,
    )
    from dflash_quant.verify import CheckSettings, baseline_runs, parity, spec_runs, summarize, warm_up

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if temperature < 0:
        raise UsageError("--temperature must be >= 0")
    loaded, tgt = load_pair(drafter, target, dev, dt)
    drafters = [loaded]
    if compare is not None:
        other = load_drafter(compare, device=dev, dtype=dt)
        check_pair(other.config, tgt.model)
        drafters = [other, loaded]  # baseline first, like a recovery table
    block = block_size or min(d.config.block_size for d in drafters)
    for d in drafters:
        if not 2 <= block <= d.config.block_size:
            raise UsageError(f"--block-size {block} must be between 2 and the drafter's block size {d.config.block_size}")
    settings = CheckSettings(max_new_tokens, temperature, block, seed, stop_tokens(tgt))
    spec = prompts or default_prompt_spec(tgt, "heldout")
    encoded = encode_prompts(tgt, spec, num_prompts, chat_template)

    summaries = []
    with Progress(console=err_console, transient=True) as bar:
        warm_up(drafters[0].model, tgt.model, encoded[0], settings)
        task = bar.add_task("target-only baseline", total=len(encoded))
        base = baseline_runs(tgt.model, encoded, settings, partial(bar.advance, task))
        for d in drafters:
            task = bar.add_task(f"speculative: {d.source.id}", total=len(encoded))
            runs = spec_runs(d.model, tgt.model, encoded, settings, partial(bar.advance, task))
            summaries.append(summarize(d.source.id, runs, base, settings, block))
    par = parity(summaries[0], summaries[1], tolerance, temperature == 0, exact=dt == torch.float32) if compare else None
    report = {
        "target": tgt.source.id, "prompt_set": spec, "num_prompts": len(encoded), "max_new_tokens": max_new_tokens,
        "temperature": temperature, "block_size": block, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
        "summary": summaries[-1],
    }
    if compare:
        report["baseline"] = summaries[0]
        report["parity"] = par
    if json_out:
        print_json(report)
    else:
        out_console.print(_table(summaries, par))
    exact = dt == torch.float32
    # fp32: any difference fails; reduced precision: only a divergence the numerics cannot explain
    not_lossless = [s for s in summaries if s["lossless"] is False and (exact or s.get("lossless_status") == "diverged")]
    failed = bool(not_lossless) or (par is not None and not par["passed"])
    for s in summaries:
        if not exact and s.get("lossless_status") == "near-ties":
            err_console.print(f"[yellow]note:[/] {s['drafter']}: lossless up to {s.get('logits_dtype')} numerics "
                              f"(token match rate {s['token_match_rate']:.4f}; every divergence at a near-tie)")
    if failed:
        reasons = (par or {}).get("reasons") or ["greedy output is not lossless"]
        err_console.print(f"[red]check failed:[/] {'; '.join(reasons)}")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
