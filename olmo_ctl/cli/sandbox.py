"""`olmo-ctl sandbox`: serve the test cluster on localhost, configured as XPK configures a GKE cluster."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.cli.app import app


@app.command(example="olmo-ctl sandbox --kubeconfig /tmp/sandbox.kubeconfig --slices tpu7x-128=2")
def sandbox(
    kubeconfig: Annotated[
        Path,
        typer.Option(
            "--kubeconfig",
            help="Write a kubeconfig for the sandbox here "
            "(its current context points at it); it exists once the sandbox "
            "serves.",
        ),
    ],
    namespace: Annotated[str, typer.Option("--namespace", help="Namespace of the LocalQueue.")] = "default",
    queue: Annotated[str, typer.Option("--queue", help="Name of the LocalQueue.")] = "multislice-queue",
    slices: Annotated[
        list[str] | None,
        typer.Option(
            "--slices",
            help="DEVICE=N: nodes, a ResourceFlavor and quota for N slices of DEVICE (repeatable).",
        ),
    ] = None,
    priority_class: Annotated[
        list[str] | None,
        typer.Option(
            "--priority-class", help="NAME or NAME=VALUE: a Kueue WorkloadPriorityClass (repeatable)."
        ),
    ] = None,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port on 127.0.0.1 (0: a free one).")
    ] = 0,
    run_pods: Annotated[
        bool,
        typer.Option(
            "--run-pods/--no-run-pods",
            help="Run each bound pod's container command as a local process, each TPU "
            "VM as host CPU devices (default); without: pods stay Running, no "
            "program runs.",
        ),
    ] = True,
) -> None:
    """Serve a sandbox Kubernetes API with JobSet and Kueue on localhost until SIGTERM or Ctrl-C.

    Configured as XPK configures a GKE cluster; its pods run as local processes, so GKE mode runs on
    this machine. Exit codes: 0 stopped, 2 bad input.
    """
    from olmo_ctl.core.config import resolve_settings
    from olmo_ctl.testing.sandbox import Sandbox, check_kubeconfig_path, parse_priority_classes, parse_slices

    resolve_settings(namespace=namespace, queue=queue)  # the names, checked as every command checks them
    check_kubeconfig_path(kubeconfig)
    devices = parse_slices(slices or ())
    classes = parse_priority_classes(priority_class or ())
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    runner = None
    if run_pods:
        from olmo_ctl.testing.pod_processes import ProcessRunner

        def say(line: str) -> None:
            sys.stderr.write(f"sandbox: {line}\n")
            sys.stderr.flush()

        runner = ProcessRunner(log=say)
    sb = Sandbox(
        namespace=namespace, queue=queue, slices=devices, priority_classes=classes, port=port, runner=runner
    )
    try:
        sb.start()
        try:
            sb.write_kubeconfig(kubeconfig)
        except OSError as e:
            from olmo_ctl.core.errors import BadInput

            raise BadInput(f"cannot write --kubeconfig `{kubeconfig}`: {e.strerror}") from None
        what = ", ".join(f"{n} x {d}" for d, n in devices.items()) or "no TPU slices"
        what += "; pods run as local processes" if run_pods else "; pods run no program"
        sys.stderr.write(
            f"sandbox serving at {sb.url} ({what}; LocalQueue {namespace}/{queue})\n"
            f"kubeconfig: {kubeconfig} (context olmo-ctl-sandbox)\n"
            f"try: KUBECONFIG={kubeconfig} olmo-ctl doctor\n"
        )
        sys.stderr.flush()
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        sys.stderr.write("sandbox stopped\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
        sb.stop()
        try:
            kubeconfig.unlink()
        except OSError:
            pass
