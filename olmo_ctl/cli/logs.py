"""`olmo-ctl logs`: an attempt's log (local processes or GKE pods), once or followed."""

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.options import SiteFlags, note, site_options
from olmo_ctl.cli.run_arg import RunArg, open_run
from olmo_ctl.core.errors import BadInput


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

    Example: olmo-ctl logs olmo3-7b-s1 --attempt 3 --host 1 -f

    Exit codes: 0 ok, 2 no such run, attempt or host, 3 cluster or storage unreachable, 130 Ctrl-C
    (with -f; the attempt keeps running).
    """
    from olmo_ctl.backends import backend_class
    from olmo_ctl.observe.logs import attempt_handle, follow, read_attempt_log

    if interval <= 0:
        raise BadInput(f"--interval {interval:g} must be positive")
    if follow_ and output != Output.table:
        raise BadInput("-f prints lines as they come", f"leave out -o {output.value}, or -f")
    rundir, settings, backend = open_run(run, site)
    handle = attempt_handle(rundir, attempt)
    cls = backend_class(handle.backend)  # the backend that made the attempt reads its log
    if not isinstance(backend, cls):
        backend = cls.from_settings(settings)
    if not follow_:
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

    skip = {"n": 0}
    if tail is not None:  # start with the last `tail` lines of what is there now
        _, now = backend.read_log(handle, host)
        skip["n"] = max(0, len(now) - tail)

    def emit(line: str) -> None:
        if skip["n"]:
            skip["n"] -= 1
            return
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def switched(src: str) -> None:
        skip["n"] = 0
        note(f"now reading {src}")

    follow(backend, handle, emit, host=host, poll_s=interval, on_source=switched)
