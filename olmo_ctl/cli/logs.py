"""`olmo-ctl logs`: an attempt's log (local processes or GKE pods), once or followed.

Following (`-f`) runs in a thread of its own while the main thread waits for it or for Ctrl-C, which
only sets a flag: wherever the interrupt lands (a status call, a pod log response being read or
closed, the sleep between reads), the follower is never broken off inside a library, and the command
ends with one `interrupted: ...` line and exit 130.
"""

import signal
import sys
import threading
from collections.abc import Callable
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.options import SiteFlags, note, site_options
from olmo_ctl.cli.run_arg import RunArg, open_run
from olmo_ctl.core.errors import BadInput, Interrupted

# How long an interrupted follower gets to finish the call it is in before the command ends anyway.
FOLLOWER_GRACE_S = 1.0


@app.command(example="olmo-ctl logs olmo3-7b-s1 --attempt 3 --host 1 -f")
@site_options(roles=("runs", "cluster"))
def logs(
    run: RunArg,
    attempt: Annotated[
        int | None, typer.Option("--attempt", min=1, help="Attempt number (default: the newest).")
    ] = None,
    host: Annotated[
        int | None,
        typer.Option(
            "--host",
            min=0,
            help="One host's lines: a process of a cpu-PxD attempt, or the H-th TPU VM (pod) of a GKE "
            "attempt (default: every host locally; the failed pod, else host 0, on GKE).",
        ),
    ] = None,
    follow_: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the attempt ends.")
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", min=0, help="Only the last N lines (with -f: to start with).")
    ] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between reads with -f.")] = 2.0,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Print an attempt's log: the local backend's logs/attempt-N.log, or a GKE attempt's pod log.

    Exit codes: 0 ok, 2 no such run, attempt or host, 3 cluster or storage unreachable, 130 Ctrl-C
    (with -f; the attempt keeps running).
    """
    from olmo_ctl.backends import backend_class
    from olmo_ctl.observe.logs import attempt_handle, follow, read_attempt_log

    if interval <= 0:
        raise BadInput(f"--interval {interval:g} must be positive")
    if follow_ and output != Output.table:
        raise BadInput("-f prints lines as they come", f"leave out -o {output.value}, or -f")

    def open_attempt():
        rundir, settings, backend = open_run(run, site)
        handle = attempt_handle(rundir, attempt)
        cls = backend_class(handle.backend)  # the backend that made the attempt reads its log
        if not isinstance(backend, cls):
            backend = cls.from_settings(settings)
        return rundir, handle, backend

    if not follow_:
        rundir, handle, backend = open_attempt()
        got = read_attempt_log(rundir, backend, handle, host)
        lines = got.lines[-tail:] if tail else ([] if tail == 0 else got.lines)
        if output != Output.table:
            print_data(
                {
                    "run": rundir.name,
                    "attempt": got.attempt,
                    "host": host,
                    "source": got.where,
                    "lines": lines,
                },
                output,
            )
            return
        if got.note:
            note(got.note)
        for ln in lines:
            sys.stdout.write(ln + "\n")
        return

    following: dict = {}  # what the follower has found: the run's name and the attempt's number

    def follow_attempt(gate: _Gate) -> None:
        rundir, handle, backend = open_attempt()
        following.update(run=rundir.name, attempt=handle.attempt)
        skip = {"n": 0}
        if tail is not None:  # start with the last `tail` lines of what is there now
            _, now = backend.read_log(handle, host)
            skip["n"] = max(0, len(now) - tail)

        def emit(line: str) -> None:
            if skip["n"]:
                skip["n"] -= 1
                return
            gate.line(line)

        def switched(src: str) -> None:
            skip["n"] = 0
            gate.note(f"now reading {src}")

        follow(backend, handle, emit, host=host, poll_s=interval, sleep=gate.sleep, on_source=switched)

    def left() -> str:
        again = f"olmo-ctl logs {run}" + "".join(
            f" {flag} {v}" for flag, v in (("--attempt", attempt), ("--host", host)) if v is not None
        )
        if "attempt" not in following:
            return f"stopped before following began (nothing was stopped); follow with: {again} -f"
        return (
            f"stopped following attempt {following['attempt']} of run `{following['run']}` "
            f"(nothing was stopped: the attempt goes on); follow it again with: {again} -f"
        )

    until_ctrl_c(follow_attempt, left)


class _Stopped(BaseException):
    """The follower's way out once Ctrl-C closed its gate (never seen outside this module)."""


class _Gate:
    """What the follower prints through and sleeps on. Once closed (Ctrl-C), nothing more is printed,
    and the follower's next print or sleep ends it."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    def _open(self) -> None:
        if self._closed.is_set():
            raise _Stopped

    def line(self, text: str) -> None:
        self._open()
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def note(self, text: str) -> None:
        self._open()
        note(text)

    def sleep(self, seconds: float) -> None:
        if self._closed.wait(seconds):
            raise _Stopped


def until_ctrl_c(work: Callable[[_Gate], None], left: Callable[[], str]) -> None:
    """Run `work(gate)` in a thread while this one waits for it to end or for Ctrl-C. Ctrl-C closes
    the gate, gives the work FOLLOWER_GRACE_S to finish the call it is in, and raises Interrupted
    with `left()` (what was left and how to go on); an error of the work is raised here."""
    gate = _Gate()
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started where Ctrl-C cannot reach it
    ):
        work(gate)  # nobody closes this gate
        return
    failed: list[BaseException] = []
    done = threading.Event()
    asked: list[int] = []  # the handler only appends: it never raises inside whatever it interrupts

    def run() -> None:
        try:
            work(gate)
        except _Stopped:
            pass
        except BaseException as e:  # handed to the main thread, which raises it
            failed.append(e)
        finally:
            done.set()

    previous = signal.signal(signal.SIGINT, lambda signum, frame: asked.append(signum))
    try:
        threading.Thread(target=run, name="olmo-ctl logs -f", daemon=True).start()
        while not (done.is_set() or asked):
            done.wait(0.05)
        if asked:
            gate.close()
            done.wait(FOLLOWER_GRACE_S)
    finally:
        signal.signal(signal.SIGINT, previous)
    if asked:
        raise Interrupted(left())
    if failed:
        raise failed[0]
