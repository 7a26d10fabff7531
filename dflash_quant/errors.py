"""One exception type for user-facing problems: the CLI prints its message on one line and exits 1 or 2."""


class DFlashQuantError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    exit_code = 1


class UsageError(DFlashQuantError):
    """Bad arguments (exit code 2, like Typer's own usage errors)."""

    exit_code = 2
