"""The run directory: the single source of truth of a run, on gs:// or a local path.

    <run>/run.yaml           resolved recipe + fingerprints, written once (create-only write); `versions`
                             set by the trainer's first attempt, updated when an attempt runs with others
    <run>/journal.jsonl      one JSON line per event; see `append`
    <run>/lease.json         which supervisor drives the run (generation-match compare-and-swap)
    <run>/resize.json        a pending resize request (written by `resize`, consumed by the supervisor)
    <run>/stop.json          a stop in progress (written by `stop`; a supervisor that sees it ends)
    <run>/restart.json       a pending `amend --restart` (consumed by the supervisor)
    <run>/stop_at_checkpoint.json  an attempt asked to stop once its next checkpoint commits (written
                             by `resize --at-next-checkpoint` and `amend --restart`, read by the trainer)
    <run>/checkpoints/<N>/   Orbax steps; only committed ones count (see `committed_steps`)

Everything goes through `olmo_ctl.storage`, so the same code serves both kinds of path. GCS has no
append: the journal is rewritten whole with a generation match (read, add a line, write if nobody
wrote in between, retry otherwise); locally a line is appended with O_APPEND under an flock. Both
leave one `journal.jsonl` that holds the whole history.

Step semantics: checkpoint `<N>` holds the state after N completed steps (docs/CONTRACTS.md).
Storage errors are never read as "no checkpoint": they propagate (exit 3), so a supervisor cannot
restart a run from step 0 because a listing failed.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from olmo_ctl import storage
from olmo_ctl.core import amend, versions
from olmo_ctl.core.contracts import segment_names_from
from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import EXIT_UNREACHABLE, BadInput, OlmoCtlError
from olmo_ctl.core.names import validate_run_name
from olmo_ctl.core.recipe import recipe_from_dict
from olmo_ctl.storage import NotFound, PreconditionFailed

COMMIT_MARKER = "commit_success.txt"  # Orbax's commit file (atomicity_types.COMMIT_SUCCESS_FILE)
_STEP_DIR = re.compile(r"^(\d+)$")
JOURNAL_EVENTS = (
    "submitted",
    "queued",
    "admitted",
    "running",
    "preempted",
    "failed",
    "succeeded",
    "resized",
    "stalled",
    "resize_requested",
    "stop_requested",
    "supervisor_started",
    "supervisor_detached",
    "supervisor_stopped",
    "reattached",
    "backoff",
    "gave_up",
    "done",
    "stopped",
    "lease_lost",
    "versions_changed",
    "exited",
    "amended",
    "amendment_applied",
    "restart_requested",
    "restarted",
)


def utc_now_iso(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(s: str) -> float:
    """A journal time: what `utc_now_iso` writes, else any ISO 8601 time (UTC when it names no zone);
    ValueError for anything else."""
    try:
        return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        t = dt.datetime.fromisoformat(s)
        return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()


# ---------------------------------------------------------------- records that cannot be read
# A file of the run directory torn mid-write or edited by hand is bad input: a record that cannot be
# read is skipped with one warning naming the file and its lines (the journal, attempt files), or the
# command exits 2 naming the file (lease.json: nobody could tell who drives the run). No decision is
# ever made on a record that could not be read (docs/CONTRACTS.md, "Records that cannot be read").

_WARNED: set[tuple[str, str]] = set()


def warn(text: str, *, once_key: str | None = None) -> None:
    """One `warning:` line on stderr (stdout stays machine-readable); with `once_key`, once per process
    for that key and text (a watch or a supervisor reads the same file again and again)."""
    import sys

    if once_key is not None:
        if (once_key, text) in _WARNED:
            return
        _WARNED.add((once_key, text))
    sys.stderr.write(f"warning: {text}\n")


_NoneType = type(None)
_INT: tuple[type, ...] = (int, _NoneType)
_NUM: tuple[type, ...] = (int, float, _NoneType)
_STR: tuple[type, ...] = (str, _NoneType)
_DICT: tuple[type, ...] = (dict, _NoneType)
_LIST: tuple[type, ...] = (list, _NoneType)
_BOOL: tuple[type, ...] = (bool, _NoneType)


def _kind(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list", bool: "true or false"}
    return "a number" if float in kinds else names.get(kinds[0], kinds[0].__name__)


# The fields of a journal record that the readers take for granted, and their types: `event` and
# `time` (a string `parse_iso` reads) always, the others when present. A record of any other shape is
# not a record (docs/CONTRACTS.md). Fields not named here are the event's own, read with care.
JOURNAL_FIELDS: dict[str, tuple[type, ...]] = {
    "time": (str,),
    "event": (str,),
    "attempt": _INT,
    "device": _STR,
    "reason": _STR,
    "committed_step": _INT,
    "slices": _INT,
    "exit_code": _INT,
    "from_step": _INT,
    "handle": _DICT,
    "backend": _STR,
    "site": _DICT,
    "cause": _STR,
    "seconds": _NUM,
    "delay_s": _NUM,
    "admission_timeout_s": _NUM,
    "loss": (str, int, float, _NoneType),
    "request": _STR,
    "amendment": _STR,
    "changes": _LIST,
    "from": _STR,
    "stop_unsaved": _DICT,
    "last_log_lines": _LIST,
    "refused": _BOOL,
    "allowed": _BOOL,
}
_HANDLE_FIELDS: dict[str, tuple[type, ...]] = {
    "backend": (str,),
    "name": (str,),
    "attempt": (int,),
    "data": _DICT,
}
# lease.json: every field a reader compares or computes with (RunDir.acquire_lease, supervisor_alive)
LEASE_FIELDS: dict[str, tuple[type, ...]] = {
    "holder": (str,),
    "process": (dict,),
    "acquired": (str,),
    "heartbeat": (str,),
    "heartbeat_unix": (int, float),
    "ttl_s": (int, float),
    "released": (bool,),
    "epoch": (int,),
    "reserved_attempt": (int,),
}
_PROCESS_FIELDS: dict[str, tuple[type, ...]] = {
    "host": _STR,
    "pid": _INT,
    "pid_start": _STR,
    "boot_id": _STR,
    "token": _STR,
}


def _type_problem(
    doc: Any, fields: dict[str, tuple[type, ...]], what: str, required: tuple[str, ...] = ()
) -> str | None:
    """Why `doc` is not an object whose `fields` have their types (`required` ones present), else None."""
    if not isinstance(doc, dict):
        return f"{json.dumps(doc)[:40]} is not {what} (a JSON object)"
    for k in required:
        if k not in doc:
            return f"no `{k}`"
    for k, kinds in fields.items():
        v = doc.get(k)
        if k in doc and (isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds)):
            return f"`{k}` is {json.dumps(v)[:40]}, not {_kind(kinds)}"
    return None


def journal_record_problem(rec: Any) -> str | None:
    """Why a parsed journal line is not a record the readers may decide on (JOURNAL_FIELDS), else None."""
    why = _type_problem(rec, JOURNAL_FIELDS, "a record", required=("time", "event"))
    if why is None:
        try:
            dt.datetime.fromisoformat(rec["time"])  # what parse_iso reads (fast: C; 3.11 takes any ISO 8601)
        except ValueError:
            why = f"`time` {json.dumps(rec['time'])[:40]} is not an ISO 8601 time"
    if why is None and rec["event"] == "submitted" and rec.get("attempt") is None:
        why = "a `submitted` record without its `attempt`"  # attempt numbers are counted from these
    if why is None and rec.get("handle") is not None:
        if (
            h := _type_problem(rec["handle"], _HANDLE_FIELDS, "a handle", ("backend", "name", "attempt"))
        ) is not None:
            why = f"`handle`: {h}"
    return why


def lease_problem(doc: Any) -> str | None:
    """Why a parsed lease.json is not a lease document (LEASE_FIELDS), else None."""
    why = _type_problem(doc, LEASE_FIELDS, "a lease")
    if why is None and doc.get("process") is not None:
        if (p := _type_problem(doc["process"], _PROCESS_FIELDS, "a process")) is not None:
            why = f"`process`: {p}"
    return why


def skipped_lines_warning(path: str, bad: list[tuple[int, str]]) -> None:
    """One warning for the lines of `path` that were skipped (line number, why), once per process."""
    if not bad:
        return
    shown = "; ".join(f"line {n}: {why}" for n, why in bad[:3])
    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    n = len(bad)
    warn(
        f"`{path}`: skipped {n} record{'s' if n > 1 else ''} that cannot be read ({shown}{more}); "
        "the other lines are read (torn mid-write, or edited by hand?)",
        once_key=path,
    )


class LeaseHeld(OlmoCtlError):
    """Another live supervisor holds the run. Exit 2, naming the holder."""

    def __init__(self, run: str, holder: dict):
        who = holder.get("holder", "?")
        since = holder.get("acquired", "?")
        beat = holder.get("heartbeat", "?")
        super().__init__(
            f"run `{run}` is supervised by {who} (since {since}, last heartbeat {beat})",
            "stop that supervisor first, or wait for its lease to expire "
            f"({int(holder.get('ttl_s', 0))} s after its last heartbeat)",
            2,
        )
        self.holder = holder


def _fingerprint(fp: object) -> str:
    """A fingerprint as a person reads it: `fingerprint 1a2b...`, or `no fingerprint` (a run.yaml
    written by hand or by an older version)."""
    return f"fingerprint {fp}" if fp else "no fingerprint"


class LeaseLost(OlmoCtlError):
    """Another supervisor took the run over: this one could not renew its lease within the lease's
    TTL (paused, or its storage out of reach). Not bad input: exit 3, as storage unreachable past its
    retries, the attempt left to the new holder (docs/running-on-gke.md)."""

    def __init__(self, run: str, detail: str):
        super().__init__(
            f"lost the lease on run `{run}`: {detail}",
            "another supervisor took over; this one stops",
            EXIT_UNREACHABLE,
        )


@dataclass
class Lease:
    """A held lease: renew it with `RunDir.heartbeat` before `ttl_s` passes."""

    holder: str
    generation: int
    ttl_s: float
    acquired: str
    epoch: int = 1  # one more than the previous holder's: a fencing token


def _this_holder() -> tuple[str, dict]:
    host = socket.gethostname()
    pid = os.getpid()
    return f"{os.environ.get('USER', 'user')}@{host} pid {pid}", {
        "host": host,
        "pid": pid,
        "pid_start": proc_start_time(pid),
        "token": uuid.uuid4().hex[:12],
        "boot_id": boot_id(),
    }


def boot_id() -> str | None:
    """This machine's boot (Linux: a random id per boot). Two machines, or two boots of one, differ even
    when their hostnames agree (containers, cloned VMs), so a pid is only comparable under the same one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def proc_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone
    or a zombie. With the pid it names one process: pids are reused, start times are not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(")") + 2 :].split()
    if not rest or rest[0] in ("Z", "X"):
        return None
    return rest[19] if len(rest) > 19 else None


