"""The one error type for expected failures: a message, a hint, and the exit code the CLI uses."""

from __future__ import annotations

# Exit codes shared by every command (see README "Exit codes").
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_GAVE_UP = 4
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


class OlmoCtlError(Exception):
    """An expected failure. The CLI prints `error: <message> (<hint>)` on one line and exits `exit_code`."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        if self.hint:
            text += f"; {self.hint}"
        return " ".join(text.split())


class BadInput(OlmoCtlError):
    """A user mistake: nothing was changed. Exit 2."""


class Unreachable(OlmoCtlError):
    """Cluster or storage unreachable after retries. Exit 3."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, EXIT_UNREACHABLE)


class Interrupted(OlmoCtlError):
    """Ctrl-C, handled: the CLI prints `interrupted: <message>` as one line on stderr and exits 130. The
    message says what was left (a running attempt, run directories) and how to go on."""

    def __init__(self, message: str = "", hint: str | None = None):
        super().__init__(message, hint, EXIT_INTERRUPTED)
