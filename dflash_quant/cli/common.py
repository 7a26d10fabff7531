"""Shared CLI plumbing: stderr console, one-line errors, JSON on stdout."""

from __future__ import annotations

import functools
import json
import signal
import sys
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

# Diagnostics and progress go to stderr so that `--json` stdout stays parseable.
err_console = Console(stderr=True)
out_console = Console()


LOG_EVERY_S = 30.0


def log_stage(label: str, total: int | None, every_s: float = LOG_EVERY_S) -> Callable[[], None]:
    """Progress as plain stderr lines, for a stderr that is not a terminal (a log file, a pipe), where a live bar
    draws nothing: the stage when it starts, then its count every `every_s` seconds and when it completes."""
    t0 = last = time.monotonic()
    done = 0
    err_console.print(f"[{time.strftime('%H:%M:%S')}] {label}", markup=False, highlight=False, soft_wrap=True)

    def advance() -> None:
        nonlocal done, last
        done += 1
        now = time.monotonic()
        if now - last >= every_s or (total is not None and done == total):
            last = now
            of = f"/{total}" if total is not None else ""
            err_console.print(
                f"[{time.strftime('%H:%M:%S')}] {label}: {done}{of} ({now - t0:.0f} s)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    return advance


def stage_progress(bar: Progress, label: str, total: int | None) -> Callable[[], None]:
    """One stage's advance: a task of the live `bar` on a terminal (started here, so a refused job draws
    nothing), plain lines (log_stage) on a log or a pipe, where the bar would print nothing until the end."""
    if not err_console.is_terminal:
        return log_stage(label, total)
    bar.start()
    task = bar.add_task(label, total=total)
    return lambda: bar.advance(task)


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DFlashQuantError (and Ctrl-C) into a one-line message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
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
