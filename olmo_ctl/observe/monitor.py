"""The monitor report: one dict built from a run directory (events, journal, checkpoints, run.yaml)
plus, when it can be asked, the backend's status of the live attempt.

The dict's shape is the stable JSON schema `docs/monitor-schema.json` (`olmo-ctl monitor -o json`);
the table view and the plot are drawn from it. Everything is derived from data the run directory
keeps, so two people monitoring the same run see the same numbers:

* progress, tokens, losses: the de-duplicated TensorBoard scalars (`olmo_ctl.observe.reader`);
* step time, tokens/s, TFLOP/s, MFU: wall times of `train/CE loss` points within one attempt
  (a gap between attempts is never counted as a slow step) and `olmo_ctl.core.flops` for the model;
* goodput: time on steps that count / wall time, and where the rest went (queueing and start-up from
  the journal, steps recomputed after a resume, checkpoint saves from `checkpoint/save_duration_s`).

Step semantics: a metric logged at step N describes the N-th step; checkpoint N holds the state after
N steps, so the steps at risk are `step - committed_step`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.core.transient import is_transient
from olmo_ctl.observe.reader import EventReader
from olmo_ctl.observe.series import Series
from olmo_ctl.rundir import RunDir, run_recipe

# (run directory, a journal `handle`) -> the backend's AttemptStatus of that attempt, or None
StatusOf = Callable[[str, dict], Any]

SCHEMA_ID = "olmo-ctl/monitor/v1"
LOSS_TAG = "train/CE loss"
EVAL_TAG = "eval/lm_loss"
LR_TAGS = ("optim/LR (group 0)",)
TOKENS_TAGS = ("throughput/total tokens", "perf/total_tokens")
SKIPPED_TAGS = ("optim/step skipped", "optim/step_skipped")
CKPT_TAG = "checkpoint/save_duration_s"
EMA_ALPHA = 0.02  # smoothing of the train loss: an EMA over ~50 logged points
RECENT_POINTS = 50  # "instantaneous" rates: over the last this-many logged intervals of the live attempt
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

    def refresh(self) -> None:
        def go():
            self.reader.refresh()
            self.journal = _journal(self.path)
            self.committed = _committed(self.path)

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


def _ema(values: np.ndarray, alpha: float = EMA_ALPHA) -> float | None:
    if not len(values):
        return None
    v = values[-min(len(values), 2000) :]
    v = v[np.isfinite(v)]
    if not len(v):
        return None
    w = (1 - alpha) ** np.arange(len(v) - 1, -1, -1)
    return float((w * v).sum() / w.sum())


def _fetch_ends(s: Series) -> np.ndarray:
    """Indices of the last point of each host fetch: a trainer that fetches metrics every k steps writes
    k points with one wall time, so only the last of each group marks when its step finished."""
    if not len(s):
        return np.zeros(0, np.int64)
    end = np.ones(len(s), dtype=bool)
    end[:-1] = (s.wall_times[1:] != s.wall_times[:-1]) | (s.attempts[1:] != s.attempts[:-1])
    return np.flatnonzero(end)


def _intervals(s: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seconds per step between consecutive fetches of one attempt:
    (steps covered, s/step, wall time at the end, step at the end)."""
    idx = _fetch_ends(s)
    if len(idx) < 2:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, np.int64)
    st, wt, at = s.steps[idx], s.wall_times[idx], s.attempts[idx]
    same = (at[1:] == at[:-1]) & (st[1:] > st[:-1])
    dstep = (st[1:] - st[:-1])[same]
    dwall = (wt[1:] - wt[:-1])[same]
    ok = dwall > 0
    return dstep[ok], dwall[ok] / dstep[ok], wt[1:][same][ok], st[1:][same][ok]


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
    if not run_doc or not isinstance(run_doc.get("recipe"), dict):
        return None
    try:
        return run_recipe(run_doc, "run.yaml")
    except Exception:
        return None


def _device(name: str | None):
    if not name:
        return None
    try:
        from olmo_ctl.core.devices import get_device

        return get_device(name)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# the live attempt


