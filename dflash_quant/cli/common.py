"""Shared CLI plumbing: stderr console, one-line errors, JSON on stdout."""

from __future__ import annotations

import functools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.24 ships its own copy of click; older ones use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc  # type: ignore[no-redef]  # same module, older typer

from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import Terminated, stop_signal

if TYPE_CHECKING:  # every command imports this module; only gptq and verify draw bars
    from rich.progress import Progress

# Diagnostics and progress go to stderr so that `--json` stdout stays parseable. No markup by default: paths and
# names are the user's, and rich would eat `[run1]` or stop on `[/x]`; a styled line asks for markup and escapes.
err_console = Console(stderr=True, markup=False)
out_console = Console(markup=False)


def progress_bar() -> Progress:
    """The live bar of a long command on a terminal (descriptions shown as given, never read as markup)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    )  # fmt: skip


def note(text: str, tag: str = "note:", style: str = "yellow") -> None:
    """A styled `note:` (or other tagged) line on stderr; the text is printed as given."""
    err_console.print(f"[{style}]{escape(tag)}[/] {escape(text)}", markup=True, highlight=False, soft_wrap=True)


LOG_EVERY_S = 30.0


class _Beat:
    """The stage now running on a log. A daemon thread prints its count every `every_s` seconds in which no
    line was printed, so a step that advances rarely (at 27B: loading, a batched greedy decode of every
    calibration prompt) still shows it is alive. A new stage, a completed count or `end_stages` stops it."""

    lock = threading.Lock()
    current: dict[str, Any] | None = None
    thread: threading.Thread | None = None

    @classmethod
    def start(cls, stage: dict[str, Any]) -> None:
        with cls.lock:
            cls.current = stage
            if cls.thread is None:
                cls.thread = threading.Thread(target=cls._run, name="dflash-quant-progress", daemon=True)
                cls.thread.start()

    @classmethod
    def stop(cls, stage: dict[str, Any] | None = None) -> None:
        with cls.lock:
            if stage is None or cls.current is stage:
                cls.current = None

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(0.1)
            with cls.lock:
                stage = cls.current
                if stage is None or time.monotonic() - stage["last"] < stage["every_s"]:
                    continue
                stage["last"] = time.monotonic()
                _stage_line(stage)


def _stage_line(stage: dict[str, Any]) -> None:
    count = str(stage["done"]) if stage["total"] is None else f"{stage['done']}/{stage['total']}"
    if stage["total"] is None and not stage["done"]:
        count = "running"  # a step with nothing to count (loading, writing)
    detail = f", {stage['detail']}" if stage.get("detail") else ""
    err_console.print(
        f"[{time.strftime('%H:%M:%S')}] {stage['label']}: {count} ({time.monotonic() - stage['t0']:.0f} s{detail})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def end_stages() -> None:
    """No stage is running any more: the heartbeat prints nothing after the command's result."""
    _Beat.stop()


def log_stage(label: str, total: int | None, every_s: float = LOG_EVERY_S) -> Callable[[], None]:
    """Progress as plain stderr lines, for a stderr that is not a terminal (a log file, a pipe), where a live bar
    draws nothing: the stage when it starts, its count when it completes, and every `every_s` seconds between
    (from a heartbeat thread, so a stage that has not advanced yet still prints)."""
    now = time.monotonic()
    stage: dict[str, Any] = {"label": label, "total": total, "every_s": every_s, "t0": now, "last": now, "done": 0}
    err_console.print(f"[{time.strftime('%H:%M:%S')}] {label}", markup=False, highlight=False, soft_wrap=True)
    _Beat.start(stage)

    def advance() -> None:
        with _Beat.lock:
            stage["done"] += 1
            stage["detail"] = None
            finished = total is not None and stage["done"] == total
            if finished or time.monotonic() - stage["last"] >= every_s:
                stage["last"] = time.monotonic()
                _stage_line(stage)
        if finished:
            _Beat.stop(stage)

    def detail(text: str) -> None:
        with _Beat.lock:
            stage["detail"] = text

    return Advance(advance, detail)


