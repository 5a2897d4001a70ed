"""`olmo-ctl smoke`: the smoke recipe as a short run on one device, checked end to end.

Three attempts over two run directories, through the same backend interface real runs use:

  main   attempt 1  trains from scratch; once step `stop_after_step` is logged it is stopped the way a
                    preemption or `resize --now` stops it (backend.stop: SIGTERM / JobSet deletion), so the
                    trainer checkpoints its last completed step N and exits 143.
  main   attempt 2  restores checkpoint N and trains to F = N + resume_steps (exit 0, F committed).
  twin   attempt 1  the same recipe trained from scratch to F without interruption (alongside attempt 2).

Checks (each one JUnit test case, in this order):
  loss_fell             the CE loss of the last steps is clearly below that of the first steps;
  checkpoint_committed  checkpoints N and F are committed (Orbax commit marker, final name);
  forced_stop           attempt 1 exited as preempted (143 where the exit code is visible) and its
                        checkpoint is the last step it logged: no completed step was lost;
  resume_exact          the resumed steps N+1..F equal the uninterrupted twin's bit for bit
                        (same device: a lost, repeated or re-ordered batch cannot hide);
  events_readable       the event files parse without a bad record, every contract tag is there
                        for every step 1..F exactly once, and total tokens = step x tokens per step.

Exit: 0 every check passed, 1 a check failed (named), 124 the time limit passed first.

`OLMO_CTL_SMOKE_FAULT` (tests of this command only, never in a real run; comma-separated): `lr`
trains every attempt with a learning rate of 1e-9 (the loss cannot fall); `data-shift` resumes
attempt 2 one batch off (the resume is no longer exact).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.backends.base import State, Target
from olmo_ctl.core import faults as fault_knobs
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.contracts import (
    CE_LOSS_TAG,
    GRAD_NORM_TAG,
    LR_TAG,
    PPL_TAG,
    STEP_SKIPPED_TAG,
    STEP_TIME_TAG,
    TOTAL_TOKENS_PARITY_TAG,
    TOTAL_TOKENS_TAG,
    TPS_TAG,
    Z_LOSS_TAG,
    log_progress,
    primary_loss_tag,
)
from olmo_ctl.core.errors import EXIT_OK, EXIT_RUN_FAILED, EXIT_TIMEOUT, BadInput
from olmo_ctl.core.names import SMOKE_TWIN, smoke_run_name
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.observe.reader import read_scalars
from olmo_ctl.rundir import RunDir
from olmo_ctl.storage import join
from olmo_ctl.supervise.attempts import data_fingerprint, prepare, stop_and_wait, submit_next
from olmo_ctl.supervise.submit import check_attempt

CHECKS = ("loss_fell", "checkpoint_committed", "forced_stop", "resume_exact", "events_readable")
FAULT_ENV = fault_knobs.SMOKE_FAULT.name  # core/faults.py: every fault knob
FAULTS = {
    "lr": "every attempt trains with optimizer.lr=1e-9",
    "data-shift": "attempt 2 resumes one batch off",
}
BROKEN_LR = "1e-9"
# The event tags every step must carry (docs/CONTRACTS.md), and those checked per step.
STEP_TAGS = (
    CE_LOSS_TAG,
    PPL_TAG,
    Z_LOSS_TAG,
    GRAD_NORM_TAG,
    LR_TAG,
    STEP_SKIPPED_TAG,
    TOTAL_TOKENS_TAG,
    TOTAL_TOKENS_PARITY_TAG,
    TPS_TAG,
    STEP_TIME_TAG,
)
EXACT_TAGS = (CE_LOSS_TAG, Z_LOSS_TAG, GRAD_NORM_TAG, LR_TAG)
LOSS_TAG = primary_loss_tag()  # the smoke recipe trains the `lm` objective
LOSS_WINDOW = 3  # steps averaged at each end for `loss_fell`
MIN_LOSS_DROP = 0.05  # relative: the last steps' mean CE must be below 95% of the first steps'


class SmokeTimeout(Exception):
    pass


@dataclass(frozen=True)
class SmokeConfig:
    target: Target  # the device and its slices (multislice: every attempt joins N x its hosts)
    recipe: str = "smoke"
    stop_after_step: int = 5  # attempt 1 is stopped once this step is logged
    resume_steps: int = 6  # steps run past the stop by the resumed attempt and by the twin
    max_steps: int = 100  # the recipe's final step: attempt 1 must be stopped before it
    poll_s: float = 0.2
    fault: str | None = None  # comma-separated names from FAULTS

    def faults(self) -> set[str]:
        return fault_knobs.smoke_faults(self.fault)

    def overrides(self) -> list[str]:
        # Metrics fetched every step: the step lines are the progress signal the stop waits for.
        return [f"train.max_steps={self.max_steps}", "logging.metrics_every=1", "logging.upload_every_s=1"]


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SmokeReport:
    device: str
    backend: str
    run_dirs: list[str]
    checks: list[CheckResult] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    @property
    def exit_code(self) -> int:
        if self.timed_out:
            return EXIT_TIMEOUT
        return EXIT_RUN_FAILED if self.failed else EXIT_OK

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "backend": self.backend,
            "run_dirs": self.run_dirs,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "seconds": round(self.seconds, 1),
            "failed": self.failed,
            "checks": [c.to_dict() for c in self.checks],
            "facts": self.facts,
        }

    def summary_lines(self) -> list[str]:
        out = [f"{'PASS' if c.passed else 'FAIL'} {c.name}: {c.message}" for c in self.checks]
        n = int(self.facts.get("slices", 1))
        where = self.device if n == 1 else f"{n} x {self.device}"
        if self.timed_out:
            out.append(f"smoke on {where} ({self.backend}): TIMED OUT after {self.seconds:.0f} s")
        elif self.failed:
            out.append(
                f"smoke on {where} ({self.backend}): FAILED {', '.join(self.failed)} "
                f"({len(self.checks) - len(self.failed)}/{len(self.checks)} checks passed, "
                f"{self.seconds:.0f} s)"
            )
        else:
            out.append(
                f"smoke on {where} ({self.backend}): all {len(self.checks)} checks passed "
                f"({self.seconds:.0f} s)"
            )
        return out


# ---------------------------------------------------------------- JUnit


def junit_xml(report: SmokeReport) -> str:
    """One <testsuite> with one <testcase> per check; a failed check carries a <failure>, a check the
    time limit cut short an <error>."""
    suite = ET.Element(
        "testsuite",
        {
            "name": f"olmo-ctl smoke {report.device}",
            "tests": str(len(report.checks)),
            "failures": str(
                sum(
                    1
                    for c in report.checks
                    if not c.passed and not (report.timed_out and c.message.startswith("timed out"))
                )
            ),
            "errors": str(
                sum(
                    1
                    for c in report.checks
                    if not c.passed and report.timed_out and c.message.startswith("timed out")
                )
            ),
            "time": f"{report.seconds:.3f}",
        },
    )
    props = ET.SubElement(suite, "properties")
    for k, v in [("device", report.device), ("backend", report.backend)] + sorted(
        (k, str(v)) for k, v in report.facts.items()
    ):
        ET.SubElement(props, "property", {"name": k, "value": str(v)})
    for c in report.checks:
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": f"smoke.{report.backend}.{report.device}",
                "name": c.name,
                "time": f"{c.seconds:.3f}",
            },
        )
        if not c.passed:
            tag = "error" if report.timed_out and c.message.startswith("timed out") else "failure"
            el = ET.SubElement(case, tag, {"message": c.message})
            el.text = c.message
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


# ---------------------------------------------------------------- attempts


@dataclass
class _Outcome:
    """How one attempt ended: its state, exit code (None where the backend cannot see it), the last
    step it logged and the committed step afterwards."""

    state: str
    reason: str
    exit_code: int | None
    last_logged_step: int | None
    committed_step: int
    log_tail: list[str]

    def describe(self) -> str:
        last = next((ln for ln in reversed(self.log_tail) if ln.strip()), "")
        code = f", exit {self.exit_code}" if self.exit_code is not None else ""
        return f"{self.state}{code} ({self.reason}){': ' + last.strip() if last else ''}"


PROGRESS_S = 10.0  # a wait longer than this says, this often, that it still waits and for what


def last_logged_step(lines: list[str]) -> int | None:
    return log_progress(lines).max_step


class _Driver:
    """Starts, watches and stops the smoke's attempts through a backend, under one deadline."""

    def __init__(
        self,
        backend,
        target: Target,
        recipe,
        plan,
        deadline: float,
        poll_s: float,
        log: Callable[[str], None],
    ):
        self.backend = backend
        self.target = target
        self.slices = plan.slices
        self.recipe = recipe
        self.plan = plan
        self.deadline = deadline
        self.poll_s = poll_s
        self.log = log
        self.live: list = []  # handles that may still run (stopped on timeout)
        self._said = time.monotonic()  # when the last line was logged (a wait says it still waits)

    def _still(self, what: str, since: float) -> None:
        """A line every PROGRESS_S of a wait (a pod's image pull and start take a minute or two on GKE)."""
        now = time.monotonic()
        if now - self._said >= PROGRESS_S:
            self._said = now
            self.log(f"{what} ({now - since:.0f} s)")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _tick(self) -> None:
        if self.remaining() <= 0:
            raise SmokeTimeout()
        time.sleep(min(self.poll_s, max(0.0, self.remaining())))

    def start(
        self,
        rundir,
        attempt: int,
        device: str,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        handle = submit_next(
            rundir,
            self.backend,
            self.request(rundir, attempt, device, extra_args, env),
            "smoke",
            numbered=True,
        )
        self.live.append(handle)
        where = device if self.slices == 1 else f"{self.slices} x {device}"
        self.log(f"{rundir.name}: attempt {attempt} on {where} submitted ({handle.name})")
        return handle

    def request(
        self,
        rundir,
        attempt: int,
        device: str,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        assert device == self.target.name  # a smoke runs every attempt on its one target
        return prepare(
            self.backend,
            rundir.name,
            rundir.path,
            attempt,
            self.target,
            self.recipe,
            extra_args=extra_args,
            env=env,
            plan=self.plan,
        )

    def wait_for_step(self, handle, step: int) -> tuple[bool, int | None]:
        """Poll the attempt's log until it logs `step` (True) or ends first (False)."""
        since = self._said = time.monotonic()
        while True:
            last = last_logged_step(self.backend.logs(handle, 200))
            if last is not None and last >= step:
                return True, last
            st = self.backend.status(handle)
            if st.state.terminal:
                return False, last_logged_step(self.backend.logs(handle, 200))
            at = "no step logged yet" if last is None else f"step {last} logged"
            self._still(f"{handle.name}: waiting for step {step}: {st.state.value}, {at}", since)
            self._tick()

    def stop(self, handle) -> None:
        # GKE: the JobSet is gone once its pods have checkpointed and exited.
        if not stop_and_wait(
            self.backend,
            handle,
            graceful=True,
            timeout_s=max(1.0, self.remaining()),
            poll_s=max(self.poll_s, 1.0),
        ):
            raise SmokeTimeout()

    def wait_end(self, handle, rundir) -> _Outcome:
        since = self._said = time.monotonic()
        while True:
            st = self.backend.status(handle)
            if st.state.terminal:
                break
            self._still(f"{handle.name}: waiting for the attempt to end: {st.state.value}", since)
            self._tick()
        if handle in self.live:
            self.live.remove(handle)
        tail = list(st.last_log_lines) or self.backend.logs(handle, 200)
        # MISSING: the backend deleted the attempt as asked (GKE: the JobSet is gone with its exit codes).
        event = {State.SUCCEEDED: "succeeded", State.PREEMPTED: "preempted", State.MISSING: "stopped"}.get(
            st.state, "failed"
        )
        committed = rundir.committed_step()
        rundir.append(
            event, attempt=handle.attempt, reason=st.reason, committed_step=committed, exit_code=st.exit_code
        )
        return _Outcome(st.state.value, st.reason, st.exit_code, last_logged_step(tail), committed, tail)

    def abort(self) -> None:
        for h in list(self.live):
            try:
                self.backend.stop(h, graceful=False)
            except Exception as e:  # best effort on the way out: the run dirs say what happened
                self.log(f"could not stop {h.name}: {e}")
        self.live.clear()


# ---------------------------------------------------------------- checks


def _check_loss_fell(series) -> CheckResult:
    if series is None or len(series) < 2 * LOSS_WINDOW:
        return CheckResult("loss_fell", False, f"fewer than {2 * LOSS_WINDOW} logged steps of `{LOSS_TAG}`")
    v = series.values
    first, last = float(v[:LOSS_WINDOW].mean()), float(v[-LOSS_WINDOW:].mean())
    s = series.steps
    text = (
        f"mean CE {first:.4f} (steps {s[0]}-{s[LOSS_WINDOW - 1]}) -> {last:.4f} "
        f"(steps {s[-LOSS_WINDOW]}-{s[-1]})"
    )
    if not (math.isfinite(first) and math.isfinite(last)):
        return CheckResult("loss_fell", False, f"loss is not finite: {text}")
    if last < first * (1 - MIN_LOSS_DROP):
        return CheckResult("loss_fell", True, f"{text}, {100 * (first - last) / first:.1f}% lower")
    return CheckResult("loss_fell", False, f"{text}: fell less than {100 * MIN_LOSS_DROP:g}%")


def _by_step(series) -> dict[int, float]:
    return {int(s): float(v) for s, v in zip(series.steps, series.values, strict=True)} if series else {}


def _check_resume_exact(main_reader, twin_reader, first: int, last: int) -> CheckResult:
    worst = None
    compared = 0
    for tag in EXACT_TAGS:
        a, b = _by_step(main_reader.series(tag)), _by_step(twin_reader.series(tag))
        for s in range(1, last + 1):
            if s not in a or s not in b:
                return CheckResult(
                    "resume_exact",
                    False,
                    f"step {s} of `{tag}` is missing from "
                    f"{'the resumed run' if s not in a else 'the uninterrupted twin'}",
                )
            compared += 1
            if a[s] != b[s] and not (math.isnan(a[s]) and math.isnan(b[s])):
                if worst is None or s < worst[1]:
                    worst = (tag, s, a[s], b[s])
    if worst:
        tag, s, x, y = worst
        where = "after the resume" if s >= first else "before the stop"
        return CheckResult(
            "resume_exact",
            False,
            f"first difference {where} at step {s}: `{tag}` "
            f"{x!r} (stopped and resumed) vs {y!r} (uninterrupted)",
        )
    return CheckResult(
        "resume_exact",
        True,
        f"steps {first}..{last} after the resume and 1..{first - 1} before it "
        f"equal the uninterrupted twin bit for bit ({compared} values, {len(EXACT_TAGS)} tags)",
    )


def _check_events(reader, final_step: int, tokens_per_step: int) -> CheckResult:
    problems = reader.problems()
    if problems:
        return CheckResult("events_readable", False, "; ".join(problems[:3]))
    want = list(range(1, final_step + 1))
    for tag in STEP_TAGS:
        s = reader.series(tag)
        steps = [int(x) for x in s.steps] if s is not None else []
        if steps != want:
            missing = sorted(set(want) - set(steps))[:5]
            extra = sorted(set(steps) - set(want))[:5]
            return CheckResult(
                "events_readable",
                False,
                f"`{tag}`: steps {steps[:3]}...{steps[-3:]}, "
                f"missing {missing}, unexpected {extra} (want 1..{final_step})",
            )
    tok = _by_step(reader.series(TOTAL_TOKENS_TAG))
    bad = [s for s in want if tok[s] != s * tokens_per_step]
    if bad:
        s = bad[0]
        return CheckResult(
            "events_readable",
            False,
            f"total tokens at step {s} is {tok[s]:.0f}, want {s} x {tokens_per_step} = {s * tokens_per_step}",
        )
    replays = reader.replayed_by_attempt(LOSS_TAG)
    if any(replays.values()):
        return CheckResult(
            "events_readable",
            False,
            f"steps of `{LOSS_TAG}` written again by a later attempt ({replays}): a step was repeated",
        )
    mism = reader.mismatches()
    if mism:
        m = mism[0]
        return CheckResult(
            "events_readable",
            False,
            f"step {m.step} of `{m.tag}` written twice with different "
            f"values ({m.earlier} by attempt {m.earlier_attempt}, {m.later} by {m.later_attempt})",
        )
    n_files = len(reader.files)
    return CheckResult(
        "events_readable",
        True,
        f"{n_files} event files, {len(reader.tags())} tags, "
        f"steps 1..{final_step} once each, total tokens = step x {tokens_per_step}",
    )


# ---------------------------------------------------------------- the smoke run


def _create_run(rundir, recipe, device: str, local: bool = True, slices: int = 1) -> None:
    """run.yaml for a smoke run. The builtin smoke data is made from the training machine's Python
    stdlib, so its fingerprint is only known here when this machine trains (local backend)."""
    fp = data_fingerprint(recipe) if local else ""
    rundir.create_run(recipe.to_dict(), recipe.fingerprint(), fp, device, slices)


def new_run_name(device: str) -> str:
    return smoke_run_name(device, time.strftime("%m%d%H%M%S", time.gmtime()), secrets.token_hex(2))


def run_smoke(
    backend,
    run_root: str,
    cfg: SmokeConfig,
    timeout_s: float,
    log: Callable[[str], None] = lambda s: None,
    run_name: str | None = None,
) -> SmokeReport:
    """Run the smoke attempts on `backend` under `run_root` and return the checked report."""
    faults = cfg.faults()
    if faults - set(FAULTS):
        raise BadInput(f"{FAULT_ENV}={cfg.fault!r} names no smoke fault", f"known: {', '.join(FAULTS)}")
    if cfg.stop_after_step < LOSS_WINDOW or cfg.resume_steps < LOSS_WINDOW:
        raise BadInput(f"the stop step and the resumed steps must each be at least {LOSS_WINDOW}")
    if cfg.stop_after_step + cfg.resume_steps + 2 > cfg.max_steps:
        raise BadInput(f"max_steps {cfg.max_steps} leaves no room to stop attempt 1 before its end")
    t0 = time.monotonic()
    target = cfg.target
    device = target.device
    recipe = load_recipe(cfg.recipe, overrides=cfg.overrides())
    plan = make_plan(recipe, device, target.slices)  # a layout the slices cannot hold is bad input
    name = run_name or new_run_name(device.name)
    # What the backend refuses on the command line alone (a local device on GKE, a run root its pods
    # cannot see) before any storage is touched.
    backend.validate_target(target, backend.settings, join(run_root, name))
    main = RunDir.of(run_root, name)
    twin = RunDir.of(run_root, f"{name}{SMOKE_TWIN}")
    report = SmokeReport(device.name, backend.name, [main.path, twin.path])
    if plan.slices > 1:
        report.facts.update(slices=plan.slices, seq_shards=plan.seq_shards)
    report.facts.update(
        global_batch=plan.global_batch,
        per_device_batch=plan.per_device_batch,
        grad_accum=plan.grad_accum,
        tokens_per_step=plan.tokens_per_step,
    )
    if faults:
        report.facts["fault"] = ",".join(sorted(faults))
        log(f"FAULT INJECTION ({FAULT_ENV}={cfg.fault}): {'; '.join(FAULTS[f] for f in sorted(faults))}")
    extra = ("--set", f"optimizer.lr={BROKEN_LR}") if "lr" in faults else ()
    driver = _Driver(backend, target, recipe, plan, t0 + timeout_s, cfg.poll_s, log)
    results: dict[str, CheckResult] = {}

    def fail_rest(why: str) -> None:
        for c in CHECKS:
            results.setdefault(c, CheckResult(c, False, why))

    # Checked as submit checks an attempt (the backend's validation and checks; a tiny model, so no
    # preflight), before either run directory exists.
    first = driver.request(main, 1, device.name, extra)
    check_attempt(backend, first, preflight=False)
    try:
        for rd in (main, twin):
            _create_run(rd, recipe, device.name, local=backend.trains_here, slices=plan.slices)

        # Attempt 1: stopped mid-run the way a preemption or `resize --now` stops it.
        c_t = time.monotonic()
        h1 = driver.start(main, 1, device.name, extra)
        reached, seen = driver.wait_for_step(h1, cfg.stop_after_step)
        if reached:
            log(f"{main.name}: step {seen} logged; stopping attempt 1")
            driver.stop(h1)
        o1 = driver.wait_end(h1, main)
        events1 = read_scalars(join(main.path, "tensorboard"))
        logged1 = events1.max_step() or 0
        n = o1.committed_step
        report.facts.update(stop_requested_after_step=seen, stopped_at_step=n)
        if not reached:
            fail_rest(f"attempt 1 ended before the stop at step {cfg.stop_after_step}: {o1.describe()}")
            raise _Abort()
        ok = (
            o1.state in ("preempted", "missing")
            and o1.exit_code in (None, 143)
            and n == logged1
            and n >= cfg.stop_after_step
        )
        how = (
            f"exit {o1.exit_code}"
            if o1.exit_code is not None
            else "attempt deleted, its pods signalled"
            if o1.state == "missing"
            else o1.reason
        )
        results["forced_stop"] = CheckResult(
            "forced_stop",
            ok,
            f"stopped after step {seen} was logged: {how}, checkpoint {n} = last logged step {logged1}"
            if ok
            else f"after the stop: {o1.describe()}; committed step {n}, last step in the events {logged1}",
            time.monotonic() - c_t,
        )
        if n < 1:
            fail_rest(f"no checkpoint after the stop: {o1.describe()}")
            raise _Abort()

        # Attempt 2 resumes from checkpoint n and trains to f; the twin trains 1..f without a stop.
        # They share nothing (two run directories), so they run side by side.
        c_t = time.monotonic()
        f = n + cfg.resume_steps
        env = {fault_knobs.DATA_SHIFT.name: "1"} if "data-shift" in faults else None
        h2 = driver.start(main, 2, device.name, extra + ("--stop-at-step", str(f)), env)
        ht = driver.start(twin, 1, device.name, extra + ("--stop-at-step", str(f)))
        o2 = driver.wait_end(h2, main)
        steps = main.committed_steps()
        ok = o2.state == "succeeded" and n in steps and f in steps
        results["checkpoint_committed"] = CheckResult(
            "checkpoint_committed",
            ok,
            f"checkpoints {n} (forced stop) and {f} (final) committed; committed steps {steps}"
            if ok
            else f"committed steps {steps}, want {n} and {f}; attempt 2: {o2.describe()}",
            time.monotonic() - c_t,
        )
        if o2.state != "succeeded":
            fail_rest(f"the resumed attempt 2 did not finish: {o2.describe()}")
            raise _Abort()
        reader = read_scalars(join(main.path, "tensorboard"))
        results["loss_fell"] = _check_loss_fell(reader.series(LOSS_TAG))
        results["events_readable"] = _check_events(reader, f, plan.tokens_per_step)

        ot = driver.wait_end(ht, twin)
        if ot.state != "succeeded":
            fail_rest(f"the uninterrupted twin did not finish: {ot.describe()}")
            raise _Abort()
        results["resume_exact"] = _check_resume_exact(
            reader, read_scalars(join(twin.path, "tensorboard")), n + 1, f
        )
        results["resume_exact"].seconds = time.monotonic() - c_t
        report.facts.update(final_step=f)
    except _Abort:
        pass
    except SmokeTimeout:
        report.timed_out = True
        driver.abort()
        fail_rest(f"timed out after {timeout_s:g} s")
    finally:
        driver.abort()
    report.checks = [results[c] for c in CHECKS]
    report.seconds = time.monotonic() - t0
    return report


class _Abort(Exception):
    """An attempt ended so that the remaining checks cannot run (they are failed with the reason)."""
