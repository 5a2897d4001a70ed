"""Submit one attempt of a run: create the run if it is new, render the attempt, submit, journal it.

The run's identity is its `run.yaml` (resolved recipe + data fingerprint), written once: a later
attempt with another recipe or other data is refused, and a later attempt on another device is a
resize (`olmo-ctl resize`), never a silent change. Attempt numbers come from the journal. An
attempt is never submitted while the run's previous attempt is still live.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from olmo_ctl.backends.base import Attempt, Handle
from olmo_ctl.core.errors import BadInput
from olmo_ctl.rundir import RunDir


def make_backend(settings: Any, run_root: str | None = None):
    if settings.backend == "local":
        from olmo_ctl.backends.local import LocalBackend

        return LocalBackend(run_root or settings.run_root)
    from olmo_ctl.backends.gke import GKEBackend

    return GKEBackend(settings=settings)


def data_fingerprint(recipe) -> str:
    """The fingerprint the trainer's loader checks (file names and sizes, seq_len, data seed)."""
    from olmo_ctl.data.files import dataset_fingerprint, resolve_files

    return dataset_fingerprint(resolve_files(recipe, "train"), recipe.train.seq_len, recipe.data.seed)


def ensure_run(rundir: RunDir, recipe, device: str | None) -> dict:
    """Create run.yaml for a new run; for an existing one check that `recipe` (if given) is its recipe."""
    if not rundir.exists():
        if recipe is None:
            raise BadInput(f"run `{rundir.name}` does not exist at {rundir.path}",
                           "create it: pass --recipe or --stage (and --device)")
        if device is None:
            raise BadInput(f"run `{rundir.name}` is new: it needs a device", "pass --device, e.g. cpu-1 or tpu7x-128")
        return rundir.create_run(recipe.to_dict(), recipe.fingerprint(), data_fingerprint(recipe), device)
    if recipe is not None:
        rundir.check_matches(recipe.fingerprint(), data_fingerprint(recipe))
    return rundir.read_run()


def run_device(rundir: RunDir, requested: str | None) -> str:
    """The device the next attempt uses: the last attempt's (or run.yaml's); another one is a resize."""
    last = rundir.last_attempt()
    current = (last or {}).get("device") or rundir.read_run().get("device")
    if requested is not None and current is not None and requested != current:
        raise BadInput(f"run `{rundir.name}` runs on {current}, not {requested}",
                       f"to move it, use `olmo-ctl resize {rundir.name} --device {requested}` (same global batch)")
    return requested or current


def live_attempt(rundir: RunDir, backend) -> tuple[Handle | None, Any]:
    """The run's live attempt (handle, status), from the journal's last submission or the backend."""
    last = rundir.last_attempt()
    if last and isinstance(last.get("handle"), dict) and last["handle"].get("backend") == backend.name:
        h = Handle.from_dict(last["handle"])
        st = backend.status(h)
        if st.state.live:
            return h, st
    h = backend.find_live(rundir.name)
    if h is not None:
        st = backend.status(h)
        if st.state.live:
            return h, st
    return None, None


def submit_next(rundir: RunDir, backend, device: str, reason: str, extra_args: tuple[str, ...] = (),
                attempt: int | None = None, t: float | None = None) -> Handle:
    """Render and submit the run's next attempt and journal `submitted` (the caller checked liveness)."""
    n = attempt if attempt is not None else rundir.next_attempt_number()
    committed = rundir.committed_step()
    request = backend.render(Attempt(rundir.name, rundir.path, n, device, None, tuple(extra_args)))
    handle = backend.submit(request)
    rundir.append("submitted", attempt=n, device=device, committed_step=committed, reason=reason,
                  handle=handle.to_dict(), backend=backend.name, t=t)
    return handle


def submit_attempt(recipe=None, device=None, plan=None, settings=None, run: str | None = None,
                   run_dir: str | None = None, attempt: int | None = None, output_manifest=None,
                   backend=None, out: Callable[[str], None] | None = None,
                   extra_args: tuple[str, ...] = ()) -> Handle:
    """`olmo-ctl submit`: create the run (or its next attempt) and submit it; returns once submitted."""
    out = out or (lambda s: sys.stdout.write(s + "\n"))
    dev_name = getattr(device, "name", device)
    rundir = RunDir(run_dir, run)
    backend = backend or make_backend(settings, run_dir.rsplit("/", 1)[0] if run_dir else None)
    new = not rundir.exists()
    ensure_run(rundir, recipe, dev_name)
    dev_name = run_device(rundir, dev_name)
    lease = rundir.acquire_lease(ttl_s=120)  # a supervisor running this run refuses us (exit 2)
    try:
        h, st = live_attempt(rundir, backend)
        if h is not None:
            raise BadInput(f"attempt {h.attempt} of run `{rundir.name}` is still {st.state.value} ({h.name})",
                           f"supervise it with `olmo-ctl resume-until-done {rundir.name}`; "
                           "a second attempt would write the same checkpoints")
        last = rundir.last_attempt()
        if last and isinstance(last.get("handle"), dict) and last["handle"].get("backend") == backend.name:
            # An ended attempt is deleted first: Kueue would requeue an evicted JobSet next to its successor.
            backend.stop(Handle.from_dict(last["handle"]), graceful=False)
        if output_manifest is not None and backend.name == "gke":
            from olmo_ctl.backends.jobset import dump_yaml

            n = attempt if attempt is not None else rundir.next_attempt_number()
            output_manifest.write_text(dump_yaml(backend.render(Attempt(rundir.name, rundir.path, n, dev_name))))
        handle = submit_next(rundir, backend, dev_name, "first attempt" if new else "submitted by hand",
                             extra_args, attempt=attempt)
    finally:
        rundir.release_lease(lease)
    root = settings.run_root if settings is not None else rundir.path.rsplit("/", 1)[0]
    out(f"run directory: {rundir.path}")
    out(f"attempt {handle.attempt} of run `{rundir.name}` submitted on {dev_name} ({backend.name}: {handle.name})")
    out("next: supervise it until the final step with")
    out(f"  olmo-ctl resume-until-done {rundir.name} --run-root {root} --backend {backend.name}")
    out(f"  olmo-ctl monitor {rundir.path}")
    return handle