def _live_attempt(path: str, journal: list | None, status_of: StatusOf | None) -> dict:
    out: dict[str, Any] = {
        "attempt": None,
        "state": None,
        "reason": "",
        "source": "",
        "device": None,
        "backend": None,
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
    last_state = next((r for r in reversed(mine) if r.get("event") in _EVENT_STATE), None)
    if last_state is not None:
        out["state"] = _EVENT_STATE[last_state["event"]]
        out["reason"] = last_state.get("reason") or ""
        out["source"] = f"journal ({last_state.get('time', '?')})"
    handle = next((r.get("handle") for r in reversed(mine) if isinstance(r.get("handle"), dict)), None)
    # A terminal journal record (written by the supervisor, which saw the outcome) is final; the backend
    # is asked only while the journal says the attempt may still be live.
    if handle and status_of is not None and out["state"] in (None, "queued", "admitted", "running"):
        out["backend"] = handle.get("backend")
        try:
            st = status_of(path, handle)
        except OlmoCtlError as e:
            out["source"] += f"; backend status unavailable: {e.one_line()}"
            st = None
        except Exception as e:  # a backend bug must not hide the rest of the report
            out["source"] += f"; backend status failed: {type(e).__name__}: {e}"
            st = None
        if st is not None:
            out["state"] = st.state.value
            out["reason"] = st.reason or out["reason"]
            out["source"] = f"{handle.get('backend')} backend" + (f": {st.source}" if st.source else "")
    return out


def _timeline(journal: list | None) -> list[dict]:
    if not journal:
        return []
    keep = ("time", "event", "attempt", "device", "reason", "committed_step")
    return [{k: r.get(k) for k in keep} for r in journal]


def timeline_summary(timeline: list[dict]) -> list[str]:
    """One line per attempt: `#2 cpu-4: queued → admitted → running → preempted (exit 143)`."""
    per: dict[int, list] = {}
    for r in timeline:
        if r.get("attempt") is None or r.get("event") not in _EVENT_STATE and r.get("event") != "resized":
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
                f"{ev} ({why})" if why and ev in ("preempted", "failed", "stalled", "resized") else ev
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
    live = _live_attempt(src.path, journal, status_of if ask_backend else None)
    device_name = live.get("device") or (src.run_doc or {}).get("device")

    tokens_per_step, tokens_seen = _tokens(r, recipe, step)
    times = _step_times(loss, tokens_per_step)
    throughput = _throughput(r, recipe, device_name, journal, times, tokens_per_step)
    skipped, skipped_warnings = _skipped_steps(r)
    pct, eta_s = _eta(step, final_step, times.last)
    replayed = r.replays(LOSS_TAG)
    mism = r.mismatches()
    problems = r.problems()
    hosts, host_warnings = _hosts_section(r)
    warnings = [
        *times.warnings,
        *skipped_warnings,
        *_loss_spike_warning(loss),
        *host_warnings,
        *_stall_warning(live, loss, times.median, now, stall_after_s),
        *_mismatch_warning(mism),
        *problems,
        *_versions_warning(journal),
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
            "per_s": _f(times.tps_recent),
            "per_s_run_avg": _f(times.tps_avg),
        },
        "throughput": throughput,
        "eta_s": _f(eta_s),
        "eta": _iso(now + eta_s) if eta_s is not None else None,
        "skipped_steps": skipped,
        "checkpoint": _checkpoint_section(src.committed or [], step),
        "attempt": live,
        "timeline": _timeline(journal),
        "goodput": _goodput(journal, times.per_attempt, times.median, replayed, loss, r, now, live),
        "attempts_in_events": _attempts_in_events(r, times.per_attempt),
        "replays": {
            "steps": replayed,
            "mismatch_count": len(mism),
            "mismatches": [{**m.__dict__, "earlier": _f(m.earlier), "later": _f(m.later)} for m in mism[:20]],
        },
        "hosts": hosts,
        "warnings": warnings,
        "reader": {
            "files": len(r.files),
            "records": sum(f.records for f in files),
            "bytes": sum(f.offset for f in files),
            "problems": problems,
        },
    }


def _hosts_section(r: EventReader) -> tuple[list[dict], list[str]]:
    """Every host's latest window (`hosts/<h>/...` scalars) and a `slow_host` warning per slow host
    (core/stragglers.py: its recent data wait or compute against the other hosts')."""
    from olmo_ctl.core import stragglers

    series: dict[int, dict[str, Series]] = {}
    for tag in r.tags():
        parts = tag.split("/")
        if len(parts) == 3 and parts[0] == "hosts" and parts[1].isdigit():
            s = r.series(tag)
            if s is not None and len(s):
                series.setdefault(int(parts[1]), {})[parts[2]] = s
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
    """Step time and throughput from the loss points' wall times, within attempts."""

    per_attempt: dict[int, dict] = field(default_factory=dict)
    last: float | None = None  # recent s/step of the live attempt
    median: float | None = None  # s/step over the run
    tps_recent: float | None = None
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


