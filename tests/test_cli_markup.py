"""Paths and names are printed as given: rich markup is off unless a line styles itself, and then the user's
text is escaped. Before, `[run1]` in an output path vanished from the summary and `[/x]` stopped the command
with a MarkupError after its work was done; the memory table's `[int32]` dtype rows printed with no label."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from dflash_quant.cli.common import note, progress_bar

REPO = Path(__file__).resolve().parents[1]


def test_the_live_bar_shows_a_description_as_given():
    bar = progress_bar()
    bar.add_task("speculative: runs[/x]/[run1]", total=3)
    out = Console(file=io.StringIO(), force_terminal=True, width=200, markup=False)
    out.print(bar.make_tasks_table(bar.tasks))
    assert "speculative: runs[/x]/[run1]" in out.file.getvalue()


def test_a_styled_note_escapes_its_text(capsys):
    note("wrote runs[/x]/[run1] and [bold]this[/bold]")
    assert "note: wrote runs[/x]/[run1] and [bold]this[/bold]" in capsys.readouterr().err


def test_gptq_and_memory_print_a_bracketed_path_as_given(tmp_path):
    (tmp_path / "runs[").mkdir()
    out = tmp_path / "runs[" / "x][run1]"  # the string holds `[/x]` and `[run1]`
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "dflash_quant.cli.app"]
    gptq = [*cli, "gptq", "--num-prompts", "4", "--max-new-tokens", "24", "--no-verify", "--no-card", "-o", str(out)]
    res = subprocess.run(gptq, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"artifact: {out}" in res.stdout and "Traceback" not in res.stderr
    assert out.is_dir()
    res = subprocess.run([*cli, "memory", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"memory: {out.name}" in res.stdout  # the table's title names the artifact's folder
    assert "[int32]" in res.stdout and f"wrote {out / 'memory.json'}" in " ".join(res.stderr.split())
