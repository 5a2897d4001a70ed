"""The soak: a run through a fleet's bad weeks, compressed, on this machine (`benchmarks/soak.py`).

`olmo-ctl sandbox` with an emulated v5p-16 slice (2 hosts, pods as trainer processes) and a v5p-8 to
fall back to, a GCS emulator bucket, and `olmo-ctl resume-until-done --fallback v5p-8` on the smoke
recipe, left alone until it exits; at the same time an uninterrupted twin of the same recipe on
v5p-16 in a sandbox of its own, without faults. The timeline's faults are keyed by the run's committed
step: each is sent through the sandbox's fault control path (`olmo-ctl sandbox fault`) once the run
has committed its `at_step` (and `after` seconds more), so the outcome does not depend on the
machine's speed. Then the figures:

- wall time, from the supervisor's start to its exit;
- goodput: time training new steps / wall time. Training time is the sum, over steps in order, of the
  time from one step's loss record to the next (the latest record of each step: a step trained again
  after a restore counts once, at its last training); an interval longer than `GAP_FACTOR` x the
  median (at least `GAP_MIN_S`) is time lost, not training;
- time lost per fault class: each lost interval (from the start, or a step's record, to the next
  step's record; the last step's record to the exit is `finish`) is the first fault applied inside it,
  else the latest applied before it (`start-up` when none was). The supervisor's return to the
  preferred device after a fallback is a class of its own (`return`, from its journal line); the
  fallback is the capacity outage's;
- losses against the twin: bit for bit up to the first fallback (the same device), and the largest
  difference after it (another device count: the sums are ordered differently). Every step's loss is
  logged with its own time (`logging.metrics_every=1`);
- the replays: a step trained twice (after a restore) logs the same loss both times (the event
  reader's mismatches).

Compressed timers (each named where it is set): taint eviction after 20 s (kube-apiserver's
--default-not-ready-toleration-seconds, through `sandbox --default-toleration-seconds`), a lost peer
noticed after 10 s (`runtime.peer_timeout_s`), the supervisor polling every 2 s with a 2 s retry
backoff, a fallback after 60 s of waiting (longer than the waits a host event or a repair cause, so
only the stockout sends the run away) and a return after 15 s on the fallback.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from olmo_ctl.core.durations import parse_duration
from olmo_ctl.sandbox.sandbox import parse_exports

ROOT = Path(__file__).resolve().parents[2]
TIMELINE = ROOT / "benchmarks" / "soak_timeline.yaml"
PREFERRED, FALLBACK = "v5p-16", "v5p-8"
BUCKET = "soak"
GAP_FACTOR, GAP_MIN_S = 5.0, 5.0
LOSS_TAG = "train/CE loss"  # every step's, fetched every logging.metrics_every steps
TOLERATION_S = 20
SUPERVISOR_FLAGS = (
    "--poll", "2", "--retry-backoff", "2", "--max-retries", "8", "--admission-timeout", "600",
    "--no-preflight",
)  # fmt: skip
FALLBACK_FLAGS = ("--fallback", FALLBACK, "--fallback-after", "60s", "--return-after", "15s")


@dataclass
class SoakResult:
    rc: int
    twin_rc: int
    wall_s: float
    train_s: float
    lost_s: dict[str, float]
    faults: list[dict]
    steps: int
    final_committed: int | None
    attempts: int
    devices: list[str]
    first_fallback_step: int | None
    same_device_equal: bool
    first_difference: str | None
    max_diff_after_fallback: float | None
    diff_first_step_after_fallback: float | None
    replay_mismatches: int
    replayed_steps: int
    journal_events: dict[str, int] = field(default_factory=dict)
    unapplied: list[str] = field(default_factory=list)  # faults whose step the run never committed
    injector_errors: list[str] = field(default_factory=list)
    monitor_goodput: dict[str, Any] = field(default_factory=dict)  # `monitor -o json`'s, of the soak's run
    log_tail: str = ""

    @property
    def goodput(self) -> float:
        return self.train_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rc": self.rc,
            "twin_rc": self.twin_rc,
            "wall_s": round(self.wall_s, 1),
            "train_s": round(self.train_s, 1),
            "goodput": round(self.goodput, 3),
            "lost_s": {k: round(v, 1) for k, v in sorted(self.lost_s.items(), key=lambda kv: -kv[1])},
            "steps": self.steps,
            "final_committed": self.final_committed,
            "attempts": self.attempts,
            "devices": self.devices,
            "first_fallback_step": self.first_fallback_step,
            "losses_equal_twin_before_fallback": self.same_device_equal,
            "first_difference": self.first_difference,
            "loss_diff_first_step_after_fallback": self.diff_first_step_after_fallback,
            "max_loss_diff_after_fallback": self.max_diff_after_fallback,
            "replayed_steps": self.replayed_steps,
            "replay_mismatches": self.replay_mismatches,
            "journal_events": self.journal_events,
            "monitor_goodput": self.monitor_goodput,
            "faults": self.faults,
            "unapplied": self.unapplied,
            "injector_errors": self.injector_errors,
        }


def _after_s(f: dict) -> float:
    return parse_duration(str(f["after"])) if f.get("after") is not None else 0.0


def load_timeline(path: Path = TIMELINE) -> list[dict]:
    """The faults in the order they come: by committed step, then by the seconds `after` it."""
    faults = yaml.safe_load(path.read_text())
    return sorted(faults, key=lambda f: (int(f["at_step"]), _after_s(f)))


class Injector(threading.Thread):
    """Sends each fault of the timeline to the sandbox once the run has committed its `at_step` (and
    `after` seconds have passed since it was seen); records when and what it sent."""

    def __init__(self, faults: list[dict], kubeconfig: str, emulator: str, run_dir_root: str, run: str):
        super().__init__(daemon=True)
        self.faults, self.kubeconfig, self.emulator = faults, kubeconfig, emulator
        self.root, self.run_name = run_dir_root, run  # not `run`: Thread.run is the body
        self.applied: list[dict] = []
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        from olmo_ctl.rundir import RunDir
        from olmo_ctl.sandbox.faults import send
        from olmo_ctl.sandbox.gcs_emulator import use_emulator

        pending = list(self.faults)
        reached: dict[int, float] = {}  # at_step -> when the run was first seen past it
        with use_emulator(self.emulator):
            rd = RunDir.of(self.root, self.run_name)
            while pending and not self.done.is_set():
                try:
                    committed = rd.committed_step() or 0
                except Exception as e:  # noqa: BLE001 - an emulator hiccup: look again
                    self.errors.append(f"{type(e).__name__}: {e}")
                    committed = 0
                now = time.time()
                for f in list(pending):
                    step = int(f["at_step"])
                    if committed >= step:
                        reached.setdefault(step, now)
                    if step in reached and now >= reached[step] + _after_s(f):
                        raw = {k: v for k, v in f.items() if k not in ("at_step", "after")}
                        try:
                            answer = send(self.kubeconfig, raw)
                        except Exception as e:  # noqa: BLE001 - recorded: the test names it
                            answer = f"not applied: {type(e).__name__}: {e}"
                            self.errors.append(answer)
                        self.applied.append(
                            {
                                "at_step": step,
                                "committed": committed,
                                "kind": f["kind"],
                                "time": time.time(),
                                "applied": answer,
                            }
                        )
                        pending.remove(f)
                    elif step not in reached:
                        break  # the timeline is in order: nothing later is due either
                self.done.wait(0.5)


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    for k in ("KUBECONFIG", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "XLA_FLAGS"):
        env.pop(k, None)
    env.update(PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(work / "config"))
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "olmo_ctl", *args]


def _supervise(env: dict, run: str, steps: int, extra: tuple[str, ...], log: Path) -> subprocess.Popen:
    sets = [
        f"train.max_steps={steps}",
        "checkpoint.interval=5",
        "eval.interval=1000",
        "runtime.peer_timeout_s=10",
    ]
    cmd = _cli("resume-until-done", "--recipe", "smoke", "--run", run, "--device", PREFERRED)
    for s in sets:
        cmd += ["--set", s]
    cmd += [*SUPERVISOR_FLAGS, *extra]
    with log.open("w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(p: subprocess.Popen, deadline: float) -> int:
    try:
        return p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        return 124


def _sandbox(work: Path, name: str, env: dict, slices: list[str], extra: list[str]) -> dict[str, str]:
    """A detached `olmo-ctl sandbox` with its own GCS emulator bucket; its exported environment."""
    kc = work / f"{name}.kubeconfig"
    p = subprocess.run(
        _cli("sandbox", "--kubeconfig", str(kc), *[f"--slices={s}" for s in slices])
        + ["--gcs-bucket", name, "--default-toleration-seconds", str(TOLERATION_S), *extra, "--detach"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the {name} sandbox did not start: {p.stderr[-2000:]}")
    return parse_exports(p.stdout)


def _stop_sandbox(ex: dict[str, str]) -> None:
    pid = int(ex["OLMO_CTL_SANDBOX_PID"])
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    for _ in range(120):
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.5)


def run_soak(
    work: Path, steps: int = 300, timeline: Path = TIMELINE, timeout_s: float = 1800.0
) -> SoakResult:
    """The soak in `work` (its sandboxes' files and the logs); see the module docstring. The twin trains
    at the same time, in a sandbox of its own without faults."""
    from olmo_ctl.observe.monitor import build_report, load
    from olmo_ctl.observe.reader import read_scalars
    from olmo_ctl.rundir import RunDir, parse_iso
    from olmo_ctl.sandbox.gcs_emulator import use_emulator

    work.mkdir(parents=True, exist_ok=True)
    faults = load_timeline(timeline)
    base = _env(work)
    boxes: list[dict[str, str]] = []
    try:
        boxes.append(_sandbox(work, "twin", base, [f"{PREFERRED}=1"], []))
        soak_ex = _sandbox(work, BUCKET, base, [f"{PREFERRED}=1", f"{FALLBACK}=1"], [])
        t0 = time.time()
        boxes.append(soak_ex)
        twin_ex = boxes[0]
        deadline = time.time() + timeout_s
        soak_p = _supervise({**base, **soak_ex}, "soak", steps, FALLBACK_FLAGS, work / "soak.log")
        twin_p = _supervise({**base, **twin_ex}, "soak-twin", steps, (), work / "twin.log")
        injector = Injector(
            faults,
            soak_ex["KUBECONFIG"],
            soak_ex["STORAGE_EMULATOR_HOST"],
            soak_ex.get("OLMO_CTL_RUN_ROOT", f"gs://{BUCKET}/runs"),
            "soak",
        )
        injector.start()
        rc = _wait(soak_p, deadline)
        t_end = time.time()
        injector.done.set()
        injector.join(timeout=60)
        twin_rc = _wait(twin_p, deadline)
        with use_emulator(soak_ex["STORAGE_EMULATOR_HOST"]):
            rd = RunDir.of(soak_ex.get("OLMO_CTL_RUN_ROOT", f"gs://{BUCKET}/runs"), "soak")
            journal = rd.journal()
            main_r = read_scalars(f"{rd.path}/tensorboard")
            committed = rd.committed_step()
            monitor_goodput = build_report(load(rd.path), ask_backend=False)["goodput"]
        with use_emulator(twin_ex["STORAGE_EMULATOR_HOST"]):
            twin = RunDir.of(twin_ex.get("OLMO_CTL_RUN_ROOT", "gs://twin/runs"), "soak-twin")
            twin_r = read_scalars(f"{twin.path}/tensorboard")
    finally:
        for ex in boxes:
            _stop_sandbox(ex)
    applied = [dict(f, at_s=round(f["time"] - t0, 1)) for f in injector.applied]
    markers = [(f["time"], f["kind"]) for f in applied]
    markers += [(parse_iso(r["time"]), "return") for r in journal if r.get("event") == "returned"]
    markers.sort()
    started = next((parse_iso(r["time"]) for r in journal if r.get("event") == "supervisor_started"), t0)
    loss = main_r.series(LOSS_TAG)
    times = [started] + ([float(t) for t in loss.wall_times] if loss is not None else [])
    steps_seen = [0] + ([int(s) for s in loss.steps] if loss is not None else [])
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False) if b > a]
    limit = max(GAP_MIN_S, GAP_FACTOR * statistics.median(gaps)) if gaps else GAP_MIN_S
    train_s, lost = 0.0, {}
    intervals = list(zip(times, times[1:], strict=False)) + [(times[-1], t_end)]
    for i, (a, b) in enumerate(intervals):
        is_last = i == len(intervals) - 1
        if not is_last and i > 0 and 0 <= b - a <= limit and steps_seen[i + 1] == steps_seen[i] + 1:
            train_s += b - a
            continue
        inside = [k for t, k in markers if a < t <= b]
        before = [k for t, k in markers if t <= a]
        cls = (
            "finish"
            if is_last and not inside
            else (inside[0] if inside else before[-1] if before else "start-up")
        )
        lost[cls] = lost.get(cls, 0.0) + max(0.0, b - a)
    # Losses against the twin.
    fallbacks = [r for r in journal if r.get("event") == "fallback"]
    first_fb = int(fallbacks[0].get("committed_step") or 0) if fallbacks else None
    a = _by_step(loss)
    b = _by_step(twin_r.series(LOSS_TAG))
    equal, first_diff, worst, at_move = True, None, None, None
    for s in sorted(set(a) & set(b)):
        if first_fb is None or s <= first_fb:
            if a[s] != b[s] and equal:
                equal, first_diff = False, f"step {s}: {a[s]!r} (soak) vs {b[s]!r} (twin)"
        else:
            d = abs(a[s] - b[s])
            worst = d if worst is None or d > worst else worst
            at_move = d if at_move is None else at_move  # the first step on the other device
    if set(a) != set(b) and equal:
        equal, first_diff = False, f"steps logged differ: {sorted(set(a) ^ set(b))[:10]}"
    counts: dict[str, int] = {}
    for r in journal:
        counts[r["event"]] = counts.get(r["event"], 0) + 1
    devices = [str(r.get("device") or "?") for r in journal if r.get("event") == "submitted"]
    tail = (work / "soak.log").read_text()[-4000:] if (work / "soak.log").exists() else ""
    return SoakResult(
        rc=rc,
        twin_rc=twin_rc,
        wall_s=t_end - started,
        train_s=train_s,
        lost_s=lost,
        faults=[
            {"at_step": f["at_step"], "committed": f["committed"], "at_s": f["at_s"], "kind": f["kind"]}
            for f in applied
        ],
        unapplied=[f["kind"] for f in faults[len(applied) :]],
        injector_errors=injector.errors,
        steps=steps,
        final_committed=committed,
        attempts=len(devices),
        devices=devices,
        first_fallback_step=first_fb,
        same_device_equal=equal,
        first_difference=first_diff,
        max_diff_after_fallback=worst,
        diff_first_step_after_fallback=at_move,
        replay_mismatches=len(main_r.mismatches()),
        replayed_steps=main_r.replays(LOSS_TAG),
        journal_events=counts,
        monitor_goodput=monitor_goodput,
        log_tail=tail,
    )


def _by_step(series) -> dict[int, float]:
    return {int(s): float(v) for s, v in zip(series.steps, series.values, strict=True)} if series else {}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="The soak (tests/helpers/soak.py): prints its figures as JSON.")
    ap.add_argument("--steps", type=int, default=200, help="the smoke recipe's train.max_steps")
    ap.add_argument(
        "--timeline", type=Path, default=TIMELINE, help="the fault timeline, keyed by committed step (YAML)"
    )
    ap.add_argument("--work", type=Path, default=None, help="where the sandbox's files and logs go")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds each supervisor may take")
    a = ap.parse_args(argv)
    import tempfile

    work = a.work or Path(tempfile.mkdtemp(prefix="olmo-ctl-soak-"))
    r = run_soak(work, a.steps, a.timeline, a.timeout)
    out = r.to_dict()
    out["work"] = str(work)
    print(json.dumps(out, indent=2))
    return 0 if r.rc == 0 and r.twin_rc == 0 else 1
