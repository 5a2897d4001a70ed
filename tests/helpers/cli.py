"""The `olmo-ctl` command line in this process.

`invoke(*args)` calls the entry point `python -m olmo_ctl` runs (`olmo_ctl.cli.main`) with stdout and
stderr captured and the environment and working directory set for the call and restored afterwards:
the same exit code and the same bytes on each stream, without a Python start-up (and its imports) per
case. What only a real process shows (its exit status, what it imports) is tested with subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def clean_env(config_home: Path | str) -> dict[str, str]:
    """This environment without OLMO_CTL_* settings, with its own (empty) user config directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env["XDG_CONFIG_HOME"] = str(config_home)
    return env


@dataclass
class Result:
    """What one command line did: the same fields as subprocess.CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def invoke(*args: str, env: dict[str, str] | None = None, cwd: Path | str = ROOT) -> Result:
    """`olmo-ctl ARGS` in this process. `env` is the whole environment of the call (None: this one)."""
    from olmo_ctl import storage
    from olmo_ctl.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with _environment(dict(os.environ) if env is None else env):
        storage.reset_clients()  # a client made for another environment must not be reused
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(list(args))
                except SystemExit as e:  # a command that exits itself
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.chdir(here)
            storage.reset_clients()
    return Result(rc, out.getvalue(), err.getvalue())


def _interruptible() -> None:
    # A suite started in the background (`make test &`) ignores SIGINT, and a child inherits that:
    # the command under test gets Ctrl-C's default, as at a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """`python -m olmo_ctl ARGS` as a real process (text pipes for stdout and stderr) that Ctrl-C
    (SIGINT) reaches as at a terminal. `env` is its whole environment (None: this one)."""
    return subprocess.Popen(
        [sys.executable, "-m", "olmo_ctl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ) if env is None else env,
        preexec_fn=_interruptible,
        **kw,
    )