def _step_times(loss: Series | None, tokens_per_step: int | None) -> _StepTimes:
    out = _StepTimes()
    if loss is None or not len(loss):
        return out
    out.per_attempt = per_attempt = _per_attempt(loss)
    per_step_s = _intervals(loss)[1]
    if not len(per_step_s):
        return out
    out.median = float(np.median(per_step_s))
    live_mask = loss.attempts == loss.attempts[-1]  # the attempt that wrote the latest step
    live_series = Series(
        loss.tag,
        loss.steps[live_mask],
        loss.wall_times[live_mask],
        loss.values[live_mask],
        loss.attempts[live_mask],
    )
    recent_s = _intervals(live_series)[1][-RECENT_POINTS:]
    if len(recent_s):
        out.last = float(np.median(recent_s))
    stepping_s = 0.0
    for info in per_attempt.values():
        info["span_s"] = info["last_wall"] - info["first_wall"] + info["first_fetch_steps"] * out.median
        stepping_s += info["span_s"]
    if tokens_per_step:
        if out.last:
            out.tps_recent = tokens_per_step / out.last
        done_steps = sum(i["last_step"] - i["first_step"] + 1 for i in per_attempt.values())
        out.tps_avg = tokens_per_step * done_steps / stepping_s if stepping_s > 0 else None
    # slow host: recent throughput well below the run's median
    if out.last and len(per_step_s) >= 2 * RECENT_POINTS and out.median / out.last < SLOW_FRACTION:
        out.warnings.append(
            f"throughput below the run's median: {out.last:.3g} s/step recently vs "
            f"{out.median:.3g} s/step median ({out.median / out.last:.0%}); "
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
    journal: list | None, per_attempt: dict, tokens_per_step: int, flops_tok: float
) -> tuple[float | None, float | None] | None:
    """(TFLOP/s per device, MFU) over the run when its attempts ran on different devices (a resize):
    each attempt weighted by its device-seconds. None when the run has one attempt or an unknown device."""
    att_dev = {
        int(x["attempt"]): _device(x.get("device"))
        for x in journal or []
        if x.get("attempt") is not None and x.get("device")
    }
    if len(per_attempt) <= 1 or not all(att_dev.get(a) for a in per_attempt):
        return None
    flops = (
        sum((i["last_step"] - i["first_step"] + 1) for i in per_attempt.values())
        * tokens_per_step
        * flops_tok
    )
    dev_s = sum(i["span_s"] * att_dev[a].devices for a, i in per_attempt.items())
    peak_s = sum(
        i["span_s"] * att_dev[a].devices * att_dev[a].peak_tflops_per_device for a, i in per_attempt.items()
    )
    return (flops / dev_s / 1e12 if dev_s > 0 else None), (flops / 1e12 / peak_s if peak_s > 0 else None)


def _throughput(
    r: EventReader,
    recipe,
    device_name: str | None,
    journal: list | None,
    times: _StepTimes,
    tokens_per_step: int | None,
) -> dict:
    """The `throughput` section: step times, TFLOP/s and MFU (computed, else what the trainer logged)."""
    dev = _device(device_name)
    flops_tok = _flops_per_token(recipe)
    tflops_recent = tflops_avg = mfu_recent = mfu_avg = None
    n_devices = dev.devices if dev else None
    if flops_tok and n_devices:
        if times.tps_recent:
            tflops_recent = times.tps_recent / n_devices * flops_tok / 1e12
        peak = dev.peak_tflops_per_device
        if times.tps_avg:
            tflops_avg = times.tps_avg / n_devices * flops_tok / 1e12
            mfu_avg = tflops_avg / peak if peak else None
            # tps_avg is known only with tokens_per_step
            across = (
                _run_avg_across_attempts(journal, times.per_attempt, tokens_per_step, flops_tok)
                if tokens_per_step
                else None
            )
            if across is not None:
                tflops_avg, mfu_avg = across
        if peak:
            mfu_recent = tflops_recent / peak if tflops_recent else None
    if mfu_recent is None:  # fall back to what the trainer logged
        mfu_recent = _last_value(r, "throughput/device/MFU")
        mfu_avg = mfu_avg if mfu_avg is not None else _last_value(r, "throughput/device/MFU (actual avg)")
    return {
        "device": device_name,
        "devices": n_devices,
        "step_time_s": _f(times.last),
        "step_time_median_s": _f(times.median),
        "tflops_per_device": _f(tflops_recent),
        "tflops_per_device_run_avg": _f(tflops_avg),
        "mfu": _f(mfu_recent),
        "mfu_run_avg": _f(mfu_avg),
        "flops_formula": "olmo_core" if flops_tok else None,
        "flops_per_token": _f(flops_tok),
    }


