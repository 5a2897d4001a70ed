"""The monitor report: one dict built from a run directory (events, journal, checkpoints, run.yaml)
plus, when it can be asked, the backend's status of the live attempt.

The dict's shape is the stable JSON schema `docs/monitor-schema.json` (`olmo-ctl monitor -o json`);
the table view and the plot are drawn from it. Everything is derived from data the run directory
keeps, so two people monitoring the same run see the same numbers:

* progress, tokens, losses: the de-duplicated TensorBoard scalars (`olmo_ctl.observe.reader`);
* step time, tokens/s, TFLOP/s, MFU: wall times of the training loss's points (`LOSS_TAG`) within one
  attempt (a gap between attempts is never counted as a slow step) and `olmo_ctl.core.flops` for the
  model;
* goodput: time on steps that count / wall time, and every other second of the wall time in one
  bucket, from the journal's and the trainer's timestamps (`olmo_ctl.observe.goodput`).

Step semantics: a metric logged at step N describes the N-th step; checkpoint N holds the state after
N steps, so the steps at risk are `step - committed_step`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.contracts import (
    EVAL_LOSS_TAG,
    EXITED_EVENT,
    LR_TAG,
    MFU_TAG,
    SAVE_DURATION_TAG,
    STEP_SKIPPED_PARITY_TAG,
    STEP_SKIPPED_TAG,
    TFLOPS_TAG,
    TOTAL_TOKENS_PARITY_TAG,
    TOTAL_TOKENS_TAG,
    TPS_TAG,
    exit_state,
    final_committed,
    parse_host_tag,
    parse_segment_name,
    primary_loss_tag,
)
from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.core.transient import is_transient
from olmo_ctl.observe.memorization import HELDOUT_TAGS, TRAIN_TAG, memorization, with_audit
from olmo_ctl.observe.memorization import warning_lines as memorization_warnings
from olmo_ctl.observe.reader import EventReader
from olmo_ctl.observe.rounding import layout_of_attempts, replay_bounds, rounding_model
from olmo_ctl.observe.series import Series
from olmo_ctl.observe.waiting import journal_line, wait_of
from olmo_ctl.rundir import RunDir, checkpoint_intervals, run_recipe, saved_permanent

# (run directory, a journal `handle`) -> the backend's AttemptStatus of that attempt, or None
StatusOf = Callable[[str, dict], Any]

SCHEMA_ID = "olmo-ctl/monitor/v1"
LOSS_TAG = primary_loss_tag()  # every recipe trains the `lm` objective today
EVAL_TAG = EVAL_LOSS_TAG
LR_TAGS = (LR_TAG,)
TOKENS_TAGS = (TOTAL_TOKENS_TAG, TOTAL_TOKENS_PARITY_TAG)
SKIPPED_TAGS = (STEP_SKIPPED_TAG, STEP_SKIPPED_PARITY_TAG)
CKPT_TAG = SAVE_DURATION_TAG
# TPS_TAG, TFLOPS_TAG, MFU_TAG (core/contracts.py): what the trainer logs for each window (trainer/hooks.py
# MetricsHook), read where the monitor cannot compute it
# The smoothed train loss: the mean of the last SMOOTH_STEPS logged steps. An EMA over a falling
# loss lags it (its early, higher points keep weight) and matches no number a user can check.
SMOOTH_STEPS = 50
RECENT_POINTS = 50  # the ETA and the slow-throughput warning: the live attempt's last this-many windows
SLOW_FRACTION = 0.85  # warn when recent throughput is below this fraction of the run's median

# journal event -> the state it leaves an attempt in (used when no backend can be asked)
_EVENT_STATE = {
    "submitted": "queued",
    "queued": "queued",
    "admitted": "admitted",
    "running": "running",
    "reattached": "running",
    "preempted": "preempted",
    "failed": "failed",
    "succeeded": "succeeded",
    "stalled": "running",
    "stopped": "stopped",  # on request: `olmo-ctl stop`, or Ctrl-C with --stop-on-exit
    "requeued": "queued",  # Kueue evicted it and requeues the same Workload
    "deactivated": "queued",  # spec.active=false: Kueue keeps it, runs it once reactivated
}


def waiting_of(journal: list | None, attempt: int | None, now: float) -> dict | None:
    """The attempt's wait for capacity in progress, from the supervisor's `waiting` record with no
    `waited` after it: its cause, since when, for how long, and why (Kueue's or the scheduler's words)."""
    if attempt is None:
        return None
    last = None
    for r in journal or []:
        if r.get("attempt") == attempt and r.get("event") in ("waiting", "waited"):
            last = r
    if last is None or last["event"] != "waiting":
        return None
    since = _parse_time(last.get("time"))
    return {
        "cause": last.get("cause"),
        "since": last.get("time"),
        "seconds": _f(max(0.0, now - since)) if since is not None else None,
        "reason": last.get("reason") or "",
    }


@dataclass
class Sources:
    """What a monitor report is built from; `load` reads it, `refresh` re-reads only what changed."""

    path: str
    reader: EventReader
    tb_dir: str
    run_doc: dict | None = None
    journal: list | None = None
    committed: list | None = None
    audit: dict | None = None  # the last `data audit` recorded in the run directory

    def refresh(self) -> None:
        def go():
            from olmo_ctl.checkpoints.data_audit import read_result

            self.reader.refresh()
            self.journal = _journal(self.path)
            self.committed = _committed(self.path)
            self.audit = read_result(self.path)

        storage_guard(self.path, go)


def _journal(path: str) -> list | None:
    """The journal's records, oldest first; None when the run has no journal."""
    rd = RunDir(path)
    j = rd.journal()
    return j if j or rd.store.exists(rd.p("journal.jsonl")) else None


def _committed(path: str) -> list[int]:
    """Committed checkpoint steps (a step counts only with Orbax's commit marker)."""
    return RunDir(path).committed_steps()


