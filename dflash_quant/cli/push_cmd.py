"""`dflash-quant push ARTIFACT --repo-id ORG/NAME`: check the artifact, then publish it in one Hub commit."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_quant.cli.common import err_console, handle_errors, print_json


def _log(message: str) -> None:
    style = "yellow" if message.startswith("warning:") else "dim"
    err_console.print(message, style=style, highlight=False, markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("push")
    @handle_errors
    def push(
        artifact: Path = typer.Argument(..., help="Artifact directory written by `dflash-quant gptq`."),
        repo_id: str = typer.Option(..., "--repo-id", help="Target repository, ORG/NAME."),
        private: bool = typer.Option(False, "--private", help="Create the repository as private (new repos only)."),
        revision: str = typer.Option(None, "--revision", help="Branch to commit to (created from main if new)."),
        create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request against main instead."),
        commit_message: str = typer.Option(None, "--commit-message", help="Commit title."),
        dry_run: bool = typer.Option(False, "--dry-run", help="List files and the planned commit; no network."),
        endpoint: str = typer.Option(None, "--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)."),
        force: bool = typer.Option(
            False,
            "--force",
            help="Push even if the parity gate failed or never ran (warns); never overrides integrity checks.",
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the plan or the result as JSON on stdout."),
    ) -> None:
        """Upload the artifact to the Hub in one commit and print the commit URL.

        The token comes from HF_TOKEN or the `hf auth login` cache and is never printed.
        """
        from dflash_quant.hub.push import check_artifact, inspect_artifact, plan_push, push_artifact

        if dry_run:
            check = inspect_artifact(artifact) if artifact.is_dir() else None
            plan = plan_push(
                artifact,
                repo_id,
                revision=revision,
                create_pr=create_pr,
                private=private,
                commit_message=commit_message,
                endpoint=endpoint,
                verified=check.verified if check else [],
            )
            blocking = check.integrity + check.gate if check else [f"{artifact} does not exist"]
            notes = check.notes if check else []
            if json_out:
                print_json(
                    {
                        "dry_run": True,
                        "plan": plan.to_dict(),
                        "problems": blocking,
                        "notes": notes,
                        "would_push": check is not None and not check.integrity and (not check.gate or force),
                    }
                )
            else:
                target = (
                    f"{plan.repo_id} ({'pull request against main' if plan.create_pr else 'branch ' + plan.revision})"
                )
                err_console.print(f"dry run: nothing is sent to {plan.endpoint}", highlight=False, markup=False)
                typer.echo(f"would commit to {target}: {plan.commit_message!r}")
                for f in plan.files:
                    typer.echo(f"  {f.bytes:>14,}  {f.path}  [{f.why}]")
                typer.echo(f"  {plan.total_bytes:>14,}  total, {len(plan.files)} files")
                for note in notes:
                    _log(f"note: {note}")
            if blocking:
                if force and check and not check.integrity:
                    for problem in check.gate:
                        _log(f"warning: --force: would push despite: {problem}")
                else:
                    check_artifact(artifact, force=force)  # raises with the one-line refusal
            return
        result = push_artifact(
            artifact,
            repo_id,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
            endpoint=endpoint,
            force=force,
            log=_log,
        )
        if json_out:
            print_json(result.to_dict())
        else:
            err_console.print(
                f"pushed {result.num_files} files ({result.total_bytes:,} bytes) to {repo_id}",
                highlight=False,
                markup=False,
            )
            typer.echo(result.commit_url)
            if result.pr_url:
                typer.echo(result.pr_url)