def _last_value(r: EventReader, tag: str) -> float | None:
    s = r.series(tag)
    return float(s.values[-1]) if s is not None and len(s) else None


def _loss_section(r: EventReader, loss: Series | None) -> dict:
    ev = r.series(EVAL_TAG)
    return {
        "train_ce": _f(loss.values[-1]) if loss is not None and len(loss) else None,
        "train_ce_smoothed": _f(_ema(loss.values) if loss is not None else None),
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


def _mismatch_warning(mism: list) -> list[str]:
    if not mism:
        return []
    m0 = mism[0]
    return [
        f"{len(mism)} replayed value(s) differ after a resume; first: {m0.tag} step {m0.step}: "
        f"{m0.earlier!r} (attempt {m0.earlier_attempt}) vs {m0.later!r} (attempt {m0.later_attempt})"
    ]


def _eta(step: int | None, final_step: int | None, step_time_last: float | None) -> tuple:
    """(progress %, seconds to the final step); None where unknown."""
    eta_s = None
    pct = None
    if final_step and step is not None:
        pct = 100.0 * step / final_step
        if step_time_last and step < final_step:
            eta_s = (final_step - step) * step_time_last
        elif step >= final_step:
            eta_s = 0.0
    return pct, eta_s


def _checkpoint_section(committed: list[int], step: int | None) -> dict:
    committed_step = committed[-1] if committed else None
    at_risk = step - (committed_step or 0) if step is not None else None
    return {"committed_step": committed_step, "steps_at_risk": at_risk, "committed": committed[-5:]}


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
) -> dict:
    out: dict[str, Any] = {
        "fraction": None,
        "wall_s": None,
        "productive_s": None,
        "lost_s": {"queueing": None, "startup": None, "recomputed": None, "checkpoint": None, "other": None},
    }
    if not per_attempt or step_s is None:
        return out
    # logged interval (metrics_every): replayed points stand for that many steps each
    every = 1
    if loss is not None and len(loss) > 1:
        every = max(1, int(np.median(np.diff(loss.steps))))
    recomputed_s = replayed * every * step_s
    ck = reader.series(CKPT_TAG)
    ckpt_s = float(np.nansum(ck.values)) if ck is not None and len(ck) else 0.0
    stepping = sum(i.get("span_s", 0.0) for i in per_attempt.values())
    last_wall = max(i["last_wall"] for i in per_attempt.values())
    start = min(i["first_wall"] - i.get("first_fetch_steps", 1) * step_s for i in per_attempt.values())
    end = last_wall
    queue_s = startup_s = 0.0
    if journal:
        times = [t for t in (_parse_time(r.get("time")) for r in journal) if t is not None]
        if times:
            start = min(start, min(times))
            end = max(end, max(times))
        for n, info in per_attempt.items():
            recs = [r for r in journal if r.get("attempt") == n]
            t = {
                ev: _parse_time(next((r.get("time") for r in recs if r.get("event") == ev), None))
                for ev in ("submitted", "queued", "admitted", "running")
            }
            t_sub = t["submitted"] or t["queued"]
            t_adm = t["admitted"] or t["running"]
            if t_sub and t_adm and t_adm > t_sub:
                queue_s += t_adm - t_sub
            t_start = t["running"] or t["admitted"] or t_sub
            if t_start:
                startup_s += max(
                    0.0, info["first_wall"] - info.get("first_fetch_steps", 1) * step_s - t_start
                )
    if live.get("state") in ("running", "queued", "admitted"):
        end = max(end, now)
    wall = max(end - start, 1e-9)
    # spans come from the de-duplicated points: replayed occurrences are not in them, only in recomputed_s
    productive = max(0.0, stepping - ckpt_s)
    other = max(0.0, wall - productive - recomputed_s - ckpt_s - queue_s - startup_s)
    out.update(fraction=productive / wall, wall_s=wall, productive_s=productive)
    out["lost_s"] = {
        "queueing": queue_s,
        "startup": startup_s,
        "recomputed": recomputed_s,
        "checkpoint": ckpt_s,
        "other": other,
    }
    return out


def monitor(path: str, **kw) -> dict:
    """Read a run directory once and build its report."""
    return build_report(load(path), **kw)
