"""The trainer's exit code by cause: which exception ends an attempt with which code, and the line it prints.

0 done, 143 stopped by SIGTERM after checkpointing (both returned by the loop), 1 a failure proven
deterministic (non-finite loss, optimizer dtype, an inconsistent checkpoint: restarting would fail
again), 2 bad input (a GCS 403 too: the same identity would be refused again), 3 everything else
(storage, network, a lost peer, a runtime error nobody has proven deterministic): the attempt is
restarted, and the supervisor's crash-loop rule stops a run that exits 3 at the same step again and
again. The codes themselves are in core/contracts.py; what is transient, in core/transient.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from olmo_ctl.core.contracts import EXIT_FAILED, EXIT_RESTART, USER_EXIT_CODES
from olmo_ctl.core.errors import OlmoCtlError
from olmo_ctl.core.transient import is_transient


class TrainingFailed(OlmoCtlError):
    """Deterministic failure in training (NaN loss, ...): restarting would fail again. Exit 1."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, exit_code=EXIT_FAILED)


def exit_code_of(run: Callable[[], int]) -> int:
    """`run()`'s own code, or the code of the exception it raised (with one `error:` line on stderr)."""
    try:
        return run()
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        if e.exit_code == EXIT_RESTART:
            return EXIT_RESTART
        return e.exit_code if e.exit_code in USER_EXIT_CODES else EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - every other error: restartable by rule (errors by cause)
        import traceback

        from olmo_ctl.storage import describe_permission_error

        denied = describe_permission_error(e)
        if denied is not None:  # GCS said no: the same identity would be refused again
            sys.stderr.write(f"error: {denied.one_line()}\n")
            return denied.exit_code

        traceback.print_exc()
        what = (
            "storage, network or a peer host unreachable"
            if is_transient(e)
            else "an unexpected runtime error, not proven deterministic"
        )
        sys.stderr.write(
            f"error: {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "exit 3: the attempt can be restarted\n"
        )
        return EXIT_RESTART
