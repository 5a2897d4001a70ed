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
from olmo_ctl.core.errors import BadInput, OlmoCtlError
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
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()


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


class LeaseLost(OlmoCtlError):
    def __init__(self, run: str, detail: str):
        super().__init__(
            f"lost the lease on run `{run}`: {detail}", "another supervisor took over; this one stops", 2
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
            raise BadInput(
                f"run `{self.name}` does not exist at {self.path}",
                "create it with `olmo-ctl submit` or `resume-until-done --recipe ...`",
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

    def create_run(
        self, recipe_dict: dict, recipe_fingerprint: str, data_fingerprint: str, device: str, slices: int = 1
    ) -> dict:
        """Write run.yaml once (a create-only conditional write: two racing creators cannot both win).
        `slices`: slices of `device` the run starts on (recorded with the device)."""
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
                f"run `{self.name}` was created with another recipe (fingerprint {d.get('recipe_fingerprint')}, "
                f"this one {recipe_fingerprint})",
                "continue it without --recipe/--set (it uses its run.yaml), or start a new run with --run NAME",
            )
        if data_fingerprint is not None and d.get("data_fingerprint") not in (None, "", data_fingerprint):
            raise BadInput(
                f"run `{self.name}`: the training data changed (fingerprint {d.get('data_fingerprint')}, "
                f"now {data_fingerprint})",
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
                try:
                    self.store.write_bytes(path, old + line.encode(), if_generation_match=gen)
                    return rec
                except PreconditionFailed:
                    time.sleep(0.05)
            raise OlmoCtlError(f"could not append to `{path}`: it kept changing under us", exit_code=3)
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return rec

    def journal(self) -> list[dict]:
        try:
            text = self.store.read_text(self.p("journal.jsonl"))
        except NotFound:
            return []
        out = []
        for ln in text.splitlines():
            ln = ln.strip()
            if not ln:
                continue
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-write: every complete line still counts
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
        """Committed Orbax steps, ascending, in at most two list calls.

        Local: one directory listing; a step counts when its directory has its final name `<N>` (Orbax
        renames `<N>.orbax-checkpoint-tmp-*` atomically) and holds the commit marker.
        gs://: one object listing of `checkpoints/*/commit_success.txt` (a glob match, so a checkpoint's
        thousands of array shards are not listed); a step directory without its marker is being written
        or was abandoned and never counts.
        """
        ckpt = self.p("checkpoints")
        if self.is_gcs:
            return self._gcs_committed(ckpt)
        try:
            entries = list(os.scandir(ckpt))
        except FileNotFoundError:
            return []
        steps = []
        for e in entries:
            m = _STEP_DIR.match(e.name)
            if m and e.is_dir() and os.path.exists(os.path.join(e.path, COMMIT_MARKER)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _gcs_committed(self, ckpt: str) -> list[int]:
        base = ckpt.rstrip("/") + "/"
        steps = set()
        for o in self.store.find(ckpt, match_glob=f"*/{COMMIT_MARKER}"):
            step_dir = o.path[len(base) :].split("/")[0]
            if _STEP_DIR.match(step_dir):
                steps.add(int(step_dir))
        return sorted(steps)

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
            cur = json.loads(self.store.read_text(path) or "{}")
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
                    raise LeaseHeld(self.name, json.loads(self.store.read_text(path) or "{}"))
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
            cur = json.loads(self.store.read_text(path) or "{}")
            raise LeaseHeld(self.name, cur) from None
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
        path = self.p("lease.json")
        try:
            cur = json.loads(self.store.read_text(path))
        except NotFound:
            raise LeaseLost(self.name, "lease.json was deleted") from None
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
            try:
                cur = json.loads(self.store.read_text(path))
            except NotFound:
                raise LeaseLost(self.name, "lease.json was deleted") from None
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
            cur = json.loads(self.store.read_text(path))
        except (NotFound, ValueError):
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
        try:
            return json.loads(self.store.read_text(self.p("lease.json")))
        except NotFound:
            return None

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
            raise BadInput(f"`{self.spec_path}` is not a run of ingredients ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("ingredients"), list):
            raise BadInput(f"`{self.spec_path}` is not a run of ingredients (no `ingredients` list)")
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
        storage.store_for(self.spec_path).write_text(self.spec_path, yaml.safe_dump(doc, sort_keys=False))
        self._spec = doc

    def souped(self) -> dict | None:
        """The soup's manifest (soup.json) when the soup was written whole, else None."""
        path = storage.join(self.soup_path, "soup.json")
        store = storage.store_for(path)
        if not store.exists(path):
            return None
        return json.loads(store.read_bytes(path).decode())
