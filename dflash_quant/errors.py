"""One exception type for user-facing problems (the CLI prints its message on one line and exits 1 or 2), and the
argument ranges every command checks the same way."""

import math


class DFlashQuantError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    exit_code = 1


class UsageError(DFlashQuantError):
    """Bad arguments (exit code 2, like Typer's own usage errors)."""

    exit_code = 2


def check_count(value: int | None, option: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{option} must be at least 1 (got {value})")


def check_tolerance(value: float) -> None:
    if not 0 <= value < 1:  # 1 would pass any drafter; NaN compares false everywhere
        raise UsageError(f"--tolerance must be in [0, 1) (got {value}); 0.03 allows a 3 % lower tau")


def check_temperature(value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (got {value}); use 0 for greedy")
