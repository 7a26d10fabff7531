"""`dflash-quant card ARTIFACT`: write the model card (README.md + acceptance.png) from the artifact's reports."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_quant.cli.common import err_console, handle_errors, print_json
from dflash_quant.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("card")
    @handle_errors
    def card(
        artifact: Path = typer.Argument(..., help="Artifact directory written by `dflash-quant gptq`."),
        repo_id: str = typer.Option(None, "--repo-id", help="Hub id to use in the serving commands (ORG/NAME)."),
        json_out: bool = typer.Option(False, "--json", help="Print what was written as JSON on stdout."),
    ) -> None:
        """Write README.md (Hub metadata, parity and memory tables, serving notes) and acceptance.png."""
        from dflash_quant.artifact.manifest import has_manifest
        from dflash_quant.artifact.provenance import check_provenance
        from dflash_quant.model_cards.card import CHART_NAME, write_card
        from dflash_quant.model_cards.reading import load_reports

        if not artifact.is_dir():
            raise UsageError(f"{artifact} is not a directory; pass the --output of `dflash-quant gptq`")
        check_provenance(artifact)
        if not has_manifest(artifact):
            err_console.print(
                f"note: {artifact} has no manifest.json, so nothing is checked or recorded; `push` "
                "needs one: re-export with `dflash-quant gptq`",
                highlight=False,
                markup=False,
            )
        readme = write_card(artifact, repo_id=repo_id)  # checks the manifest first, records only its own files
        _, problems = load_reports(artifact)
        for name, problem in problems.items():
            err_console.print(
                f"note: {name} is {problem}; its card section says 'not measured'", highlight=False, soft_wrap=True
            )
        chart = artifact / CHART_NAME
        err_console.print(
            f"wrote {readme}" + (f" and {chart}" if chart.is_file() else ""), highlight=False, soft_wrap=True
        )
        if json_out:
            print_json(
                {
                    "readme": str(readme),
                    "chart": str(chart) if chart.is_file() else None,
                    "missing_reports": problems,
                }
            )
