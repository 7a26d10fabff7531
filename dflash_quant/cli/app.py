"""The `dflash-quant` command: a thin Typer layer over the pipeline functions.

Every command module is imported for `--help`, so a command imports what it runs inside its own body (most
of the package loads torch): start-up stays at Typer's cost and a refusal comes before any heavy import.
"""

from __future__ import annotations

import importlib

import typer

from dflash_quant import __version__
from dflash_quant.cli.common import OneLineErrors

app = typer.Typer(
    name="dflash-quant",
    help="Quantize DFlash speculative-decoding drafters and prove acceptance parity.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)

# Each module exposes register(app); listed in pipeline order.
COMMAND_MODULES = [
    "dflash_quant.cli.inspect_cmd",
    "dflash_quant.cli.verify_cmd",
    "dflash_quant.cli.gptq_cmd",
    "dflash_quant.cli.export_cmd",
    "dflash_quant.cli.imatrix_cmd",
    "dflash_quant.cli.memory_cmd",
    "dflash_quant.cli.card_cmd",
    "dflash_quant.cli.push_cmd",
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-quant {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Quantize DFlash drafters for 24 GB GPUs without losing their speed-up."""


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