def _holder_process_dead(lease: dict) -> bool:
    """True when the lease's holder provably ran on this machine in this boot (same boot id, not just the
    same hostname) and that process is gone: no need to wait for the TTL."""
    info = lease.get("process") or {}
    if info.get("host") != socket.gethostname() or not info.get("pid"):
        return False
    if not info.get("boot_id") or info.get("boot_id") != boot_id():
        return False
    start = proc_start_time(int(info["pid"]))
    return start is None or (info.get("pid_start") is not None and start != info.get("pid_start"))


def recorded_target(device: Any, slices: Any = None, where: str = "the run directory") -> Target:
    """The target a record of the run directory names (run.yaml, a journal record, a resize request):
    the one place above the backends where a stored device name becomes a `Target`. BadInput naming
    `where` the name came from, for a name the catalog does not know (a record of another version, or
    one edited by hand) or a slice count it cannot take."""
    try:
        return Target.parse(str(device), int(slices) if slices is not None else 1)
    except BadInput as e:
        raise BadInput(
            f"{where} records device `{device}` x {slices or 1}, which this olmo-ctl cannot use: {e.message}",
            "was it written by another version of olmo-ctl, or edited by hand? `olmo-ctl devices` lists "
            "the devices this one knows",
        ) from None


def attempt_targets(journal: list | None, run_doc: dict | None) -> Callable[[int], Target | None]:
    """attempt -> the target it ran on: its `submitted` record's device and slices (else any record of
    that attempt naming one, else run.yaml's); None where none names a device this catalog knows (a
    record of another version: the caller shows less, never fails)."""
    placed: dict[int, tuple[Any, Any]] = {}
    recs = [r for r in journal or [] if r.get("attempt") is not None and r.get("device")]
    for rec in sorted(recs, key=lambda r: r.get("event") == "submitted"):  # `submitted` says it last
        placed[int(rec["attempt"])] = (rec["device"], rec.get("slices") or 1)
    default = ((run_doc or {}).get("device"), (run_doc or {}).get("slices") or 1)

    def of(attempt: int) -> Target | None:
        name, slices = placed.get(attempt, default)
        if not name:
            return None
        try:
            return recorded_target(name, slices)
        except (OlmoCtlError, ValueError, TypeError):
            return None

    return of


