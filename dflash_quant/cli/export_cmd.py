"""`dflash-quant export`: convert a GPTQ v1 artifact to another engine's format without recalibrating."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from dflash_quant.cli.common import err_console, handle_errors, out_console, print_json
from dflash_quant.errors import UsageError


def export_artifact(
    artifact: Path,
    fmt: str,
    output: Path,
    *,
    overwrite: bool = False,
    target: str | None = None,
    requantize: bool = False,
    gguf_pre: str | None = None,
    card: bool = True,
    command: list[str] | None = None,
) -> dict:
    """Write `fmt` to `output` atomically: weights, config, the source's reports, card, fresh manifest."""
    from dflash_quant.artifact.manifest import write_manifest
    from dflash_quant.export.convert import convert_artifact
    from dflash_quant.io.atomic import atomic_dir

    artifact, output = Path(artifact), Path(output)
    if not artifact.is_dir():
        raise UsageError(f"artifact {artifact} is not a directory; pass the --output of `dflash-quant gptq`")
    src, dst = artifact.resolve(), output.resolve()
    if src == dst or src in dst.parents or dst in src.parents:
        raise UsageError(f"--output {output} overlaps the source artifact {artifact}; choose a separate directory")
    from dflash_quant.pipeline.preflight import input_paths

    # the target (given, or the artifact's recorded one) is read for GGUF's vocabulary: never written into either
    with atomic_dir(output, overwrite, input_paths(str(artifact), target, [], None)) as tmp:
        summary = convert_artifact(
            artifact, tmp, fmt, target=target, requantize=requantize, command=command, gguf_pre=gguf_pre
        )
        if card:
            from dflash_quant.model_cards.card import write_card

            write_card(tmp, command=command)
        write_manifest(tmp)
    return summary


@handle_errors
def export(
    artifact: Path = typer.Argument(..., help="A GPTQ v1 artifact written by `dflash-quant gptq`."),
    fmt: str = typer.Option(..., "--format", "-f", help="compressed-tensors | gguf | mlx"),
    output: Path = typer.Option(..., "--output", "-o", help="Directory to create."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    target: str | None = typer.Option(
        None,
        "--target",
        "-t",
        help="GGUF: the target model (its tokenizer becomes the vocabulary); default: the one in provenance.json.",
    ),
    requantize: bool = typer.Option(
        False, help="GGUF: requantize grids with no exact GGUF type (gguf round-to-nearest) instead of refusing."
    ),
    gguf_pre: str | None = typer.Option(
        None, help="GGUF: llama.cpp pre-tokenizer name (default: qwen2 for 151k Qwen vocabularies, else gpt-2)."
    ),
    card: bool = typer.Option(True, "--card/--no-card", help="Write the model card (README.md)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Convert a GPTQ v1 artifact to compressed-tensors, GGUF or MLX from the same integer codes (no recalibration)."""
    summary = export_artifact(
        artifact,
        fmt,
        output,
        overwrite=overwrite,
        target=target,
        requantize=requantize,
        gguf_pre=gguf_pre,
        card=card,
        command=["dflash-quant", *sys.argv[1:]],
    )
    if json_out:
        print_json({"output": str(output), **summary})
    else:
        out_console.print(f"{fmt} artifact: {output} ({', '.join(summary['files'])})", highlight=False, soft_wrap=True)
        err_console.print(
            f"weights: {summary['exact']}; parity.json records the GPTQ source's check: "
            f"`dflash-quant verify {output} --compare BF16_DRAFTER` measures these weights"
        )


def register(app: typer.Typer) -> None:
    app.command("export")(export)