class Advance:
    """A stage's advance (call it once per counted item) that can also show where the current item stands
    (`detail(text)`, e.g. the token of a long batched decode) beside the count; the next count clears it."""

    def __init__(self, step: Callable[[], None], detail: Callable[[str], None]):
        self._step, self.detail = step, detail

    def __call__(self) -> None:
        self._step()


def stage_progress(bar: Progress, label: str, total: int | None) -> Callable[[], None]:
    """One stage's advance: a task of the live `bar` on a terminal (started here, so a refused job draws
    nothing), plain lines (log_stage) on a log or a pipe, where the bar would print nothing until the end."""
    if not err_console.is_terminal:
        return log_stage(label, total)
    bar.start()
    task = bar.add_task(label, total=total)

    def step() -> None:
        bar.update(task, description=label)
        bar.advance(task)

    return Advance(step, lambda text: bar.update(task, description=f"{label} ({text})"))


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DFlashQuantError (and Ctrl-C) into a one-line message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return fn(*args, **kwargs)
            finally:
                end_stages()  # no progress line after the result or the error
        except (typer.Exit, click_exc.ClickException):
            raise  # already reported (a refusal or a stop): one line only
        except Exception as exc:
            stop = as_stop(exc)
            if stop is not None:
                fail(*stop_message(stop))
            if not isinstance(exc, DFlashQuantError):
                raise
            fail(str(exc), exc.exit_code)
        except (KeyboardInterrupt, Terminated) as exc:
            fail(*stop_message(exc))

    return wrapper


def as_stop(exc: BaseException) -> KeyboardInterrupt | Terminated | None:
    """The signal behind an error: a Ctrl-C or SIGTERM that landed inside native code (safetensors' reader
    turns the raised KeyboardInterrupt into its own error) must still read, and exit, as the signal."""
    if isinstance(exc, KeyboardInterrupt | Terminated):
        return exc
    signum = stop_signal()
    if signum is None:
        return None
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def stop_message(stop: BaseException) -> tuple[str, int]:
    if isinstance(stop, Terminated):
        return f"stopped by {stop}; temporary files and the output lock were removed", 128 + stop.signum
    return "interrupted; no output was written", 130


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


class OneLineErrors(TyperGroup):
    """Usage errors that typer/click detect (unknown option, `--max-new-tokens 0`, a missing argument) as one
    `error:` line, like every other refusal, instead of a usage block and a framed panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exc.NoArgsIsHelpError as exc:
            exc.show()  # the help text: asked for by giving no arguments
            sys.exit(exc.exit_code)
        except click_exc.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            message = " ".join(exc.format_message().split())
            err_console.print(
                f"[bold red]error:[/] {escape(message)}{hint}", markup=True, highlight=False, soft_wrap=True
            )
            sys.exit(exc.exit_code)
        except typer.Abort:
            err_console.print("[bold red]error:[/] aborted", markup=True, highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


# The target-placement options of every command that runs the target (gptq, verify, imatrix).
def device_option() -> Any:
    return typer.Option("auto", help="auto, cpu or cuda[:N] (the drafter's; also the target's without --device-map).")


def device_map_option() -> Any:
    return typer.Option(
        None,
        "--device-map",
        help="Split the target: auto | balanced | balanced_low_0 | sequential, or JSON {module: device} (inline or a file).",
    )


def int4_kernel_option() -> Any:
    return typer.Option(
        "dequant",
        "--int4-kernel",
        help="How a 4-bit GPTQ drafter runs on CUDA (bf16): dequant (default: weights dequantized to bf16, the path "
        "of CPU and other bit widths) | auto | cuda | triton | tinygemm | gemlite. cuda is ours (built on first use: "
        "needs nvcc and ninja); on an H200 it ran a Qwen3-8B-DFlash step's GEMMs at 0.53x bf16, but a small "
        "drafter's check is bound by launches, so the int4 kernels are opt-in.",
    )


def max_memory_option() -> Any:
    return typer.Option(
        None, "--max-memory", help="With a --device-map strategy: per-device limits, e.g. 0=20GiB,cpu=64GiB."
    )