def storage_guard(path: str, fn):
    """Run `fn`; a storage client error that the storage layer did not classify (e.g. the client's own
    retry deadline passing) becomes Unreachable (exit 3) with one line, never a traceback (what counts as
    transient: core/transient.py)."""
    try:
        return fn()
    except OlmoCtlError:
        raise
    except Exception as e:
        if is_transient(e):
            from olmo_ctl.core.errors import Unreachable

            detail = " ".join(str(e).split())[:200]
            raise Unreachable(
                f"storage unreachable for `{path}`: {type(e).__name__}: {detail}",
                "check the bucket name, credentials and network",
            ) from None
        raise


def load(path: str) -> Sources:
    return storage_guard(str(path), lambda: _load(path))


def _load(path: str) -> Sources:
    """Open a run directory (local or gs://), or a directory that holds only `tensorboard/`, or an
    event directory itself. BadInput (exit 2) when it is none of these; Unreachable (exit 3) when the
    storage cannot be reached."""
    path = str(path).rstrip("/") if str(path) not in ("/", "gs://") else str(path)
    if not path:
        raise BadInput("no run directory given")
    if storage.is_gcs(path):
        storage.split_gcs(path)
    st = storage.store_for(path)
    try:
        files, dirs = st.list(path)
    except storage.NotFound:
        bucket = storage.split_gcs(path)[0] if storage.is_gcs(path) else path
        raise BadInput(
            f"bucket `{bucket}` does not exist (reading {path})",
            "check the bucket name and the project of your credentials",
        ) from None
    names = {f.path.rsplit("/", 1)[-1] for f in files}
    dnames = {d.rstrip("/").rsplit("/", 1)[-1] for d in dirs}
    is_run = (
        "run.yaml" in names or "journal.jsonl" in names or "tensorboard" in dnames or "checkpoints" in dnames
    )
    if is_run:
        tb = storage.join(path, "tensorboard")
    elif any("tfevents" in n for n in names):
        tb = path
    else:
        if not files and not dirs and not storage.is_gcs(path) and not st.stat(path):
            import os

            if not os.path.exists(path):
                raise BadInput(f"`{path}` does not exist", "give a run directory (local or gs://)")
        raise BadInput(
            f"`{path}` is not a run directory (no run.yaml, journal.jsonl, tensorboard/ or checkpoints/)",
            "give the run's directory, e.g. gs://BUCKET/runs/NAME",
        )
    run_doc = None
    if "run.yaml" in names:
        import yaml

        try:
            run_doc = yaml.safe_load(st.read_text(storage.join(path, "run.yaml")))
        except Exception as e:  # a damaged run.yaml should not hide the events
            if isinstance(e, OlmoCtlError) and e.exit_code == 3:
                raise
            run_doc = None
        if not isinstance(run_doc, dict) or not isinstance(run_doc.get("recipe"), dict):
            from olmo_ctl.rundir import warn

            warn(
                f"`{storage.join(path, 'run.yaml')}` is not a run description (no `recipe:` mapping): "
                "the report shows what the event files and the journal say",
                once_key=path,
            )
            run_doc = run_doc if isinstance(run_doc, dict) else None
    src = Sources(path, EventReader(tb), tb, run_doc)
    src.refresh()
    return src


# ------------------------------------------------------------------------------------------------
# helpers


def _first(reader: EventReader, tags) -> Series | None:
    for t in tags:
        s = reader.series(t)
        if s is not None and len(s):
            return s
    return None


def _f(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _recent_mean(values: np.ndarray, n: int = SMOOTH_STEPS) -> float | None:
    """The mean of the last `n` finite logged values (fewer when fewer were logged)."""
    v = values[np.isfinite(values)][-n:]
    return float(v.mean()) if len(v) else None


def _fetch_ends(s: Series) -> np.ndarray:
    """Indices of the last point of each host fetch: a trainer that fetches metrics every k steps writes
    k points with one wall time, so only the last of each group marks when its step finished."""
    if not len(s):
        return np.zeros(0, np.int64)
    end = np.ones(len(s), dtype=bool)
    end[:-1] = (s.wall_times[1:] != s.wall_times[:-1]) | (s.attempts[1:] != s.attempts[:-1])
    return np.flatnonzero(end)


@dataclass(frozen=True)
class Windows:
    """Throughput per logging window: the steps of one metrics fetch, timed from the attempt's previous
    fetch to this one (all of it: steps, data wait, an evaluation or checkpoint save in between), which is
    the window the trainer times for its `step N/M ...` line and `throughput/device/*` scalars. An
    attempt's first window (restore and compile) has no fetch before it and is not here. The report's
    "now" figures are the live attempt's last window; the plot draws every window."""

    attempts: np.ndarray  # int: the attempt that logged the window
    first_steps: np.ndarray  # int: the window's first step
    steps: np.ndarray  # int: its last step
    step_time_s: np.ndarray  # seconds per step
    tokens_per_s: np.ndarray  # of the run: every device of every slice (nan: tokens per step unknown)
    tokens_per_s_per_device: np.ndarray
    tflops_per_device: np.ndarray
    mfu: np.ndarray  # fraction 0..1 of the device's peak dense bf16 TFLOP/s (nan: unknown)

    def __len__(self) -> int:
        return len(self.steps)

    def of_attempt(self, attempt: int) -> Windows:
        m = self.attempts == attempt
        return Windows(*(getattr(self, f.name)[m] for f in dataclasses.fields(self)))

    def row(self, i: int) -> dict:
        return {f.name: getattr(self, f.name)[i].item() for f in dataclasses.fields(self)}


def _tag_at(r: EventReader, tag: str, steps: np.ndarray) -> np.ndarray:
    """The values `tag` logged at `steps` (nan where it logged none)."""
    out = np.full(len(steps), np.nan)
    s = r.series(tag)
    if s is None or not len(s) or not len(steps):
        return out
    pos = np.minimum(np.searchsorted(s.steps, steps), len(s) - 1)
    hit = s.steps[pos] == steps
    out[hit] = s.values[pos[hit]]
    return out


def _windows(
    r: EventReader,
    loss: Series | None,
    tokens_per_step: int | None,
    flops_tok: float | None,
    devices_of: Callable[[int], tuple[int, float] | None],
) -> Windows:
    """Every logging window's figures. Computed from the event wall times and the recipe where they are
    known (`devices_of(attempt)`: the attempt's devices and peak TFLOP/s per device), else what the
    trainer logged for the window (`throughput/device/TPS`, `/TFLOPS`, `/MFU`): the same formulas
    (core/flops.py) on the same window."""
    empty = np.zeros(0)
    if loss is None or not len(loss):
        return Windows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), *[empty] * 5)
    idx = _fetch_ends(loss)
    st, wt, at = loss.steps[idx], loss.wall_times[idx], loss.attempts[idx]
    keep = (at[1:] == at[:-1]) & (st[1:] > st[:-1]) & (wt[1:] > wt[:-1])
    for attempt, step in restarts(
        r
    ):  # a restarted trainer's first window holds its start-up, like an attempt's
        keep &= ~((at[1:] == attempt) & (st[:-1] < step) & (step <= st[1:]))
    k = np.flatnonzero(keep) + 1
    steps, att = st[k], at[k]
    step_s = (wt[k] - wt[k - 1]) / (st[k] - st[k - 1])
    tps = tokens_per_step / step_s if tokens_per_step else np.full(len(k), np.nan)
    n_dev = np.full(len(k), np.nan)
    peak = np.full(len(k), np.nan)
    for a in np.unique(att):
        d = devices_of(int(a))
        if d is not None:
            n_dev[att == a], peak[att == a] = d
    per_dev = np.where(np.isfinite(n_dev) & np.isfinite(tps), tps / n_dev, _tag_at(r, TPS_TAG, steps))
    tflops = per_dev * flops_tok / 1e12 if flops_tok else _tag_at(r, TFLOPS_TAG, steps)
    mfu = np.where(np.isfinite(tflops) & np.isfinite(peak), tflops / peak, _tag_at(r, MFU_TAG, steps))
    return Windows(att.astype(np.int64), st[k - 1] + 1, steps, step_s, tps, per_dev, tflops, mfu)