def run_recipe(doc: dict, source: str, overrides: list[str] | tuple[str, ...] = (), *, pending: bool = False):
    """The Recipe of a run description: run.yaml's `recipe:` section with its `amendments` applied, those
    bound to a step (what an attempt trains); with `pending`, also those still waiting for the next
    attempt, bound where they were recorded (what the run will train: its final step)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("recipe"), dict):
        raise BadInput(f"`{source}` has no `recipe:` section", "pass --recipe FILE|NAME")
    amendments = doc.get("amendments") or []
    if not amendments:
        return recipe_from_dict(doc["recipe"], source, overrides)
    r = recipe_from_dict(doc["recipe"], source)
    for i, a in enumerate(amendments):
        try:
            if a.get("from_step") is not None:
                r = amend.apply(r, a["values"])
            elif pending:
                r = amend.apply(r, amend.bind(r, a["changes"], int(a["committed_step"]) + 1))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BadInput(
                f"`{source}`: amendments[{i}] is not an amendment ({type(e).__name__}: {e})",
                "restore run.yaml from a backup; `olmo-ctl amend` writes amendments",
            ) from None
    return recipe_from_dict(r.to_dict(), source, overrides) if overrides else r


def describe_changes(changes: list[dict]) -> str:
    """`train.max_steps 40 -> 60, eval.interval 20 -> 10`: an amendment's changes, for lines and journals."""
    return ", ".join(f"{c.get('key')} {c.get('old')} -> {c.get('new')}" for c in changes)


def _check_local_dirs(path: str) -> None:
    """A local run directory, and the run root above it, are directories or do not exist yet."""
    root = os.path.dirname(os.path.abspath(path))
    for what, p, hint in (
        ("run root", root, "pass --run-root DIR (a directory, created if missing) or gs://BUCKET/PATH"),
        ("run directory", path, "move the file aside, or choose another run name (--run NAME)"),
    ):
        if os.path.exists(p) and not os.path.isdir(p):
            raise BadInput(f"{what} `{p}` is a file, not a directory", hint)


STOP_AT_CHECKPOINT = "stop_at_checkpoint.json"  # the trainer stops once its next checkpoint commits
EVAL_JOB_REASON = "eval job"  # the `reason` of an eval job's `submitted` records (supervise/evaljob.py)


