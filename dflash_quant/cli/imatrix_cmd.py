"""`dflash-quant imatrix`: llama.cpp's importance matrix for a drafter, from its calibration on its own inputs."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from dflash_quant.cli.common import (
    device_map_option,
    device_option,
    err_console,
    handle_errors,
    max_memory_option,
    out_console,
    print_json,
)
from dflash_quant.errors import UsageError


def make_imatrix(
    drafter: str,
    target: str | None,
    output: Path,
    *,
    overwrite: bool = False,
    calib_prompts: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 64,
    kv_hessian: str = "block+context",
    calib_cache: Path | None = None,
    device: str = "auto",
    dtype: str = "auto",
    chat_template: bool = True,
    device_map: str | None = None,
    max_memory: str | None = None,
) -> dict:

    output = Path(output)
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory; pass a file path such as drafter.imatrix.gguf")
    if os.path.lexists(output) and not overwrite:
        raise UsageError(f"--output {output} exists; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise UsageError(f"the directory of --output {output} does not exist; create it first")
    from dflash_quant.io.atomic import check_not_an_input
    from dflash_quant.pipeline.preflight import input_paths

    check_not_an_input(output, "--output", input_paths(drafter, target, [calib_prompts], calib_cache))

    from dflash_quant.models.placement import make_placement

    placement = make_placement(device_map, max_memory)  # before anything loads
    from dflash_quant.calibration import cache as calib_cache_mod
    from dflash_quant.calibration.capture import capture
    from dflash_quant.export.gguf import pairing_problem
    from dflash_quant.export.imatrix import write_for_stats
    from dflash_quant.io.weights import weights_sha256
    from dflash_quant.loading.runtime import (
        default_prompt_spec,
        encode_prompts,
        load_pair,
        resolve_device,
        resolve_dtype,
        stop_tokens,
    )
    from dflash_quant.models.config import read_config_json

    dev = resolve_device(device)
    drafter_l, target_l = load_pair(drafter, target, dev, resolve_dtype(dtype, dev), placement)
    if problem := pairing_problem(read_config_json(drafter_l.source.path), target_l.source.path):
        raise UsageError(problem)
    spec = calib_prompts or default_prompt_spec(target_l, "calib")
    ids = encode_prompts(target_l, spec, num_prompts, chat_template)
    stats = None
    key = {
        "drafter_sha256": weights_sha256(drafter_l.source.path),
        "target": target_l.source.id,
        "prompts": spec,
        "num_prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "kv_hessian": kv_hessian,
        "chat_template": chat_template,
        "dtype": str(next(drafter_l.model.parameters()).dtype),
    }  # the same key `gptq` uses, so one --calib-cache serves both
    if calib_cache is not None:
        stats = calib_cache_mod.load(calib_cache, key, False, dev)
    cached = stats is not None
    if stats is None:
        stats = capture(
            drafter_l.model, target_l.model, ids, max_new_tokens, kv_hessian, stop_token_ids=stop_tokens(target_l)
        )
        if calib_cache is not None:
            calib_cache_mod.save(calib_cache, stats, key)
    names = drafter_l.model.linear_names()
    write_for_stats(output, stats, names, spec)
    return {
        "output": str(output),
        "tensors": len(names),
        "prompts": stats.prompts,
        "rows": stats.rows(),
        "kv_hessian": kv_hessian,
        "cached": cached,
    }


@handle_errors
def imatrix(
    drafter: str = typer.Argument(
        "reference", help="bf16 drafter dir or Hub id (default: the shipped reference pair)."
    ),
    target: str | None = typer.Option(None, "--target", "-t", help="Target dir or Hub id."),
    output: Path = typer.Option(..., "--output", "-o", help="imatrix GGUF file to write (e.g. drafter.imatrix.gguf)."),
    overwrite: bool = typer.Option(False, help="Replace an existing file."),
    calib_prompts: str | None = typer.Option(
        None, help="Calibration prompts: builtin:calib (default), reference:calib, or a file."
    ),
    num_prompts: int | None = typer.Option(None, help="Use only the first N calibration prompts."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens generated per calibration prompt."),
    kv_hessian: str = typer.Option(
        "block+context", help="Rows behind k/v: block, or block+context (what llama.cpp's k/v see)."
    ),
    calib_cache: Path | None = typer.Option(
        None, help="Directory to save/reuse calibration statistics (shared with gptq)."
    ),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    dtype: str = typer.Option("auto", help="auto (cpu: float32, cuda: bfloat16)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template"),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Write llama.cpp's imatrix GGUF for a drafter: the diagonals of its Hessians on its own speculative inputs."""
    result = make_imatrix(
        drafter,
        target,
        output,
        overwrite=overwrite,
        calib_prompts=calib_prompts,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        kv_hessian=kv_hessian,
        calib_cache=calib_cache,
        device=device,
        dtype=dtype,
        chat_template=chat_template,
        device_map=device_map,
        max_memory=max_memory,
    )
    if json_out:
        print_json(result)
    else:
        out_console.print(
            f"imatrix: {output} ({result['tensors']} tensors, {result['prompts']} prompts)",
            highlight=False,
            soft_wrap=True,
        )
        err_console.print(
            f"use: llama-quantize --imatrix {output} drafter-f32.gguf out.gguf Q4_K_M", highlight=False, soft_wrap=True
        )


def register(app: typer.Typer) -> None:
    app.command("imatrix")(imatrix)