def restarts(r: EventReader) -> list[tuple[int, int]]:
    """(attempt, step) where an attempt's trainer started again within the same attempt: a JobSet
    restart recreates its pods, whose trainers keep the attempt number, so the attempt's event
    segments carry a later writer start time than its first; the step is the first that writer logged."""
    firsts: dict[int, dict[int, int]] = {}  # attempt -> writer start time -> its first step
    for fs in r.files.values():
        parsed = parse_segment_name(fs.path.rsplit("/", 1)[-1])
        if parsed is None or parsed[2] is None or fs.first_step is None:
            continue
        by_start = firsts.setdefault(parsed[2], {})
        by_start[parsed[0]] = min(by_start.get(parsed[0], fs.first_step), fs.first_step)
    return sorted(
        (attempt, by_start[start]) for attempt, by_start in firsts.items() for start in sorted(by_start)[1:]
    )


def windows(src: Sources) -> Windows:
    """The logging windows of a run directory (what `build_report` and the plot read)."""
    recipe = _recipe(src.run_doc)
    tokens_per_step, _seen = _tokens(src.reader, recipe, src.reader.max_step())
    return _windows(
        src.reader,
        src.reader.series(LOSS_TAG),
        tokens_per_step,
        _flops_per_token(recipe),
        _devices_of(src.journal, src.run_doc),
    )


def _devices_of(journal: list | None, run_doc: dict | None) -> Callable[[int], tuple[int, float] | None]:
    """attempt -> (JAX devices of every slice it ran on, peak TFLOP/s per device), from the run
    directory's record of its target (`rundir.attempt_targets`); None when none names a known device."""
    from olmo_ctl.rundir import attempt_targets

    target_of = attempt_targets(journal, run_doc)

    def of(attempt: int) -> tuple[int, float] | None:
        t = target_of(attempt)
        return None if t is None else (t.device.devices * t.slices, t.device.peak_tflops_per_device)

    return of


