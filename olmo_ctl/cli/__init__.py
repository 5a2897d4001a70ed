"""`olmo-ctl` entry point: registers the command modules and maps errors to exit codes.

Exit codes: 0 success, 1 run failed, 2 bad input, 3 unreachable, 4 gave up, 124 timed out,
130 interrupted. A user mistake prints one line (`error: ...`) and never a traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # checked against the typer of constraints.txt, which vendors click
    from typer._click import exceptions as click_exc
else:
    try:  # typer >= 0.26 vendors click
        from typer._click import exceptions as click_exc
    except ImportError:  # pragma: no cover
        from click import exceptions as click_exc

from olmo_ctl.cli.app import app
from olmo_ctl.core.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, Interrupted, OlmoCtlError

# The module that registers each command on `app` when imported. `olmo-ctl NAME ...` imports only
# NAME's module: the others' imports and typer's building of their options were a third of a dry-run's
# wall time. Anything else (the top-level help, an option before the command, an unknown name, shell
# completion) imports them all. tests/test_cli_conventions.py checks this table against the modules.
COMMAND_MODULES = {
    "amend": "amend",
    "compare": "compare",
    "config": "config",
    "convert": "convert",
    "data": "data",
    "devices": "devices",
    "doctor": "doctor",
    "eval": "evaluate",
    "generate": "generate",
    "logs": "logs",
    "monitor": "monitor",
    "parity": "parity",
    "plan": "plan",
    "preflight": "preflight",
    "recipes": "recipes",
    "resize": "resize",
    "resume-until-done": "resume",
    "runs": "runs",
    "sandbox": "sandbox",
    "smoke": "smoke",
    "stop": "stop",
    "submit": "submit",
    "surgery": "surgery",
    "verify": "verify",
}


def load_commands(args: list[str] | None = None):
    """`app` with the command `args` start with registered, or every command when they start with no
    known command name (no arguments: every command)."""
    module = COMMAND_MODULES.get(args[0]) if args else None
    for name in [module] if module else sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"olmo_ctl.cli.{name}")
    return app


def usage_line(message: str) -> str:
    """Click's usage error as the start of one line that ends in `see ...`: "No such command 'x'."
    -> "No such command 'x'; see", "... Did you mean 'resize'?" -> "...; did you mean 'resize'? see"."""
    msg = " ".join(message.split()).rstrip(".")
    head, sep, guess = msg.partition(". Did you mean ")
    if sep:
        return f"{head}; did you mean {guess} see"
    return f"{msg}; see"


# What a Ctrl-C that no command caught says (one that starts or follows something says what it left).
UNCAUGHT_INTERRUPT = "olmo-ctl stopped before the command finished"


# The commands that work without the cluster and storage a shell's environment names.
NEEDS_NO_CLUSTER = frozenset({"sandbox", "config", "devices", "recipes", "plan", "--help", "-h", "--version"})


def sandbox_gone() -> OlmoCtlError | None:
    """Bad input when this shell's environment is a sandbox's (`. sandbox.kubeconfig.env` sets
    OLMO_CTL_SANDBOX_PID) and that sandbox has stopped: said at once, where its API and storage would
    be waited on for minutes before "unreachable"."""
    import os

    from olmo_ctl.core.errors import BadInput

    pid = os.environ.get("OLMO_CTL_SANDBOX_PID", "").strip()
    if not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        pass
    except OSError:  # another user's process of that number: the sandbox is there
        return None
    else:
        return None
    from olmo_ctl.sandbox.gcs_emulator import ENV_KEYS

    names = " ".join(["KUBECONFIG", *ENV_KEYS])
    return BadInput(
        f"the sandbox this shell's environment points at (OLMO_CTL_SANDBOX_PID={pid}) has stopped",
        f"start it again (`olmo-ctl sandbox ...`), or unset its environment: unset {names}"
        " $(env | grep -o '^OLMO_CTL_[A-Z_]*')",
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    load_commands(args)
    try:
        if args and args[0] not in NEEDS_NO_CLUSTER and (gone := sandbox_gone()) is not None:
            raise gone
        rv = app(args=args, prog_name="olmo-ctl", standalone_mode=False)
    except Interrupted as e:  # Ctrl-C: one line saying what was left, from whoever caught it
        sys.stderr.write(f"interrupted: {e.one_line() or UNCAUGHT_INTERRUPT}\n")
        return e.exit_code
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        return e.exit_code
    except click_exc.NoArgsIsHelpError as e:  # `olmo-ctl` or a group alone: its help, as -h shows it
        sys.stdout.write(e.format_message() + "\n")
        return 0
    except click_exc.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "olmo-ctl"
        sys.stderr.write(f"error: {usage_line(e.format_message())} `{cmd} --help`\n")
        return EXIT_BAD_INPUT
    except typer.Abort:
        sys.stderr.write("aborted\n")
        return EXIT_INTERRUPTED
    except typer.Exit as e:
        return e.exit_code
    except click_exc.ClickException as e:
        sys.stderr.write(f"error: {' '.join(e.format_message().split())}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted: {UNCAUGHT_INTERRUPT}\n")
        return EXIT_INTERRUPTED
    return rv if isinstance(rv, int) else 0


def entry() -> None:
    rc = main()
    if rc == EXIT_INTERRUPTED:
        # A Ctrl-C that landed in code run from a string (exec: a dataclass's generated methods, a
        # first import) leaves CPython 3.11's "unhandled KeyboardInterrupt" flag set even though it was
        # handled, and the interpreter would then kill itself with SIGINT instead of exiting 130. Each
        # evaluation of a string clears the flag first.
        exec("None")
    sys.exit(rc)
