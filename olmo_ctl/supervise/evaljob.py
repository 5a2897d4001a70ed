"""`olmo-ctl eval --backend gke` and `verify --backend gke`: one checkpoint's evaluation (or a KL
between two) as a job of its own on a slice.

An eval job is an attempt of a run of its own, `eval-<digest>`, whose run directory is the job's output
directory (`--out`, default `<run root>/eval-jobs/eval-<digest>`), never a run's (`check_out`: its journal
would number the job's attempts as the run's, and the run would go on on the job's device). It renders from the launch templates
like any attempt (the same image, the trainer's entry point with `--eval SPEC`, its own JobSet, queued
by Kueue) and is sent through the backend's one submit path. The trainer evaluates SPEC on the slice's
devices, one process per host, each reading only its devices' shards of the checkpoint, and process 0
writes `<out>/result.json` (`{spec, devices, report}`, checkpoints/evaluate.py).

The digest is of the spec and `--out`, so asking for the same evaluation again is the same job:
  - a `result.json` of the same spec in the output directory is read, and nothing is submitted;
  - a live JobSet of the job (after Ctrl-C or --timeout) is waited for again, not doubled;
  - otherwise the next attempt is submitted (`<out>/journal.jsonl` numbers them).
Waiting for capacity is not failing: a queued job is waited for until the timeout. An attempt that
ended without a result for a reason of the infrastructure (preempted, an infrastructure failure, its
JobSet deleted) is submitted again, up to `MAX_ATTEMPTS` in all; a failure of the evaluation (the
trainer's exit 1 or 2) is not retried.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle, State, Target
from olmo_ctl.checkpoints.evaluate import RESULT_FILE, EvalSpec
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import EXIT_GAVE_UP, EXIT_RUN_FAILED, EXIT_TIMEOUT, BadInput, OlmoCtlError
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.rundir import EVAL_JOB_REASON, RunDir
from olmo_ctl.storage import is_gcs, join, store_for
from olmo_ctl.supervise.attempts import prepare, submit_next
from olmo_ctl.supervise.policy import RetryPolicy

JOB_PREFIX = "eval-"
JOBS_DIR = "eval-jobs"  # under the run root: the default output directories
MAX_ATTEMPTS = 3  # per command
MAX_RESTARTS = 3  # of one attempt's JobSet, which its own failure policy may not bound (exit 3)
SUBMITTED = "submitted"


def job_name(spec: EvalSpec, device: str, out: str | None, run_root: str) -> str:
    """`eval-<10 hex digits>` of the spec, the device and where the result goes (`--out`, else the
    run root, under which the default output directory is named for the job)."""
    where = f"out={out.rstrip('/')}" if out else f"root={run_root.rstrip('/')}"
    digest = hashlib.sha256(f"{spec.to_json()}\n{device}\n{where}".encode()).hexdigest()[:10]
    return JOB_PREFIX + digest


def out_dir(name: str, out: str | None, run_root: str) -> str:
    return out.rstrip("/") if out else join(run_root, JOBS_DIR, name)


def _seen_by_pods(path: str) -> bool:
    return is_gcs(path) or path.startswith("builtin://")


PODS_HINT = "copy it to gs://BUCKET/... (the pods read only GCS)"


def check_slice(device: Device, spec: EvalSpec) -> None:
    """What an eval job needs before anything is read: a TPU slice (one process per host, each reading
    only its own devices' shards of the checkpoint) and a checkpoint on GCS (the pods cannot see this
    machine's files)."""
    device.check_launchable("an eval job")
    if not device.is_tpu:
        raise BadInput(
            f"`{device.name}` is a local device; an eval job runs on a TPU slice",
            "--device v5p-8 or tpu7x-8, or --backend local for this machine's CPU devices",
        )
    if not is_gcs(spec.checkpoint):
        raise BadInput(
            f"checkpoint `{spec.checkpoint}` is on this machine, which the pods cannot see", PODS_HINT
        )
    if spec.recipe is not None:
        from olmo_ctl.core.recipe import shipped_recipes

        if spec.recipe not in shipped_recipes():
            raise BadInput(
                f"--recipe `{spec.recipe}` is not a shipped recipe, and the pods cannot read this machine's files",
                f"a shipped recipe's name ({', '.join(sorted(shipped_recipes()))}), or the run's own run.yaml",
            )


def check_paths(recipe: Recipe, out: str) -> None:
    """Every other path the job reads (the tokenizer, the LM files) and the one it writes on GCS."""
    if recipe.eval.downstream.tasks and not _seen_by_pods(recipe.data.tokenizer):
        raise BadInput(
            f"tokenizer `{recipe.data.tokenizer}` is on this machine, which the pods cannot see", PODS_HINT
        )
    lm = recipe.eval.lm
    paths = [p.replace("{root}", recipe.data.root) for s in lm.sets for p in s.files]
    if lm.mix:
        paths.append(recipe.data.root)
    for p in paths:
        if not _seen_by_pods(p):
            raise BadInput(f"LM file `{p}` is on this machine, which the pods cannot see", PODS_HINT)
    if not is_gcs(out):
        raise BadInput(
            f"the eval job's output directory `{out}` is not on GCS",
            "--out gs://BUCKET/PREFIX, or a gs:// run root (--run-root)",
        )


def check_out(out: str) -> None:
    """The job's output directory is its own: BadInput for one that holds a run (run.yaml, a journal
    that is not an eval job's, checkpoints, ingredients.yaml). An eval job journals its attempts there
    (`submitted`), and a run reads its attempts, and the device of its next one, from its journal."""
    rd = RunDir(out)
    found = (["run.yaml"] if rd.exists() else []) + [t for t in rd.traces() if t != "an eval job's journal"]
    if not any(t.startswith("checkpoints") for t in found) and rd.committed_steps():
        found.append("checkpoints")
    if found:
        raise BadInput(
            f"--out {out} is a run directory (it holds {', '.join(found)}): an eval job journals its "
            "attempts in its output directory, where the run would take them for its own",
            "give the job a directory of its own, e.g. --out gs://BUCKET/evals/NAME, or leave --out out "
            f"(<run root>/{JOBS_DIR}/<job>)",
        )


def result_path(out: str) -> str:
    return join(out, RESULT_FILE)


@dataclass(frozen=True)
class EvalJob:
    """One eval job, resolved: its spec, the recipe the evaluators read, where it runs and writes."""

    name: str
    spec: EvalSpec
    recipe: Recipe  # checkpoints/evaluate.check's, for the device's count
    device: Device
    out: str
    settings: Settings

    def attempt(self, backend: Backend, n: int, *, render_only: bool = False) -> Attempt:
        """Attempt `n` of the job, made and validated as every attempt is (`attempts.prepare`)."""
        return prepare(
            backend,
            self.name,
            self.out,
            n,
            Target(self.device),
            self.recipe,
            settings=self.settings,
            extra_args=("--eval", self.spec.to_json()),
            render_only=render_only,
        )


def kept_result(out: str, spec: EvalSpec) -> dict | None:
    """`<out>/result.json` when it holds this spec's evaluation, else None."""
    store = store_for(out)
    path = result_path(out)
    if not store.exists(path):
        return None
    try:
        record = json.loads(store.read_text(path))
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("spec") == spec.to_dict() else None


def _next_attempt(rd: RunDir) -> int:
    return 1 + max((int(r["attempt"]) for r in rd.journal() if r.get("event") == SUBMITTED), default=-1)


def run_job(
    backend: Backend,
    job: EvalJob,
    *,
    timeout_s: float,
    poll_s: float = 5.0,
    backoff_s: float | None = None,
    log: Callable[[str], None] = lambda _: None,
    cancel: threading.Event | None = None,
) -> tuple[dict, bool]:
    """(the job's `result.json` record, whether it was already there). Raises OlmoCtlError: 2 the
    evaluation's bad input, 1 its failure, 4 gave up after `MAX_ATTEMPTS`, 124 the timeout (the job
    goes on; the same command waits for it again); Cancelled once `cancel` is set (the job goes on)."""
    kept = kept_result(job.out, job.spec)
    if kept is not None:
        return kept, True
    check_out(job.out)  # whoever made the job: never into a run's directory
    backend.checks(job.attempt(backend, 0))
    rd = RunDir(job.out, job.name)
    # The supervisor's retry rule: the backend's base backoff (or `backoff_s`), doubling per failure.
    policy = RetryPolicy(
        backoff_base_s=backend.retry_backoff_s if backoff_s is None else backoff_s, max_retries=MAX_ATTEMPTS
    )
    deadline = time.monotonic() + timeout_s
    live = backend.live_attempts(job.name, job.out)
    handle = live[0] if live else None
    if handle is not None:
        log(f"eval job {handle.name}: waiting for it again")
    tries = 0
    while True:
        if handle is None:
            handle = submit_next(
                rd,
                backend,
                job.attempt(backend, _next_attempt(rd)),
                EVAL_JOB_REASON,
                committed_step=0,
                numbered=True,
            )
            log(f"eval job {handle.name} submitted ({job.device.name}); it writes {result_path(job.out)}")
        tries += 1
        st = _wait(backend, handle, deadline, poll_s, log, cancel)
        record = kept_result(job.out, job.spec)  # also after an end that came once it was written
        if record is not None:
            return record, False
        if st.state == State.SUCCEEDED:
            raise OlmoCtlError(
                f"eval job {handle.name} succeeded but {result_path(job.out)} holds no result of it",
                backend.hint(st),
                EXIT_RUN_FAILED,
            )
        why = f"eval job {handle.name} {st.state.value}: {st.reason or 'no reason given'}"
        last = f" (last line: {st.last_log_lines[-1]})" if st.last_log_lines else ""
        if st.state == State.FAILED_USER:
            if st.exit_code == 2:
                raise BadInput(why + last, "the trainer refused the evaluation; fix what it names")
            raise OlmoCtlError(why + last, backend.hint(st), EXIT_RUN_FAILED)
        if tries >= policy.max_retries:
            raise OlmoCtlError(
                why + last, f"gave up after {tries} attempts; the same command tries again", EXIT_GAVE_UP
            )
        wait = policy.backoff_s(tries)
        log(f"{why}; submitting it again in {wait:g} s")
        _sleep_until(min(deadline, time.monotonic() + wait), deadline, handle, cancel)
        handle = None


class Cancelled(Exception):
    """The wait for an eval job was given up (`run_jobs` after Ctrl-C); the job goes on."""


def _pause(seconds: float, cancel: threading.Event | None) -> None:
    """Sleep `seconds`, or until `cancel` is set (then Cancelled)."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Cancelled()


def _sleep_until(t: float, deadline: float, handle: Handle, cancel: threading.Event | None = None) -> None:
    while time.monotonic() < t:
        _pause(min(1.0, t - time.monotonic()), cancel)
    if time.monotonic() >= deadline:
        raise OlmoCtlError(
            f"timed out before submitting eval job {handle.name} again; no attempt of it is running",
            "run the same command again to submit it",
            EXIT_TIMEOUT,
        )


def _timeout(handle: Handle) -> OlmoCtlError:
    return OlmoCtlError(
        f"timed out waiting for eval job {handle.name}; it goes on",
        "run the same command again to wait for its result",
        EXIT_TIMEOUT,
    )


def _wait(
    backend: Backend,
    handle: Handle,
    deadline: float,
    poll_s: float,
    log: Callable[[str], None],
    cancel: threading.Event | None = None,
) -> AttemptStatus:
    """Poll until the attempt is terminal, each change of state logged once with its reason. An
    attempt that cannot run as it is (a configuration error the cluster reports: an image that does
    not exist, a refused pod; a Kueue deactivation) or whose pod restarted `MAX_RESTARTS` times (the
    trainer's restartable exit 3 does not end a JobSet) is stopped, and that is the end: it would
    hold the slice until the timeout."""
    last: State | None = None
    while True:
        st = backend.status(handle)
        if st.state != last:
            log(f"eval job {handle.name}: {st.state.value}" + (f" ({st.reason})" if st.reason else ""))
            last = st.state
        if st.state.terminal:
            return st
        if st.config_error or st.deactivated:
            backend.stop(handle, graceful=False)
            why = st.config_error or f"its Workload was deactivated ({st.deactivated})"
            raise BadInput(f"eval job {handle.name} cannot run: {why}", "fix it, then run the same command")
        restarts = st.restarts
        if restarts >= MAX_RESTARTS:
            backend.stop(handle, graceful=False)
            lines = backend.logs(handle, 5)
            tail = f" (last line: {lines[-1]})" if lines else ""
            raise OlmoCtlError(
                f"eval job {handle.name} restarted {restarts} times without a result{tail}",
                f"{backend.hint(st)}; the same command submits it again",
                EXIT_GAVE_UP,
            )
        if time.monotonic() >= deadline:
            raise _timeout(handle)
        _pause(min(poll_s, max(0.0, deadline - time.monotonic())), cancel)


def resolve(spec: EvalSpec, device: Device, settings: Settings, out: str | None = None) -> EvalJob:
    """The eval job of `spec` on `device`, checked as `eval --backend gke` checks one (what the pods
    cannot see, the evaluation's refusals) before anything is submitted. A KL spec's two sides are
    checkpoints the pods read too."""
    import importlib.util

    from olmo_ctl.checkpoints import evaluate as E

    check_slice(device, spec)
    ckpt = E.open_checkpoint(spec.checkpoint, spec.recipe)
    if spec.kl is not None:
        for side in ("reference", "run"):
            path = spec.kl[side][0]
            if not is_gcs(path):
                raise BadInput(
                    f"checkpoint `{path}` is on this machine, which the pods cannot see", PODS_HINT
                )
        recipe = E.kl_recipe(spec, ckpt, device.devices)
    else:
        known = importlib.util.find_spec("olmo_eval") is not None
        recipe = E.check(ckpt, devices=device.devices, known_labels=known, **spec.options())
    name = job_name(spec, device.name, out, settings.run_root)
    job = EvalJob(name, spec, recipe, device, out_dir(name, out, settings.run_root), settings)
    check_paths(recipe, job.out)
    check_out(job.out)
    return job


def run_jobs(
    jobs: dict[str, EvalJob],
    make_backend: Callable[[], Backend],
    *,
    timeout_s: float,
    poll_s: float = 5.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict]:
    """{key: the job's report} of every job, each run as `run_job` runs one (a kept result read back,
    nothing submitted), all at once: each waits in a thread of its own, with a backend of its own.
    The first failure is raised once every job has ended or timed out; the others' results are kept
    in their output directories, so the same command reads them back. Keys whose jobs are one job
    (the same spec on the same slice: a run verified against itself) share one. The threads are
    daemons and the wait is interruptible: on Ctrl-C every wait is cancelled (and silent) and the
    threads end before KeyboardInterrupt is raised on, so the process exits cleanly; the jobs go on."""
    by_name = {job.name: job for job in jobs.values()}
    reports: dict[str, dict] = {}
    errors: dict[str, BaseException] = {}
    cancel = threading.Event()

    def said(line: str) -> None:
        if not cancel.is_set():
            log(line)

    def one(job: EvalJob) -> None:
        try:
            record, _ = run_job(
                make_backend(), job, timeout_s=timeout_s, poll_s=poll_s, log=said, cancel=cancel
            )
            reports[job.name] = record["report"]
        except BaseException as e:  # noqa: BLE001 - handed to the caller, in the jobs' order
            errors[job.name] = e

    threads = [threading.Thread(target=one, args=(job,), daemon=True) for job in by_name.values()]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)  # short waits: a KeyboardInterrupt reaches this thread between them
    except KeyboardInterrupt:
        cancel.set()
        for t in threads:  # each ends at its next pause, or after the request in flight
            t.join(30.0)
        raise
    for name in by_name:
        if name in errors:
            raise errors[name]
    return {key: reports[job.name] for key, job in jobs.items()}