def _parse_time(x) -> float | None:
    if not x:
        return None
    try:
        from olmo_ctl.rundir import parse_iso

        return parse_iso(x)
    except Exception:
        import datetime as dt

        try:
            return dt.datetime.fromisoformat(str(x).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _recipe(run_doc: dict | None):
    if not isinstance(run_doc, dict) or not isinstance(run_doc.get("recipe"), dict):
        return None
    try:
        return run_recipe(run_doc, "run.yaml", pending=True)  # the final step as amended
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# the live attempt


def live_attempt_of(
    path: str,
    journal: list | None,
    status_of: StatusOf | None,
    committed_step: int | None = None,
    final_step: int | None = None,
    now: float | None = None,
) -> dict:
    """The latest attempt's state: the journal's last word on it (a supervisor's record, or the
    trainer's own `exited` record with its exit code), the backend's while it may be live; and, once it
    is over with the final step committed, `succeeded` whatever its exit (`final_committed`, the
    supervisor's rule). `waiting`: what holds it while it is queued or admitted (`waiting_now`)."""
    out: dict[str, Any] = {
        "attempt": None,
        "state": None,
        "reason": "",
        "source": "",
        "device": None,
        "backend": None,
        "waiting": None,
    }
    if not journal:
        out["source"] = "no journal (the run was not started by olmo-ctl, or has not started)"
        return out
    attempts = [r for r in journal if r.get("attempt") is not None]
    if not attempts:
        return out
    n = max(int(r["attempt"]) for r in attempts)
    mine = [r for r in attempts if int(r["attempt"]) == n]
    out["attempt"] = n
    out["device"] = next((r.get("device") for r in reversed(mine) if r.get("device")), None)
    last_state = next(
        (r for r in reversed(mine) if r.get("event") in _EVENT_STATE or _exit_of(r) is not None), None
    )
    exited = last_state is not None and _exit_of(last_state) is not None
    if last_state is not None:
        if exited:
            state, why = exit_state(_exit_of(last_state))
            out["state"], out["reason"] = state.value, f"the trainer's {why}"
        else:
            out["state"] = _EVENT_STATE[last_state["event"]]
            out["reason"] = last_state.get("reason") or ""
        out["source"] = f"journal ({last_state.get('time', '?')})"
    handle = next((r.get("handle") for r in reversed(mine) if isinstance(r.get("handle"), dict)), None)
    st = None
    # A terminal journal record (written by the supervisor, which saw the outcome) is final; the backend
    # is asked while the journal says the attempt may still be live, and after a trainer's nonzero exit
    # (a JobSet restarts its pods, Kueue requeues a preempted attempt: the same attempt runs on).
    may_live = out["state"] in (None, "queued", "admitted", "running") or (
        exited and out["state"] != "succeeded"
    )
    if handle and status_of is not None and may_live:
        out["backend"] = handle.get("backend")
        try:
            st = status_of(path, handle)
        except OlmoCtlError as e:
            out["source"] += f"; backend status unavailable: {e.one_line()}"
            st = None
        except Exception as e:  # a backend bug must not hide the rest of the report
            out["source"] += f"; backend status failed: {type(e).__name__}: {e}"
            st = None
        # a backend that saw the end but not its exit code (no process of its own was the trainer's
        # parent) knows less than the trainer's `exited` record
        if st is not None and not (exited and st.state.terminal and st.exit_code is None):
            out["state"] = st.state.value
            out["reason"] = st.reason or out["reason"]
            out["source"] = f"{handle.get('backend')} backend" + (f": {st.source}" if st.source else "")
    if out["state"] not in (None, "queued", "admitted", "running", "succeeded") and final_committed(
        committed_step, final_step
    ):
        out["reason"] = f"final step committed ({out['state']}: {out['reason']})"
        out["state"] = "succeeded"
    if out["state"] in ("queued", "admitted"):
        since = last_state.get("time") if last_state is not None else None
        out["waiting"] = waiting_now(journal, n, st, since, time.time() if now is None else now)
    return out


def waiting_now(journal: list | None, attempt: int, st: Any, since: str | None, now: float) -> dict | None:
    """What holds the attempt now, one line (`observe.waiting`): the backend's status `st` when it
    names a hold, since the supervisor's `waiting` record of the same cause (else `since`, the
    attempt's latest state record); otherwise the journal's wait in progress."""
    j = waiting_of(journal, attempt, now)
    w = wait_of(st)
    if w is None:
        return {**j, "kind": None, "line": journal_line(j["cause"], j["reason"])} if j else None
    cause, kind, line = w
    if j is not None and j["cause"] == cause:
        since = j["since"]
    t = _parse_time(since)
    return {
        "cause": cause,
        "kind": kind,
        "since": since,
        "seconds": _f(max(0.0, now - t)) if t is not None else None,
        "reason": st.reason,
        "line": line,
    }


def _exit_of(rec: dict) -> int | None:
    """The exit code of a trainer's `exited` record (None for any other record)."""
    if rec.get("event") != EXITED_EVENT or rec.get("exit_code") is None:
        return None
    try:
        return int(rec["exit_code"])
    except (TypeError, ValueError):
        return None


def _timeline(journal: list | None) -> list[dict]:
    if not journal:
        return []
    keep = ("time", "event", "attempt", "device", "reason", "committed_step", "exit_code")
    return [{k: r.get(k) for k in keep} for r in journal]


def timeline_summary(timeline: list[dict]) -> list[str]:
    """One line per attempt: `#2 cpu-4: queued → admitted → running → preempted (exit 143)`."""
    per: dict[int, list] = {}
    for r in timeline:
        if r.get("attempt") is None or r.get("event") not in (*_EVENT_STATE, "resized", EXITED_EVENT):
            continue
        per.setdefault(int(r["attempt"]), []).append(r)
    lines = []
    for n, recs in sorted(per.items()):
        dev = next((r.get("device") for r in recs if r.get("device")), "?")
        parts: list[str] = []
        for r in recs:
            ev = r["event"]
            if parts and parts[-1].split(" ")[0] == ev:
                continue
            why = r.get("reason") or ""
            parts.append(
                f"{ev} ({why})"
                if why and ev in ("preempted", "failed", "stalled", "resized", EXITED_EVENT)
                else ev
            )
        lines.append(f"#{n} {dev}: " + " → ".join(parts))
    return lines


# ------------------------------------------------------------------------------------------------
# the report


def build_report(
    src: Sources,
    *,
    now: float | None = None,
    ask_backend: bool = True,
    stall_after_s: float | None = None,
    status_of: StatusOf | None = None,
    reference: dict | None = None,
) -> dict:
    """The report dict (schema `docs/monitor-schema.json`); each section comes from one function below.
    With `ask_backend` and `status_of` (the CLI passes `supervise.attempts.handle_status`), the live
    attempt's state comes from its backend; otherwise from the journal."""
    now = time.time() if now is None else now
    r = src.reader
    recipe = _recipe(src.run_doc)
    journal = src.journal
    loss = r.series(LOSS_TAG)
    step = r.max_step()
    final_step = recipe.train.max_steps if recipe else None
    committed_step = (src.committed or [None])[-1]
    live = live_attempt_of(
        src.path, journal, status_of if ask_backend else None, committed_step, final_step, now=now
    )
    device_name = live.get("device") or (src.run_doc or {}).get("device")

    tokens_per_step, tokens_seen = _tokens(r, recipe, step)
    flops_tok = _flops_per_token(recipe)
    devices_of = _devices_of(journal, src.run_doc)
    win = _windows(r, loss, tokens_per_step, flops_tok, devices_of)
    times = _step_times(loss, win, tokens_per_step)
    live_devices = devices_of(int(live["attempt"])) if live.get("attempt") is not None else devices_of(-1)
    throughput = _throughput(
        device_name,
        live_devices[0] if live_devices else None,
        times,
        tokens_per_step,
        flops_tok,
        devices_of,
    )
    skipped, skipped_warnings = _skipped_steps(r)
    pct, eta_s = _eta(step, final_step, times.recent, live.get("state"))
    replayed = r.replays(LOSS_TAG)
    mism = r.mismatches()
    model = rounding_model(recipe)
    bounds = replay_bounds(
        mism, lambda tag, a: _first_step_of(r, tag, a), layout_of_attempts(journal, src.run_doc), model
    )
    rounded = sum(b is not None for b in bounds)
    problems = r.problems()
    hosts, host_warnings = _hosts_section(r)
    memo = with_audit(_memorization(r, reference), src.audit)
    warnings = [
        *times.warnings,
        *skipped_warnings,
        *_loss_spike_warning(loss),
        *host_warnings,
        *_stall_warning(live, loss, times.median, now, stall_after_s),
        *_mismatch_warning([m for m, b in zip(mism, bounds, strict=True) if b is None]),
        *problems,
        *_versions_warning(journal),
        *memorization_warnings(memo),
    ]
    files = r.files.values()
    return {
        "schema": SCHEMA_ID,
        "run": (src.run_doc or {}).get("run") or src.path.rstrip("/").rsplit("/", 1)[-1],
        "path": src.path,
        "generated_at": _iso(now),
        "step": step,
        "final_step": final_step,
        "progress_pct": _f(pct),
        "last": {k: _f(v) for k, v in r.last().items()},
        "loss": _loss_section(r, loss),
        "tokens": {
            "seen": tokens_seen,
            "per_step": tokens_per_step,
            "per_s": throughput["tokens_per_s"],
            "per_s_run_avg": _f(times.tps_avg),
        },
        "throughput": throughput,
        "eta_s": _f(eta_s),
        "eta": _iso(now + eta_s) if eta_s is not None else None,
        "skipped_steps": skipped,
        "checkpoint": _checkpoint_section(src.committed or [], step, recipe, src.path, src.run_doc),
        "attempt": live,
        "timeline": _timeline(journal),
        "amendments": amendments_of(src.run_doc),
        "goodput": _goodput(
            journal, times.per_attempt, times.median, replayed, loss, r, now, live, final_step, src.committed
        ),
        "attempts_in_events": _attempts_in_events(r, times.per_attempt),
        "replays": {
            "steps": replayed,
            "mismatch_count": len(mism),
            "mismatches": [
                {**m.__dict__, "earlier": _f(m.earlier), "later": _f(m.later), "layout_rounding_bound": _f(b)}
                for m, b in zip(mism[:20], bounds, strict=False)
            ],
            # of those, the values a later attempt on another device layout recomputed equal up to
            # layout rounding (observe/rounding.py): no warning
            "layout_rounding_count": rounded,
            "rounding_tolerance": model.to_dict() if model is not None and rounded else None,
        },
        "hosts": hosts,
        "memorization": memo,
        "warnings": warnings,
        "reader": {
            "files": len(r.files),
            "records": sum(f.records for f in files),
            "bytes": sum(f.offset for f in files),
            "problems": problems,
        },
    }


def amendments_of(run_doc: dict | None) -> list[dict]:
    """run.yaml's amendments (`olmo-ctl amend`), oldest first: what each changes and the step it takes
    effect at (None while it waits for the next attempt)."""
    out = []
    for a in (run_doc or {}).get("amendments") or []:
        if not isinstance(a, dict):
            continue
        out.append(
            {
                "id": a.get("id"),
                "time": a.get("time"),
                "changes": [
                    {"key": c.get("key"), "old": c.get("old"), "new": c.get("new")}
                    for c in a.get("changes") or []
                    if isinstance(c, dict)
                ],
                "from_step": a.get("from_step"),
                "attempt": a.get("attempt"),
                "restart": bool(a.get("restart")),
            }
        )
    return out


def amendment_lines(amendments: list[dict]) -> list[str]:
    """`amended train.max_steps 40 -> 60: from step 21 (attempt 2)`, one line per amendment."""
    lines = []
    for a in amendments:
        what = ", ".join(f"{c['key']} {c['old']} -> {c['new']}" for c in a["changes"])
        when = (
            f"from step {a['from_step']:,} (attempt {a['attempt']})"
            if a.get("from_step") is not None
            else "pending: from the next attempt" + (" (restart requested)" if a.get("restart") else "")
        )
        lines.append(f"amended {what}: {when}")
    return lines


def _memorization(r: EventReader, reference: dict | None) -> dict | None:
    """The memorization alarm against `reference` (`compare.reference_curves`), or None without one."""
    if reference is None:
        return None
    own_train = r.series(TRAIN_TAG)
    own_held = next((s for s in (r.series(t) for t in HELDOUT_TAGS) if s is not None and len(s)), None)
    if own_train is None or not len(own_train):
        return {
            "reference": reference["src"],
            "judged": False,
            "alarm": False,
            "ranges": [],
            "reason": "no training loss yet",
        }
    m = memorization(
        (own_train.steps, own_train.values),
        (own_held.steps, own_held.values) if own_held is not None else None,
        reference["train"],
        reference["heldout"],
        threshold=reference["threshold"],
    )
    return {"reference": reference["src"], "heldout_reference": reference["heldout_src"], **m}


def _hosts_section(r: EventReader) -> tuple[list[dict], list[str]]:
    """Every host's latest window (`hosts/<h>/...` scalars) and a `slow_host` warning per slow host
    (core/stragglers.py: its recent data wait or compute against the other hosts')."""
    from olmo_ctl.core import stragglers

    series: dict[int, dict[str, Series]] = {}
    for tag in r.tags():
        hf = parse_host_tag(tag)
        if hf is not None:
            s = r.series(tag)
            if s is not None and len(s):
                series.setdefault(hf[0], {})[hf[1]] = s
    if not series:
        return [], []
    latest = max(int(s.steps[-1]) for by in series.values() for s in by.values())
    windows: dict[int, list[dict[str, float]]] = {}
    rows: list[dict[str, Any]] = []
    for h in sorted(series):
        by = series[h]
        if any(k not in by for k in ("step_time_s", "data_wait_s", "compute_s")):
            continue
        n = min(len(by["data_wait_s"]), len(by["compute_s"]), stragglers.RECENT)
        windows[h] = [
            {
                "data_wait_s": float(by["data_wait_s"].values[-n + i]),
                "compute_s": float(by["compute_s"].values[-n + i]),
            }
            for i in range(n)
        ]
        rows.append(
            {
                "host": h,
                "step": int(by["step_time_s"].steps[-1]),
                "step_time_s": _f(by["step_time_s"].values[-1]),
                "data_wait_s": _f(by["data_wait_s"].values[-1]),
                "compute_s": _f(by["compute_s"].values[-1]),
                "slow": [],
            }
        )
    # Judge only hosts that still report (a host of an earlier, larger slice has stopped).
    current = {h: w for h, w in windows.items() if int(series[h]["step_time_s"].steps[-1]) == latest}
    warnings = []
    for slow in stragglers.slow_hosts(current):
        for row in rows:
            if row["host"] == slow.host:
                row["slow"].append(slow.part)
        warnings.append(f"slow_host: {slow.message()}")
    return rows, warnings


def _tokens(r: EventReader, recipe, step: int | None) -> tuple[int | None, int | None]:
    """(tokens per step, tokens seen): from the recipe, else from the logged token counter."""
    tokens_per_step = recipe.tokens_per_step if recipe else None
    tok_series = _first(r, TOKENS_TAGS)
    if tokens_per_step is None and tok_series is not None and len(tok_series) > 1:
        # no run.yaml: the logged token counter gives the batch size
        ds = np.diff(tok_series.steps)
        dv = np.diff(tok_series.values)
        ok = ds > 0
        if ok.any():
            tokens_per_step = int(round(float(np.median(dv[ok] / ds[ok])))) or None
    tokens_seen = None
    if tok_series is not None:
        tokens_seen = int(tok_series.values[-1])
    elif tokens_per_step and step is not None:
        tokens_seen = int(step * tokens_per_step)
    return tokens_per_step, tokens_seen


@dataclass
class _StepTimes:
    """Step time and throughput from the logging windows (`Windows`), within attempts."""

    per_attempt: dict[int, dict] = field(default_factory=dict)
    now: dict | None = None  # the live attempt's last window (`Windows.row`)
    recent: float | None = None  # s/step: median of the live attempt's last RECENT_POINTS windows
    median: float | None = None  # s/step: median over the run's windows
    tps_avg: float | None = None
    warnings: list[str] = field(default_factory=list)


def _per_attempt(loss: Series) -> dict[int, dict]:
    """First and last step and wall time of each attempt's loss points."""
    out = {}
    for a in np.unique(loss.attempts):
        m = loss.attempts == a
        w = loss.wall_times[m]
        st_a = loss.steps[m]
        first_fetch = st_a[w == w[0]]
        out[int(a)] = {
            "first_wall": float(w.min()),
            "last_wall": float(w.max()),
            "first_step": int(st_a[0]),
            "last_step": int(st_a[-1]),
            "first_fetch_steps": int(first_fetch[-1] - st_a[0] + 1),
            "points": int(m.sum()),
        }
    return out


def _step_times(loss: Series | None, win: Windows, tokens_per_step: int | None) -> _StepTimes:
    out = _StepTimes()
    if loss is None or not len(loss):
        return out
    out.per_attempt = per_attempt = _per_attempt(loss)
    if not len(win):
        return out
    out.median = float(np.median(win.step_time_s))
    live = win.of_attempt(int(loss.attempts[-1]))  # the attempt that wrote the latest step
    if len(live):
        out.now = live.row(len(live) - 1)
        out.recent = float(np.median(live.step_time_s[-RECENT_POINTS:]))
    stepping_s = 0.0
    for info in per_attempt.values():
        info["span_s"] = info["last_wall"] - info["first_wall"] + info["first_fetch_steps"] * out.median
        stepping_s += info["span_s"]
    if tokens_per_step:
        done_steps = sum(i["last_step"] - i["first_step"] + 1 for i in per_attempt.values())
        out.tps_avg = tokens_per_step * done_steps / stepping_s if stepping_s > 0 else None
    # slow host: recent throughput well below the run's median
    if out.recent and len(win) >= 2 * RECENT_POINTS and out.median / out.recent < SLOW_FRACTION:
        out.warnings.append(
            f"throughput below the run's median: {out.recent:.3g} s/step recently vs "
            f"{out.median:.3g} s/step median ({out.median / out.recent:.0%}); "
            "a slow host or a throttled device?"
        )
    return out


def _flops_per_token(recipe) -> float | None:
    if not recipe:
        return None
    try:
        from olmo_ctl.core.flops import flops_per_token_olmo_core

        return flops_per_token_olmo_core(recipe.model, recipe.train.seq_len)
    except Exception:
        return None


def _run_avg_across_attempts(
    per_attempt: dict,
    devices_of: Callable[[int], tuple[int, float] | None],
    tokens_per_step: int,
    flops_tok: float,
) -> tuple[float | None, float | None] | None:
    """(TFLOP/s per device, MFU) over the run: the FLOPs of every step over the device-seconds (and peak
    FLOP-seconds) of every attempt, so attempts on different devices (a resize) weigh by their
    device-seconds. None when an attempt ran on an unknown device."""
    placed = {a: devices_of(a) for a in per_attempt}
    if not all(placed.values()):
        return None
    flops = (
        sum((i["last_step"] - i["first_step"] + 1) for i in per_attempt.values())
        * tokens_per_step
        * flops_tok
    )
    dev_s = sum(i["span_s"] * placed[a][0] for a, i in per_attempt.items())  # type: ignore[index]
    peak_s = sum(i["span_s"] * placed[a][0] * placed[a][1] for a, i in per_attempt.items())  # type: ignore[index]
    return (flops / dev_s / 1e12 if dev_s > 0 else None), (flops / 1e12 / peak_s if peak_s > 0 else None)


def _throughput(
    device_name: str | None,
    devices: int | None,
    times: _StepTimes,
    tokens_per_step: int | None,
    flops_tok: float | None,
    devices_of: Callable[[int], tuple[int, float] | None],
) -> dict:
    """The `throughput` section: "now" is the live attempt's last logging window (`Windows`); the run
    average is every step's tokens (FLOPs) over the time spent stepping (its device-seconds)."""
    now = times.now or {}
    tps_now = _f(now.get("tokens_per_s"))
    per_dev = _f(now.get("tokens_per_s_per_device"))
    if devices is None and tps_now and per_dev:  # no device named (a trainer-only run directory)
        devices = round(tps_now / per_dev)
    tflops_now, mfu_now = _f(now.get("tflops_per_device")), _f(now.get("mfu"))
    tflops_avg = mfu_avg = None
    if times.tps_avg and tokens_per_step and flops_tok:
        across = _run_avg_across_attempts(times.per_attempt, devices_of, tokens_per_step, flops_tok)
        if across is not None:
            tflops_avg, mfu_avg = across
    if tflops_avg is None and times.tps_avg and tps_now:
        # no device for an attempt: the same device throughout, so FLOP rates scale with tokens/s
        scale = times.tps_avg / tps_now
        tflops_avg = tflops_now * scale if tflops_now is not None else None
        mfu_avg = mfu_now * scale if mfu_now is not None else None
    window = None
    if times.now:
        window = {"attempt": now["attempts"], "first_step": now["first_steps"], "last_step": now["steps"]}
    return {
        "device": device_name,
        "devices": devices,
        "window": window,
        "step_time_s": _f(now.get("step_time_s")),
        "step_time_median_s": _f(times.median),
        "tokens_per_s": tps_now,
        "tokens_per_s_per_device": per_dev,
        "tflops_per_device": tflops_now,
        "tflops_per_device_run_avg": _f(tflops_avg),
        "mfu": mfu_now,
        "mfu_run_avg": _f(mfu_avg),
        "flops_formula": "olmo_core" if flops_tok else None,
        "flops_per_token": _f(flops_tok),
    }


def _loss_section(r: EventReader, loss: Series | None) -> dict:
    ev = r.series(EVAL_TAG)
    return {
        "train_ce": _f(loss.values[-1]) if loss is not None and len(loss) else None,
        "train_ce_smoothed": _f(_recent_mean(loss.values) if loss is not None else None),
        "eval_lm_loss": _f(ev.values[-1]) if ev is not None and len(ev) else None,
        "eval_step": int(ev.steps[-1]) if ev is not None and len(ev) else None,
    }


def _skipped_steps(r: EventReader, window: int = 1000) -> tuple[dict, list[str]]:
    """The `skipped_steps` section, and a warning when skips in the last `window` steps are rising."""
    sk = _first(r, SKIPPED_TAGS)
    skipped_total = int(np.nansum(sk.values)) if sk is not None else None
    skipped_recent = None
    warnings = []
    if sk is not None and len(sk):
        recent = sk.steps > (sk.steps[-1] - window)
        skipped_recent = int(np.nansum(sk.values[recent]))
        earlier = ~recent
        if skipped_recent >= 3 and earlier.any():
            span_before = max(1, int(sk.steps[earlier][-1] - sk.steps[0] + 1))
            rate_before = float(np.nansum(sk.values[earlier])) / span_before
            if skipped_recent / window > 3 * rate_before:
                warnings.append(
                    f"skipped steps rising: {skipped_recent} in the last {window} steps "
                    f"(earlier rate {rate_before * window:.2f} per {window})"
                )
    return {"total": skipped_total, "last_1000": skipped_recent}, warnings


def _loss_spike_warning(loss: Series | None) -> list[str]:
    """A warning when the last raw loss is far above the recent level."""
    if loss is None or len(loss) < 64:
        return []
    recent = loss.values[-200:-1]
    recent = recent[np.isfinite(recent)]
    last_v = loss.values[-1]
    if len(recent) < 32:
        return []
    med = float(np.median(recent))
    spread = float(np.median(np.abs(recent - med))) * 1.4826 or float(np.std(recent)) or 1e-9
    if not math.isfinite(last_v) or last_v > med + 6 * spread and last_v > med * 1.05:
        return [f"loss spike at step {int(loss.steps[-1])}: {last_v:.4g} vs recent median {med:.4g}"]
    return []


def _stall_warning(
    live: dict, loss: Series | None, step_time_median: float | None, now: float, stall_after_s: float | None
) -> list[str]:
    """A warning when the attempt is running but no new step was logged for a while."""
    last_wall = float(loss.wall_times.max()) if loss is not None and len(loss) else None
    if live.get("state") != "running" or last_wall is None:
        return []
    limit = stall_after_s or max(300.0, 20 * (step_time_median or 0))
    if now - last_wall > limit:
        return [
            f"stalled: no new step for {now - last_wall:.0f} s while the attempt is running "
            f"(limit {limit:.0f} s)"
        ]
    return []


def _first_step_of(r: EventReader, tag: str, attempt: int) -> int | None:
    """The first step of `tag` that `attempt` wrote and that no later attempt replaced."""
    s = r.series(tag)
    if s is None:
        return None
    mine = s.steps[s.attempts == attempt]
    return int(mine.min()) if len(mine) else None


def _mismatch_warning(mism: list) -> list[str]:
    """The replayed values that differ beyond layout rounding (all of them on one device layout)."""
    if not mism:
        return []
    m0 = mism[0]
    return [
        f"{len(mism)} replayed value(s) differ after a resume; first: {m0.tag} step {m0.step}: "
        f"{m0.earlier!r} (attempt {m0.earlier_attempt}) vs {m0.later!r} (attempt {m0.later_attempt})"
    ]


# The latest attempt's states in which the run is on its way to its final step (None: no journal says
# otherwise, e.g. a trainer-only run directory): an ETA is given only in these.
GOING_ON_STATES = (None, "queued", "admitted", "running")


def _eta(
    step: int | None, final_step: int | None, step_time_last: float | None, state: str | None = None
) -> tuple:
    """(progress %, seconds to the final step); None where unknown, and while the latest attempt is
    over (`state`: succeeded short of the final step, failed, stopped, preempted): nothing runs
    toward the final step, so no time to it can be said."""
    eta_s = None
    pct = None
    if final_step and step is not None:
        pct = 100.0 * step / final_step
        if step >= final_step:
            eta_s = 0.0
        elif step_time_last and state in GOING_ON_STATES:
            eta_s = (final_step - step) * step_time_last
    return pct, eta_s


def _checkpoint_section(
    committed: list[int], step: int | None, recipe=None, path: str = "", run_doc: dict | None = None
) -> dict:
    """The newest committed checkpoint and the steps since; with tiered checkpoints
    (`checkpoint.ephemeral_interval`), whether the newest is ephemeral and the newest permanent one,
    each as it was saved (`rundir.saved_permanent`; read from the newest back to the first permanent)."""
    committed_step = committed[-1] if committed else None
    at_risk = step - (committed_step or 0) if step is not None else None
    out: dict = {"committed_step": committed_step, "steps_at_risk": at_risk, "committed": committed[-5:]}
    c = recipe.checkpoint if recipe is not None else None
    if c is not None and c.ephemeral_interval:
        intervals = (c.interval, *checkpoint_intervals(run_doc))
        ckpt = storage.join(path, "checkpoints")
        permanent = next((s for s in reversed(committed) if saved_permanent(ckpt, s, intervals)), None)
        out["permanent_step"] = permanent
        out["ephemeral"] = committed_step is not None and permanent != committed_step
    return out


def _versions_warning(journal) -> list[str]:
    """The latest `versions_changed` journal line, in the trainer's words (rundir.RunDir.check_versions)."""
    changed = [rec for rec in journal or () if rec.get("event") == "versions_changed"]
    if not changed:
        return []
    rec = changed[-1]
    return [
        f"attempt {rec.get('attempt')}: {rec.get('reason')}"
        + (" (refused to restore)" if rec.get("refused") else "")
    ]


def _attempts_in_events(r: EventReader, per_attempt: dict) -> list[dict]:
    replayed = r.replayed_by_attempt(LOSS_TAG)
    return [
        {
            "attempt": a,
            "first_step": i["first_step"],
            "last_step": i["last_step"],
            "first_time": _iso(i["first_wall"]),
            "last_time": _iso(i["last_wall"]),
            "replayed_steps": replayed.get(a, 0),
        }
        for a, i in sorted(per_attempt.items())
    ]


def _goodput(
    journal,
    per_attempt: dict,
    step_s: float | None,
    replayed: int,
    loss: Series | None,
    reader: EventReader,
    now: float,
    live: dict,
    final_step: int | None = None,
    committed: list | None = None,
) -> dict:
    """Time on steps that count / wall time, and every other second of the wall time in one bucket
    (`olmo_ctl.observe.goodput`): productive + the buckets = wall. The wall time runs from the first
    journal record (or the first step) to now while an attempt may be live, else to the last record;
    once the final step is committed it ends at that commit, so what came after (a supervisor run
    again on the finished run, a no-op attempt) costs nothing. `lost_s` is the coarse view of the
    same buckets (queueing, startup, recomputed, recovery, checkpoint, other)."""
    from olmo_ctl.observe.goodput import BUCKETS, partition

    out: dict[str, Any] = {
        "fraction": None,
        "wall_s": None,
        "productive_s": None,
        "lost_s": {
            "queueing": None,
            "startup": None,
            "recomputed": None,
            "recovery": None,
            "checkpoint": None,
            "other": None,
        },
        "buckets": dict.fromkeys(BUCKETS),
    }
    if not per_attempt or step_s is None or loss is None or not len(loss):
        return out
    last_wall = max(i["last_wall"] for i in per_attempt.values())
    start = min(i["first_wall"] - i.get("first_fetch_steps", 1) * step_s for i in per_attempt.values())
    end = last_wall
    done_at = _final_commit_time(journal, reader, final_step, committed)
    timed = sorted(
        ((t, r) for r in journal or () if (t := _parse_time(r.get("time"))) is not None), key=lambda x: x[0]
    )
    if timed:
        start = min(start, timed[0][0])
        end = max(end, timed[-1][0])
    if done_at is not None:
        end = max(last_wall, done_at)
    elif live.get("state") in ("running", "queued", "admitted"):
        end = max(end, now)
    productive, b = partition(timed, loss, step_s, reader.series, start, end)
    wall = max(end - start, 1e-9)
    out.update(fraction=productive / wall, wall_s=wall, productive_s=productive, buckets=b)
    out["lost_s"] = {
        "queueing": b["queueing"] + b["waiting_for_capacity"],
        "startup": b["program_startup"] + b["checkpoint_restore"] + b["data_loading"],
        "recomputed": b["wasted_progress"],
        "recovery": b["infrastructure_recovery"],
        "checkpoint": b["checkpoint_save"],
        "other": b["other"],
    }
    return out


def _final_commit_time(
    journal: list | None, reader: EventReader, final_step: int | None, committed: list | None
) -> float | None:
    """When the final step's checkpoint was committed (None: it is not, or the final step is unknown):
    the trainer logs `checkpoint/save_duration_s` once the final save has committed; without that, the
    first journal record that saw it committed."""
    if not final_step or not committed or max(committed) < final_step:
        return None
    ck = reader.series(CKPT_TAG)
    if ck is not None and len(ck) and ck.steps[-1] >= final_step:
        return float(ck.wall_times[np.searchsorted(ck.steps, final_step)])
    seen = [
        t
        for r in journal or []
        if r.get("committed_step") is not None
        and int(r["committed_step"]) >= final_step
        and (t := _parse_time(r.get("time"))) is not None
    ]
    return min(seen) if seen else None


def monitor(path: str, **kw) -> dict:
    """Read a run directory once and build its report."""
    return build_report(load(path), **kw)