def committed_steps_in(ckpt: str) -> list[int]:
    """The committed steps of the checkpoints directory `ckpt`, ascending: the one meaning of "committed"
    (the trainer's restore and pruning, `--start-from`, `surgery`, `eval`, `monitor` and the supervisor
    all ask this), in at most one listing.

    A step counts when its directory has its final name `<N>` and holds Orbax's commit marker. Locally
    Orbax writes `<N>.orbax-checkpoint-tmp-*` and renames it when it has committed, and its own step
    list takes any `<N>` directory, so a step directory copied by hand and cut off midway (no marker)
    would count there; here it never does. gs://: one object listing of `*/commit_success.txt` (a glob
    match, so a checkpoint's thousands of array shards are not listed); a step directory without its
    marker is being written or was abandoned.
    """
    store = storage.store_for(ckpt)
    if storage.is_gcs(ckpt):
        base = ckpt.rstrip("/") + "/"
        found = set()
        for o in store.find(ckpt, match_glob=f"*/{COMMIT_MARKER}"):
            step_dir = o.path[len(base) :].split("/")[0]
            if _STEP_DIR.match(step_dir):
                found.add(int(step_dir))
        return sorted(found)
    try:
        entries = list(os.scandir(ckpt))
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for e in entries:
        m = _STEP_DIR.match(e.name)
        if m and e.is_dir() and os.path.isfile(os.path.join(e.path, COMMIT_MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def uncommitted_step_dirs(ckpt: str) -> list[int]:
    """Local step directories `<N>` without a commit marker (never written so by Orbax, which renames a
    step into place once committed: a copy cut off midway, or a marker deleted by hand), ascending."""
    if storage.is_gcs(ckpt):
        return []
    committed = set(committed_steps_in(ckpt))
    try:
        entries = list(os.scandir(ckpt))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        int(e.name)
        for e in entries
        if _STEP_DIR.match(e.name) and e.is_dir() and int(e.name) not in committed
    )


def checkpoint_meta(ckpt: str, step: int) -> dict:
    """The `meta` item (JSON) of checkpoint `step` in the checkpoints directory `ckpt`; {} where it
    cannot be read as a JSON object."""
    path = storage.join(ckpt, str(step), "meta", "metadata")
    try:
        doc = json.loads(storage.store_for(path).read_bytes(path).decode())
    except (NotFound, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def saved_permanent(ckpt: str, step: int, intervals: tuple[int, ...]) -> bool:
    """Whether committed checkpoint `step` of a tiered run is permanent. The class is fixed when the
    checkpoint is saved (its `meta["permanent"]`), so amending `checkpoint.interval` never turns a
    permanent checkpoint into an ephemeral one; a checkpoint saved before the class was recorded is
    permanent when its step is a multiple of any of `intervals` (every `checkpoint.interval` the run
    has had: `checkpoint_intervals`)."""
    recorded = checkpoint_meta(ckpt, step).get("permanent")
    if isinstance(recorded, bool):
        return recorded
    return any(step % i == 0 for i in intervals if i > 0)


def checkpoint_intervals(doc: dict | None) -> tuple[int, ...]:
    """Every `checkpoint.interval` of the run description `doc` (run.yaml): its recipe's, then each
    amendment's, once each."""
    doc = doc if isinstance(doc, dict) else {}
    recipe = doc.get("recipe")
    ck = recipe.get("checkpoint") if isinstance(recipe, dict) else None
    found = [ck.get("interval") if isinstance(ck, dict) else None]
    for a in doc.get("amendments") or []:
        values = a.get("values") if isinstance(a, dict) else None
        if isinstance(values, dict):
            found.append(values.get("checkpoint.interval"))
    return tuple(dict.fromkeys(v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0))


def near_runs(run_root: str, name: str) -> list[str]:
    """The runs of a local `run_root` whose names are close to `name` (a typo's likely meaning), closest
    first; none for a gs:// run root (listing a bucket is not worth a typo's hint) or one that is not
    there."""
    import difflib

    if storage.is_gcs(run_root) or not os.path.isdir(run_root):
        return []
    try:
        names = [
            d.name
            for d in os.scandir(run_root)
            if d.is_dir() and any(os.path.exists(os.path.join(d.path, f)) for f in ("run.yaml", SPEC))
        ]
    except OSError:
        return []
    return difflib.get_close_matches(name, names, n=3, cutoff=0.6)


def did_you_mean(names: list[str]) -> str:
    """`did you mean `a`? ` (or `a` or `b`), empty for no names."""
    if not names:
        return ""
    return "did you mean " + " or ".join(f"`{n}`" for n in names) + "? "


class RunDir:
    def __init__(self, path: str, name: str | None = None):
        self.path = str(path).rstrip("/") if str(path) != "/" else str(path)
        self.name = name or self.path.rstrip("/").rsplit("/", 1)[-1]
        self.store = storage.store_for(self.path)
        if not self.is_gcs:
            _check_local_dirs(self.path)

    @classmethod
    def of(cls, run_root: str, run: str) -> RunDir:
        validate_run_name(run)
        return cls(storage.join(run_root, run), run)

    @property
    def is_gcs(self) -> bool:
        return storage.is_gcs(self.path)

    def p(self, *parts: str) -> str:
        return storage.join(self.path, *parts)

    # ------------------------------------------------------------------ run.yaml

    def exists(self) -> bool:
        return self.store.exists(self.p("run.yaml"))

    def read_run(self) -> dict:
        return self._read_run()[0]

    def _read_run(self) -> tuple[dict, int]:
        """(run.yaml, its generation). A file that is not a run description is bad input (exit 2)."""
        path = self.p("run.yaml")
        hint = "restore it from a backup, or move the run directory aside and start the run again"
        info = self.store.stat(path)
        try:
            if info is None:
                raise NotFound(path)
            text = self.store.read_bytes(path).decode()
        except NotFound:
            self.check_new()  # a run that lost its run.yaml says so, rather than "does not exist"
            near = near_runs(self.path.rsplit("/", 1)[0], self.name) if "/" in self.path else []
            raise BadInput(
                f"run `{self.name}` does not exist at {self.path}",
                did_you_mean(near) + "create it with `olmo-ctl submit` or `resume-until-done --recipe ...`",
            ) from None
        except IsADirectoryError:
            raise BadInput(f"`{path}` is a directory, not a run description", hint) from None
        except UnicodeDecodeError:
            raise BadInput(f"`{path}` is not a run description (not UTF-8 text)", hint) from None
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as e:
            first = str(e).splitlines()[0] if str(e) else "syntax error"
            raise BadInput(f"`{path}` is not a run description (not valid YAML: {first})", hint) from None
        if not isinstance(d, dict) or not isinstance(d.get("recipe"), dict):
            raise BadInput(f"`{path}` is not a run description (no `recipe:` mapping)", hint)
        return d, info.generation

    def check_versions(
        self,
        current: dict,
        *,
        attempt: int | None = None,
        restoring: bool = False,
        allow_change: bool = False,
        write: bool = True,
    ) -> str | None:
        """Compare the versions this attempt runs with (`core.versions.installed()`) with run.yaml's.

        No record yet: record these (the first attempt's). The same: nothing. Different: one
        `versions_changed` journal line, and run.yaml records the new versions (the ones the checkpoints
        are written with from now on), returning the line to print; unless a restore is due and the
        checkpoint format may not read (`versions.blocking`) without `allow_change`: then the journal
        line says `refused` and BadInput (exit 2) is raised, with run.yaml unchanged.
        A run directory without run.yaml (a trainer started on a bare directory) is not checked.
        `write=False` (every process of a multi-host attempt but the first) compares and refuses only.
        """
        if not self.exists():
            return None
        for _ in range(20):
            doc, gen = self._read_run()
            recorded = doc.get("versions")
            diff = versions.changes(recorded, current) if isinstance(recorded, dict) else []
            if isinstance(recorded, dict) and not diff:
                return None
            blocked = versions.blocking(diff) if restoring else []
            line = f"versions changed since the run's last attempt: {versions.describe(diff)}"
            if blocked and not allow_change:
                if write:
                    self.append(
                        "versions_changed",
                        attempt=attempt,
                        reason=line,
                        refused=True,
                        versions=current,
                        previous=recorded,
                    )
                name, old, new = blocked[0]
                raise BadInput(
                    f"run `{self.name}`: {line}; checkpoints written with {name} {old or 'none'} may not read "
                    f"with {new or 'none'}",
                    "install the run's versions (pip install -c constraints.txt, or the image built from it), "
                    "or pass --allow-version-change to restore anyway",
                )
            if blocked:
                line += "; restoring anyway (--allow-version-change)"
            if not write:
                return line if diff else None
            try:
                self.store.write_text(
                    self.p("run.yaml"),
                    yaml.safe_dump({**doc, "versions": current}, sort_keys=False),
                    if_generation_match=gen,
                )
            except PreconditionFailed:
                continue  # another attempt recorded first: compare with what it wrote
            if not diff:
                return None  # the first record
            self.append(
                "versions_changed",
                attempt=attempt,
                reason=line,
                versions=current,
                previous=recorded,
                allowed=bool(blocked) or None,
            )
            return line
        raise OlmoCtlError(f"could not update `{self.p('run.yaml')}`: it kept changing under us", exit_code=3)

    def recipe(self, overrides: list[str] | tuple[str, ...] = (), *, pending: bool = False):
        """The run's resolved recipe, from run.yaml (the one place run.yaml becomes a Recipe): with the
        amendments its attempts train, and with `pending` those waiting for the next attempt too."""
        return run_recipe(self.read_run(), self.p("run.yaml"), overrides, pending=pending)

    # ------------------------------------------------------------------ amendments (core/amend.py)

    def amend(self, sets: list[str] | tuple[str, ...], *, restart: bool = False) -> dict:
        """Record an amendment of the run (`olmo-ctl amend`), pending until the next attempt is submitted
        (`bind_amendments`): run.yaml `amendments` gains it (a generation-matched write) and the journal
        says `amended`. BadInput, with nothing written, for a change the run cannot take."""
        for _ in range(20):
            doc, gen = self._read_run()
            committed = self.committed_step()
            recipe = run_recipe(doc, self.p("run.yaml"), pending=True)
            changes = amend.changes(recipe, sets, committed)
            rec = {
                "id": uuid.uuid4().hex[:8],
                "time": utc_now_iso(),
                "set": list(sets),
                "changes": changes,
                "committed_step": committed,  # when recorded; the schedule shown until it is bound
                "restart": restart or None,
                "from_step": None,  # bound when the next attempt is submitted
                "attempt": None,
                "values": None,
            }
            rec = {k: v for k, v in rec.items() if v is not None or k in ("from_step", "attempt", "values")}
            new_doc = {**doc, "amendments": [*(doc.get("amendments") or []), rec]}
            try:
                self.store.write_text(
                    self.p("run.yaml"), yaml.safe_dump(new_doc, sort_keys=False), if_generation_match=gen
                )
            except PreconditionFailed:
                continue
            self.append(
                "amended",
                committed_step=committed,
                reason=describe_changes(changes) + " (from the next attempt)",
                amendment=rec["id"],
                changes=changes,
            )
            return rec
        raise OlmoCtlError(f"could not update `{self.p('run.yaml')}`: it kept changing under us", exit_code=3)

    def amendments(self) -> list[dict]:
        return list(self.read_run().get("amendments") or [])

    def bind_amendments(self, attempt: int) -> list[dict]:
        """Bind the pending amendments to the attempt about to be submitted, which trains the step
        after the committed one first: each records that step and the values it sets from there (the
        schedule continued from it), and the journal says `amendment_applied`. Call only while no
        attempt of the run is live. Returns the amendments bound now."""
        for _ in range(20):
            if not self.exists():  # an eval job's or a smoke test's directory
                return []
            doc, gen = self._read_run()
            amendments = [dict(a) for a in doc.get("amendments") or []]
            if all(a.get("from_step") is not None for a in amendments):
                return []
            committed_step = self.committed_step()
            src = self.p("run.yaml")
            r = run_recipe({**doc, "amendments": []}, src)
            bound = []
            for a in amendments:
                if a.get("from_step") is None:
                    a.update(
                        from_step=committed_step + 1,
                        attempt=attempt,
                        values=amend.bind(r, a["changes"], committed_step + 1),
                        bound=utc_now_iso(),
                    )
                    bound.append(a)
                r = amend.apply(r, a["values"])
            try:
                self.store.write_text(
                    src,
                    yaml.safe_dump({**doc, "amendments": amendments}, sort_keys=False),
                    if_generation_match=gen,
                )
            except PreconditionFailed:
                continue
            for a in bound:
                self.append(
                    "amendment_applied",
                    attempt=attempt,
                    committed_step=committed_step,
                    reason=f"{describe_changes(a['changes'])} from step {a['from_step']}",
                    amendment=a["id"],
                    from_step=a["from_step"],
                )
            return bound
        raise OlmoCtlError(f"could not update `{self.p('run.yaml')}`: it kept changing under us", exit_code=3)

    def traces(self) -> list[str]:
        """What this directory holds of a run besides run.yaml, in words (empty: none): its journal, its
        committed checkpoints past step 0 (checkpoint 0 alone is a seeded start, `surgery warm-adam` or
        an ingredient's `--start-from`, which a new run trains from), ingredients.yaml. A journal that
        is an eval job's own (its `submitted` records only) is said as such."""
        found = []
        if self.store.exists(self.p(SPEC)):
            found.append(SPEC)
        records = self.journal()
        if records and all(
            r.get("event") == "submitted" and r.get("reason") == EVAL_JOB_REASON for r in records
        ):
            found.append("an eval job's journal")
        elif records:
            found.append(f"journal ({len(records)} record{'s' if len(records) != 1 else ''})")
        elif self.store.exists(self.p("journal.jsonl")):
            found.append("journal")  # no line of it reads: still a run's
        steps = [s for s in self.committed_steps() if s > 0]
        if steps:
            found.append(f"checkpoints up to step {steps[-1]}")
        return found

    def check_new(self, own: str = "run.yaml", *, adopt: bool = False) -> None:
        """Refuse (BadInput) to make a new run of a directory that holds a run: a run is created only
        where none was. run.yaml gone while the journal or checkpoints remain is that run, not a new
        one: a new run.yaml would have its checkpoints resumed under whatever recipe it was given. A
        run of ingredients and an eval job's output directory are refused too. `own`: the file that
        makes the run (a run of ingredients': ingredients.yaml). `adopt`: checkpoints with no journal
        (the trainer run by hand on a bare directory) are taken by the caller, who vouches for their
        recipe; a journal is still refused. Reads, writes nothing."""
        if self.exists():
            return
        found = self.traces()
        if adopt and all(t.startswith("checkpoints") for t in found):
            return
        if not found:
            return
        if SPEC in found:
            raise BadInput(
                f"`{self.name}` is a run of ingredients: `resume-until-done` runs it",
                f"submit one of its ingredients' runs ({ingredient_run(self.name, 0)}, ...), or choose another run name",
            )
        if found == ["an eval job's journal"]:
            raise BadInput(
                f"{self.path} is an eval job's output directory (`eval --backend gke --out`), not a run",
                "choose another run name or run root",
            )
        raise BadInput(
            f"run `{self.name}` has no {own}, but {self.path} still holds its {' and '.join(found)}, "
            f"which a new {own} would continue under whatever recipe it was given",
            f"copy the run's {own} back to {self.p(own)} (from a backup) to continue it, or move the "
            "directory aside to start a new run of that name",
        )

    def live_lease(self, now: float | None = None) -> dict | None:
        """lease.json when a live supervisor holds it (what `acquire_lease` refuses at once), else None.
        Reads, writes nothing."""
        cur = self.read_lease()
        if not cur or not cur.get("holder") or cur.get("released") or _holder_process_dead(cur):
            return None
        now = time.time() if now is None else now
        ttl = float(cur.get("ttl_s", 0))
        return cur if now - float(cur.get("heartbeat_unix", 0)) <= ttl else None

    def create_run(
        self,
        recipe_dict: dict,
        recipe_fingerprint: str,
        data_fingerprint: str,
        device: str,
        slices: int = 1,
        *,
        adopt: bool = False,
    ) -> dict:
        """Write run.yaml once (a create-only conditional write: two racing creators cannot both win),
        and only where no run was (`check_new`; `adopt`: checkpoints the trainer wrote there by hand,
        without a run, become this run's).
        `slices`: slices of `device` the run starts on (recorded with the device)."""
        self.check_new(adopt=adopt)
        doc = {
            "run": self.name,
            "created": utc_now_iso(),
            "recipe": recipe_dict,
            "recipe_fingerprint": recipe_fingerprint,
            "data_fingerprint": data_fingerprint,
            "device": device,
            "slices": slices,
        }
        try:
            self.store.write_text(
                self.p("run.yaml"), yaml.safe_dump(doc, sort_keys=False), if_generation_match=0
            )
        except PreconditionFailed:
            raise BadInput(
                f"run `{self.name}` was created concurrently", "run the command again to continue it"
            ) from None
        return doc

    def check_matches(self, recipe_fingerprint: str, data_fingerprint: str | None, recipe=None) -> None:
        """A later attempt must train the same recipe on the same data as run.yaml. With `recipe` (the
        Recipe of `recipe_fingerprint`), one that differs from run.yaml's in evaluation only passes:
        evaluation is not what the run trains (Recipe.training_fingerprint). The attempt still runs
        run.yaml's recipe."""
        d = self.read_run()
        if (
            d.get("recipe_fingerprint") != recipe_fingerprint
            and not self._amended_to(d, recipe_fingerprint)
            and not self._trains_the_same(d, recipe)
        ):
            raise BadInput(
                f"run `{self.name}` was created with another recipe ({_fingerprint(d.get('recipe_fingerprint'))}, "
                f"this one {_fingerprint(recipe_fingerprint)})",
                "continue it without --recipe/--set (it uses its run.yaml), or start a new run with --run NAME",
            )
        if data_fingerprint is not None and d.get("data_fingerprint") not in (None, "", data_fingerprint):
            raise BadInput(
                f"run `{self.name}`: the training data changed ({_fingerprint(d.get('data_fingerprint'))}, "
                f"now {_fingerprint(data_fingerprint)})",
                "restore the original data, or start a new run",
            )

    def _amended_to(self, doc: dict, fingerprint: str) -> bool:
        """`fingerprint` is the run's recipe as amended (bound, or with the pending amendments)."""
        if not doc.get("amendments"):
            return False
        try:
            return fingerprint in {
                run_recipe(doc, self.p("run.yaml"), pending=p).fingerprint() for p in (False, True)
            }
        except BadInput:
            return False

    def _trains_the_same(self, doc: dict, recipe) -> bool:
        if recipe is None:
            return False
        try:
            recorded = run_recipe(doc, self.p("run.yaml"))
        except BadInput:  # a run.yaml recipe this version cannot read: not provably the same
            return False
        return recorded.training_fingerprint() == recipe.training_fingerprint()

    # ------------------------------------------------------------------ journal

    def append(
        self,
        event: str,
        *,
        attempt: int | None = None,
        device: str | None = None,
        reason: str = "",
        committed_step: int | None = None,
        t: float | None = None,
        fence: Lease | None = None,
        **extra: Any,
    ) -> dict:
        rec = {
            "time": utc_now_iso(t),
            "event": event,
            "attempt": attempt,
            "device": device,
            "reason": reason,
            "committed_step": committed_step,
        }
        rec.update({k: v for k, v in extra.items() if v is not None})
        line = json.dumps(rec, default=str) + "\n"
        path = self.p("journal.jsonl")
        if fence is not None:  # a supervisor that lost the run's lease must not journal (LeaseLost)
            self.heartbeat(fence)
        if self.is_gcs:
            for _ in range(20):
                info = self.store.stat(path)
                gen = info.generation if info else 0
                old = self.store.read_bytes(path) if info else b""
                if old and not old.endswith(b"\n"):  # a torn last line: end it, or this record joins it
                    old += b"\n"
                try:
                    self.store.write_bytes(path, old + line.encode(), if_generation_match=gen)
                    return rec
                except PreconditionFailed:
                    time.sleep(0.05)
            raise OlmoCtlError(f"could not append to `{path}`: it kept changing under us", exit_code=3)
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = line.encode()
            size = os.fstat(fd).st_size
            if (
                size and os.pread(fd, 1, size - 1) != b"\n"
            ):  # a torn last line: end it, or this record joins it
                data = b"\n" + data
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return rec

    def journal(self) -> list[dict]:
        """The journal's records, oldest first: only well-formed ones (`journal_record_problem`). A line
        that is not one (torn by a crash mid-write, edited by hand) is skipped, never read, with one
        warning naming the file and its line numbers; every other line still counts."""
        path = self.p("journal.jsonl")
        try:
            data = self.store.read_bytes(path)
        except NotFound:
            return []
        except IsADirectoryError:
            raise BadInput(f"`{path}` is a directory, not a journal", "move it aside") from None
        out, bad = [], []
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:  # not UTF-8, or not JSON: a torn line
                bad.append((n, "not a JSON line"))
                continue
            why = journal_record_problem(rec)
            if why is None:
                out.append(rec)
            else:
                bad.append((n, why))
        skipped_lines_warning(path, bad)
        return out

    def target(self) -> Target | None:
        """The target the run is on: its newest attempt's device and slice count (run.yaml's before the
        first attempt; one slice where neither says); None where neither records a device."""
        last = self.last_attempt() or {}
        doc = {} if last.get("device") and last.get("slices") is not None else self.read_run()
        device = last.get("device") or doc.get("device")
        slices = last["slices"] if last.get("slices") is not None else doc.get("slices")
        if not device:
            return None
        return recorded_target(device, slices or 1, where=f"run `{self.name}` ({self.path})")

    def last_attempt(self) -> dict | None:
        """The newest `submitted` record (it carries the attempt number, device and backend handle)."""
        subs = [r for r in self.journal() if r.get("event") == "submitted"]
        return subs[-1] if subs else None

    def next_attempt_number(self) -> int:
        nums = [
            int(r["attempt"]) for r in self.journal() if r.get("event") == "submitted" and r.get("attempt")
        ]
        return max(nums, default=0) + 1

    # ------------------------------------------------------------------ checkpoints

    def committed_steps(self) -> list[int]:
        """Committed Orbax steps, ascending (`committed_steps_in` its `checkpoints/`)."""
        return committed_steps_in(self.p("checkpoints"))

    def check_not_from_scratch(self, committed: int) -> None:
        """Bad input when an attempt would start from step 0 (`committed`) though the journal records a
        committed checkpoint past it: its checkpoints were deleted, or lost their commit markers (a copy
        cut off midway, or moved by hand). Never a silent restart from step 0."""
        if committed > 0:
            return
        recorded = max((r["committed_step"] or 0 for r in self.journal() if "committed_step" in r), default=0)
        if recorded <= 0:
            return
        loose = uncommitted_step_dirs(self.p("checkpoints"))
        found = f"; step directories without one: {', '.join(map(str, loose))}" if loose else ""
        raise BadInput(
            f"run `{self.name}`: its journal records checkpoint {recorded} committed, but no checkpoint"
            f" under {self.p('checkpoints')} holds its commit marker ({COMMIT_MARKER}){found}; an attempt"
            " now would train from step 0",
            "restore the checkpoints from a backup or a whole copy, or move the run directory aside to"
            " start the run again",
        )

    def committed_step(self) -> int:
        steps = self.committed_steps()
        return steps[-1] if steps else 0

    def progress_signature(self, since_unix: float = 0.0) -> tuple:
        """Something that changes whenever the trainer writes: its TensorBoard files and their sizes.

        Segment names start with the writer's start time (docs/CONTRACTS.md), so on gs:// only the
        names from `since_unix` on are listed: one short listing however long the run has been going.
        """
        tb = self.p("tensorboard")
        first = segment_names_from(since_unix)
        if not self.is_gcs:
            try:
                return tuple(sorted((e.name, e.stat().st_size) for e in os.scandir(tb) if e.name >= first))
            except FileNotFoundError:
                return ()
        return tuple((o.path.rpartition("/")[2], o.size) for o in self.store.find(tb, start_offset=first))

    # ------------------------------------------------------------------ lease

    def acquire_lease(
        self,
        ttl_s: float = 120.0,
        now: float | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        say: Callable[[str], None] | None = None,
    ) -> Lease:
        """Take the run's lease, or raise LeaseHeld naming the live holder.

        A lease is free when absent, released, or held by a process that provably ran on this machine
        in this boot and is gone (a killed supervisor need not wait for the TTL). A lease whose last
        heartbeat looks older than its TTL is not trusted on that alone (the holder's clock and ours
        may disagree): it is taken only once its generation stayed unchanged for a whole TTL measured
        on this process's own monotonic clock; a holder that heartbeats meanwhile keeps it.
        Every write is conditioned on the generation just read, so of two racing supervisors one wins.
        The new lease's `epoch` is one more than the previous one's, and the attempt number the previous
        holder reserved (`reserved_attempt`) is carried over, so a successor never reuses it.
        """
        path = self.p("lease.json")
        now = time.time() if now is None else now
        info = self.store.stat(path)
        gen = info.generation if info else 0
        cur: dict = {}
        if info is not None:
            cur = self._lease_doc()  # BadInput when it cannot be read: never taken over blind
            held = cur.get("holder") and not cur.get("released")
            if held and not _holder_process_dead(cur):
                ttl = float(cur.get("ttl_s", ttl_s))
                if now - float(cur.get("heartbeat_unix", 0)) <= ttl:
                    raise LeaseHeld(self.name, cur)
                if say:
                    say(
                        f"the lease of {cur.get('holder', '?')} looks expired; watching it for {ttl:.0f} s "
                        "before taking it over (clocks are not trusted)"
                    )
                if not self._unchanged_for(path, gen, ttl, monotonic, sleep):
                    raise LeaseHeld(self.name, self.read_lease() or {})
        holder, proc = _this_holder()
        t = utc_now_iso(now)
        epoch = int(cur.get("epoch", 0)) + 1
        doc = {
            "holder": holder,
            "process": proc,
            "acquired": t,
            "heartbeat": t,
            "heartbeat_unix": now,
            "ttl_s": ttl_s,
            "released": False,
            "epoch": epoch,
            "reserved_attempt": int(cur.get("reserved_attempt", 0)),
        }
        try:
            new_gen = self.store.write_text(path, json.dumps(doc, indent=1), if_generation_match=gen)
        except PreconditionFailed:
            raise LeaseHeld(self.name, self.read_lease() or {}) from None
        return Lease(
            holder=holder + " " + proc["token"], generation=new_gen, ttl_s=ttl_s, acquired=t, epoch=epoch
        )

    def _unchanged_for(self, path: str, gen: int, seconds: float, monotonic, sleep) -> bool:
        """True when `path` still has generation `gen` after `seconds` of our own clock."""
        end = monotonic() + seconds
        step = max(0.05, min(5.0, seconds / 20))
        while True:
            info = self.store.stat(path)
            if (info.generation if info else 0) != gen:
                return False
            left = end - monotonic()
            if left <= 0:
                return True
            sleep(min(step, left))

    def reserve_attempt(self, lease: Lease, at_least: int, now: float | None = None) -> int:
        """Reserve the next attempt number under the lease, before anything is created for it: a write
        conditioned on our lease's generation (LeaseLost when another supervisor took the run over).
        The number is above every number reserved before, by any holder, so a successor that takes
        the run over never reuses the number of an attempt its predecessor may still create."""
        cur = self._held_lease_doc()
        path = self.p("lease.json")
        n = max(int(at_least), int(cur.get("reserved_attempt", 0)) + 1)
        now = time.time() if now is None else now
        cur.update(reserved_attempt=n, heartbeat=utc_now_iso(now), heartbeat_unix=now)
        try:
            lease.generation = self.store.write_text(
                path, json.dumps(cur, indent=1), if_generation_match=lease.generation
            )
        except PreconditionFailed:
            raise LeaseLost(self.name, f"now held by {cur.get('holder', '?')}") from None
        return n

    def _lease_write(self, lease: Lease, now: float, released: bool) -> None:
        path = self.p("lease.json")
        for _ in range(2):
            cur = self._held_lease_doc()
            cur.update(heartbeat=utc_now_iso(now), heartbeat_unix=now, released=released)
            try:
                lease.generation = self.store.write_text(
                    path, json.dumps(cur, indent=1), if_generation_match=lease.generation
                )
                return
            except PreconditionFailed:
                if not self._adopt_own_write(lease):
                    break
        raise LeaseLost(self.name, f"now held by {cur.get('holder', '?')}")

    def _adopt_own_write(self, lease: Lease) -> bool:
        """True (and `lease.generation` updated) when lease.json changed since our last recorded write
        but is still ours: same holder token and epoch. That is a write of ours whose new generation
        never reached us (Ctrl-C landed between the write and its answer); any other writer put its
        own token there. The generation is read before the document, so a takeover in between reads
        as someone else's."""
        path = self.p("lease.json")
        info = self.store.stat(path)
        try:
            cur = self._lease_doc()
        except (NotFound, BadInput):
            return False
        token = lease.holder.rsplit(" ", 1)[-1]
        if (
            info is None
            or (cur.get("process") or {}).get("token") != token
            or int(cur.get("epoch", 0)) != lease.epoch
        ):
            return False
        lease.generation = info.generation
        return True

    def heartbeat(self, lease: Lease, now: float | None = None) -> None:
        """Renew the lease; LeaseLost if anyone else wrote it since our last write."""
        self._lease_write(lease, time.time() if now is None else now, released=False)

    def release_lease(self, lease: Lease, now: float | None = None) -> None:
        try:
            self._lease_write(lease, time.time() if now is None else now, released=True)
        except LeaseLost:
            pass

    def read_lease(self) -> dict | None:
        """lease.json's document, None when there is none; BadInput (exit 2) naming the file when it
        cannot be read: whether a supervisor drives the run is then unknown, and nothing decides on it."""
        try:
            return self._lease_doc()
        except NotFound:
            return None

    def _lease_doc(self) -> dict:
        """lease.json's document (NotFound when there is none). BadInput naming the file when it is not a
        lease (`lease_problem`: torn, or edited by hand): whether a supervisor drives the run cannot be
        told, so no command takes the run over or decides as if none did."""
        path = self.p("lease.json")
        why: str | None
        try:
            data = self.store.read_bytes(path)
        except IsADirectoryError:
            data, why = b"", "a directory"
        else:
            try:
                doc = json.loads(data)
                why = lease_problem(doc)
            except ValueError:
                why = "not JSON" if data.strip() else "empty"
        if why is None:
            return doc
        raise BadInput(
            f"`{path}` cannot be read as a lease ({why}), so which supervisor drives run `{self.name}` is "
            "unknown",
            f"if no supervisor (`olmo-ctl resume-until-done {self.name}`) is running for it, delete the file "
            "and run the command again",
        )

    def _held_lease_doc(self) -> dict:
        """lease.json as a supervisor holding it reads it before its next write: LeaseLost when it was
        deleted, or overwritten with what is not a lease (someone else wrote it: this one stops)."""
        try:
            return self._lease_doc()
        except NotFound:
            raise LeaseLost(self.name, "lease.json was deleted") from None
        except BadInput as e:
            raise LeaseLost(self.name, e.message.split(", so ")[0]) from None

    # ------------------------------------------------------------------ resize requests

    def request_resize(self, device: str, reason: str = "") -> dict:
        """Ask the run's supervisor to checkpoint, stop and continue on `device` (same global batch)."""
        doc = {"device": device, "reason": reason, "time": utc_now_iso(), "id": uuid.uuid4().hex[:8]}
        self.store.write_text(self.p("resize.json"), json.dumps(doc))
        self.append(
            "resize_requested", device=device, reason=reason or f"resize to {device}", request=doc["id"]
        )
        return doc

    def pending_resize(self) -> dict | None:
        try:
            return json.loads(self.store.read_text(self.p("resize.json")))
        except NotFound:
            return None

    @staticmethod
    def resize_target(request: dict) -> Target:
        """The device a resize request (`pending_resize`) asks for, and its slice count (the request's,
        else one); BadInput for a device the catalog does not know."""
        return recorded_target(request.get("device"), request.get("slices"), where="the resize request")

    def clear_resize(self) -> None:
        self.store.delete(self.p("resize.json"))

    # ------------------------------------------------------------------ restart requests (amend --restart)

    def request_restart(self, amendment: str, attempt: int | None) -> dict:
        """Ask the run's supervisor to stop `attempt` at its next checkpoint and submit the next one,
        which takes the pending amendments."""
        doc = {"amendment": amendment, "attempt": attempt, "time": utc_now_iso(), "id": uuid.uuid4().hex[:8]}
        self.store.write_text(self.p("restart.json"), json.dumps(doc))
        self.append(
            "restart_requested",
            attempt=attempt,
            reason="restart at the next checkpoint for an amendment",
            request=doc["id"],
            amendment=amendment,
        )
        return doc

    def pending_restart(self) -> dict | None:
        try:
            return json.loads(self.store.read_text(self.p("restart.json")))
        except NotFound:
            return None
        except ValueError:
            return {"id": "?", "attempt": None}

    def clear_restart(self) -> None:
        self.store.delete(self.p("restart.json"))

    # ------------------------------------------------------------------ stop at the next checkpoint

    def request_stop_at_checkpoint(self, attempt: int) -> None:
        """Ask attempt `attempt`'s trainer to stop once its next checkpoint has committed: it reads this
        at every periodic checkpoint, waits for that write's commit and exits 143, so the attempt ends
        on the checkpoint itself, with no step past it and no further write."""
        doc = {"attempt": attempt, "time": utc_now_iso()}
        self.store.write_text(self.p(STOP_AT_CHECKPOINT), json.dumps(doc))

    def stop_at_checkpoint_requested(self, attempt: int) -> bool:
        """Whether attempt `attempt` is asked to stop at its next checkpoint (the trainer's read)."""
        try:
            doc = json.loads(self.store.read_text(self.p(STOP_AT_CHECKPOINT)))
        except (NotFound, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("attempt") == attempt

    def clear_stop_at_checkpoint(self) -> None:
        self.store.delete(self.p(STOP_AT_CHECKPOINT))

    # ------------------------------------------------------------------ stop requests

    def request_stop(self, reason: str = "", attempt: int | None = None) -> dict:
        """Record that the run is being stopped on purpose (`olmo-ctl stop`): a supervisor that sees
        `stop.json` ends instead of submitting the next attempt."""
        doc = {"reason": reason, "time": utc_now_iso(), "id": uuid.uuid4().hex[:8], "attempt": attempt}
        self.store.write_text(self.p("stop.json"), json.dumps(doc))
        self.append("stop_requested", attempt=attempt, reason=reason or "stop requested", request=doc["id"])
        return doc

    def pending_stop(self) -> dict | None:
        try:
            return json.loads(self.store.read_text(self.p("stop.json")))
        except NotFound:
            return None
        except ValueError:
            return {"reason": "stop.json is unreadable", "id": "?"}

    def clear_stop(self) -> None:
        self.store.delete(self.p("stop.json"))


# ---------------------------------------------------------------- a run of ingredients (supervise/ingredients.py)

SPEC = "ingredients.yaml"
SOUP_DIR = "soup"


def ingredient_run(name: str, k: int) -> str:
    """The run name of ingredient k (0-based) of run NAME: NAME-i<k+1>."""
    return f"{name}-i{k + 1}"


_SPEC_HINT = (
    "restore it from a backup, or move the run directory aside and start the run of ingredients again"
)


@dataclass
class Composite:
    """A run of ingredients under a run root (nothing is read until asked; ingredients.yaml, written
    once, is read once per instance)."""

    run_root: str
    name: str
    _spec: dict | None = field(default=None, repr=False, compare=False)

    @property
    def dir(self) -> RunDir:
        return RunDir.of(self.run_root, self.name)

    @property
    def spec_path(self) -> str:
        return self.dir.p(SPEC)

    @property
    def soup_path(self) -> str:
        return self.dir.p(SOUP_DIR)

    def exists(self) -> bool:
        return storage.store_for(self.spec_path).exists(self.spec_path)

    def spec(self) -> dict:
        if self._spec is None:
            self._spec = self._read_spec()
        return self._spec

    def _read_spec(self) -> dict:
        store = storage.store_for(self.spec_path)
        try:
            doc = yaml.safe_load(store.read_bytes(self.spec_path).decode())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            first = " ".join(str(e).split())[:200] or "not YAML"
            raise BadInput(f"`{self.spec_path}` is not a run of ingredients ({first})", _SPEC_HINT) from None
        if (
            not isinstance(doc, dict)
            or not isinstance(doc.get("ingredients"), list)
            or not doc["ingredients"]
        ):
            raise BadInput(
                f"`{self.spec_path}` is not a run of ingredients (no `ingredients` list)", _SPEC_HINT
            )
        for k, ing in enumerate(doc["ingredients"], 1):
            run = ing.get("run") if isinstance(ing, dict) else None
            try:
                validate_run_name(run if isinstance(run, str) else "")
            except BadInput:
                raise BadInput(
                    f"`{self.spec_path}` is not a run of ingredients (ingredient {k} names no run)",
                    _SPEC_HINT,
                ) from None
        return doc

    def recipe(self):
        return run_recipe(self.spec(), self.spec_path)

    def runs(self) -> list[RunDir]:
        """Each ingredient's run directory, in order."""
        return [RunDir.of(self.run_root, i["run"]) for i in self.spec()["ingredients"]]

    def create(
        self,
        recipe,
        start_from: str | None,
        device: str | None,
        slices: int | None,
        concurrent: int | None = None,
    ) -> None:
        """Write ingredients.yaml once (a run of ingredients that exists keeps its own). `concurrent`:
        how many ingredients run at once when `resume-until-done` is not told (absent: one)."""
        doc = {
            "run": self.name,
            "created": utc_now_iso(),
            "recipe": recipe.to_dict(),
            "start_from": start_from,
            "device": device,
            "slices": slices,
            **({"concurrent": concurrent} if concurrent and concurrent > 1 else {}),
            "ingredients": [
                {"run": ingredient_run(self.name, k), "name": ing.name or f"i{k + 1}", "set": list(ing.set)}
                for k, ing in enumerate(recipe.ingredients)
            ],
        }
        self.dir.check_new(own=SPEC)
        try:
            storage.store_for(self.spec_path).write_text(
                self.spec_path, yaml.safe_dump(doc, sort_keys=False), if_generation_match=0
            )
        except PreconditionFailed:
            raise BadInput(
                f"run of ingredients `{self.name}` was created concurrently",
                "run the command again to continue it",
            ) from None
        self._spec = doc

    def souped(self) -> dict | None:
        """The soup's manifest (soup.json) when the soup was written whole, else None."""
        path = storage.join(self.soup_path, "soup.json")
        store = storage.store_for(path)
        if not store.exists(path):
            return None
        return json.loads(store.read_bytes(path).decode())
