"""`dflash-quant gptq`: the main job, a thin layer over dflash_quant.pipeline.run_gptq."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_quant.cli.common import err_console, fail, handle_errors, out_console, print_json


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _summary(result) -> Table:
    rep, par, t = result.quant_report, result.parity, result.timings
    table = Table(title=f"dflash-quant gptq -> {result.output}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("quantized Linears", str(len(rep["layers"])))
    table.add_row("kept in bf16", str(len(rep["kept_bf16"])))
    table.add_row("their bf16 bytes", _fmt_bytes(rep["original_bytes"]))
    table.add_row("their quantized bytes", _fmt_bytes(rep["quantized_bytes"]))
    if rep["original_bytes"]:
        table.add_row("quantized / bf16", f"{rep['quantized_bytes'] / rep['original_bytes']:.3f}")
    if par:
        table.add_row("tau bf16 (T=0)", f"{par['baseline']['tau']:.3f}")
        table.add_row("tau quantized (T=0)", f"{par['quantized']['tau']:.3f}")
        table.add_row("tau ratio", f"{par['tau_ratio']:.4f}")
        table.add_row("lossless", str(par["lossless"]))
        table.add_row("parity", "PASS" if par["passed"] else "FAIL")
    else:
        table.add_row("parity", "not run (--no-verify)")
    for key, label in (("calibrate_s", "calibration"), ("quantize_s", "quantization"), ("verify_s", "parity check"), ("total_s", "total")):
        if key in t:
            table.add_row(f"{label} time", f"{t[key]:.1f} s")
    return table


@handle_errors
def gptq(
    drafter: str = typer.Argument("reference", help="bf16 drafter dir or Hub id (default: the shipped reference pair)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target dir or Hub id (default: the reference target for 'reference')."),
    bits: int = typer.Option(4, help="2, 3, 4 or 8."),
    group_size: int = typer.Option(128, help="-1 (per channel), 32, 64, 128, ..."),
    sym: bool = typer.Option(True, "--sym/--asym", help="Symmetric (vLLM Marlin) or asymmetric grid."),
    desc_act: bool = typer.Option(False, "--desc-act/--no-desc-act", help="Act-order: quantize columns by decreasing Hessian diagonal."),
    static_groups: bool = typer.Option(False, help="With --desc-act: group parameters fixed before reordering."),
    damp: float = typer.Option(0.01, help="Dampening as a fraction of the mean Hessian diagonal (raised automatically if needed)."),
    method: str = typer.Option("gptq", help="gptq, or rtn (round-to-nearest baseline)."),
    sequential: bool = typer.Option(False, "--sequential/--no-sequential", help="Quantize stage by stage, feeding later stages the quantized outputs."),
    profile: str = typer.Option("full", help="full | vllm | sglang (vllm/sglang keep q/k/v in bf16)."),
    skip: List[str] = typer.Option([], "--skip", help="Regex of Linear names to keep in bf16 (repeatable)."),
    output: Path = typer.Option(Path("out/drafter-gptq"), "--output", "-o", help="Artifact directory to create."),
    overwrite: bool = typer.Option(False, help="Replace a previous dflash-quant artifact (one with manifest.json) at --output; never a directory that overlaps an input."),
    calib_prompts: Optional[str] = typer.Option(None, help="Calibration prompts: builtin:calib (default), reference:calib, or a file."),
    num_prompts: Optional[int] = typer.Option(None, help="Use only the first N calibration prompts."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens generated per calibration prompt."),
    kv_hessian: str = typer.Option("block+context", help="Rows in the k/v Hessian: block, or block+context (default: measured better)."),
    calib_cache: Optional[Path] = typer.Option(None, help="Directory to save/reuse calibration statistics."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Run the bf16-vs-quantized parity gate."),
    eval_prompts: Optional[str] = typer.Option(None, help="Held-out parity prompts (default: builtin:heldout / reference:heldout)."),
    eval_num_prompts: Optional[int] = typer.Option(None, help="Use only the first N parity prompts."),
    eval_max_new_tokens: int = typer.Option(128, min=1, help="Tokens generated per parity prompt."),
    tolerance: float = typer.Option(0.03, min=0.0, max=1.0, help="Fail when tau_q / tau_bf16 < 1 - tolerance."),
    device: str = typer.Option("auto", help="auto, cpu or cuda[:N]."),
    dtype: str = typer.Option("auto", help="auto (cpu: float32, cuda: bfloat16)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template"),
    card: bool = typer.Option(True, "--card/--no-card", help="Write the model card (README.md) into the artifact."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    fmt: str = typer.Option("gptq", "--format", help="gptq (v1, default) | compressed-tensors | gguf (needs --group-size 32) | mlx (group 32/64/128)."),
    gguf_type: Optional[str] = typer.Option(None, help="With --format gguf: GPTQ directly on llama.cpp's Q4_K | Q3_K | Q2_K | IQ4_NL grid (ignores --bits/--group-size/--sym)."),
) -> None:
    """Calibrate on the drafter's own inputs, GPTQ-quantize it, export GPTQ v1, and prove acceptance parity."""
    from dflash_quant.export.atomic import Terminated
    from dflash_quant.preflight import guard_run

    try:
        # Path checks and the output lock come before the heavy imports, so refusals are instant.
        with guard_run(output, overwrite, drafter, target, (calib_prompts, eval_prompts), calib_cache):
            from dflash_quant.pipeline import GptqJob, run_gptq
            from dflash_quant.quantize.drafter import QuantSettings

            quant = QuantSettings(
                method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, static_groups=static_groups,
                damp=damp, sequential=sequential, profile=profile, skip=tuple(skip),
            )
            job = GptqJob(
                output=output, drafter=drafter, target=target, quant=quant, overwrite=overwrite, calib_prompts=calib_prompts,
                calib_num_prompts=num_prompts, calib_max_new_tokens=max_new_tokens, kv_hessian=kv_hessian,
                calib_cache=calib_cache, verify=verify, eval_prompts=eval_prompts, eval_num_prompts=eval_num_prompts,
                eval_max_new_tokens=eval_max_new_tokens, tolerance=tolerance, device=device, dtype=dtype,
                chat_template=chat_template, write_card=card, command=["dflash-quant", *sys.argv[1:]], format=fmt,
                gguf_type=gguf_type,
            )
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=err_console, transient=True) as bar:

                def stage(label: str, total: int | None):
                    task = bar.add_task(label, total=total)
                    return lambda: bar.advance(task)

                result = run_gptq(job, progress=stage)
    except Terminated as exc:
        fail(f"stopped by {exc}; temporary files and the output lock were removed", 128 + exc.signum)
    if json_out:
        print_json({"output": str(result.output), "passed": result.passed, "reasons": result.reasons,
                    "parity": result.parity, "quant_report": result.quant_report, "timings": result.timings})
    else:
        out_console.print(_summary(result))
        out_console.print(f"artifact: {result.output}")
    for note in (result.parity or {}).get("notes", []):
        err_console.print(f"[yellow]note:[/] {note}")
    if result.passed is False:
        err_console.print(f"[red]parity gate failed:[/] {'; '.join(result.reasons)} (artifact kept for inspection)")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("gptq")(gptq)
