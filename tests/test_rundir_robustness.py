"""Files of a run directory torn mid-write or edited by hand are bad input (docs/CONTRACTS.md, "Records
that cannot be read"): a record that cannot be read is skipped with one warning naming the file and its
lines, or the command exits 2 naming the file; never a traceback, never a decision made on it.

The run the commands read is built by hand through the project's own writers (run.yaml by
`create_run`, the journal by `append`, the lease by `acquire_lease`, an attempt file as the local
backend writes it, Orbax's commit marker), in the shape a finished `resume-until-done --recipe smoke
--device cpu-1 --backend local --set train.max_steps=20` leaves: no training, so the fuzz test
(every byte boundary of every file) runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.cli import invoke

from olmo_ctl.backends.base import Handle
from olmo_ctl.core import versions
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import COMMIT_MARKER, Composite, LeaseLost, RunDir, run_recipe

STEPS = 20
T0 = 1_796_540_100.0
PID = 4_194_000  # a pid no process has here: the attempt's trainer is long gone
NO_TRACEBACK = "Traceback"


def _attempt_file(rd: RunDir, pid: int) -> dict:
    """attempts/1.json of a finished attempt, as `LocalBackend.send` and `status` write it."""
    return {
        "pid": pid,
        "pgid": pid,
        "start_time": "19116",
        "host": "vm",
        "argv": [
            "python",
            "-m",
            "olmo_ctl.trainer",
            "--run-dir",
            rd.path,
            "--device",
            "cpu-1",
            "--attempt",
            "1",
        ],
        "log": rd.p("logs", "attempt-1.log"),
        "run_dir": rd.path,
        "started": T0 + 1,
        "exit_code": 0,
        "hosts": [{"pid": pid, "start_time": "19116", "exit_code": 0, "ended": T0 + 20}],
        "coordinator": None,
        "ended": T0 + 20,
    }


def make_run(root: Path, name: str = "demo") -> RunDir:
    """A finished smoke run of STEPS steps on cpu-1 (local backend), as its files are after
    `resume-until-done` ended with `done`; nothing trained."""
    from olmo_ctl.supervise.attempts import data_fingerprint

    rd = RunDir.of(str(root), name)
    r = load_recipe("smoke", overrides=[f"train.max_steps={STEPS}"])
    rd.create_run(r.to_dict(), r.fingerprint(), data_fingerprint(r), "cpu-1")
    rd.check_versions(versions.installed(), attempt=1)
    lease = rd.acquire_lease(ttl_s=300, now=T0)
    handle = Handle(
        "local",
        str(PID),
        1,
        {
            "pid": PID,
            "start_time": "19116",
            "state_dir": rd.path,
            "log": rd.p("logs", "attempt-1.log"),
            "run_dir": rd.path,
            "pids": [PID],
        },
    )
    common = {"device": "cpu-1", "fence": lease}
    rd.append("supervisor_started", reason=f"committed step 0/{STEPS}", committed_step=0, t=T0, **common)
    rd.append(
        "submitted",
        attempt=1,
        reason="first attempt",
        committed_step=0,
        t=T0 + 1,
        slices=1,
        handle=handle.to_dict(),
        backend="local",
        site={"namespace": "default", "queue": "multislice-queue"},
        **common,
    )
    rd.append("running", attempt=1, reason=f"pid {PID} running", committed_step=0, t=T0 + 1, **common)
    rd.append("exited", attempt=1, reason="exit 0", committed_step=STEPS, t=T0 + 14, exit_code=0, **common)
    rd.append("succeeded", attempt=1, reason="exit 0", committed_step=STEPS, t=T0 + 20, **common)
    rd.append(
        "done",
        reason=f"final step {STEPS}/{STEPS} committed, loss 3.6146",
        committed_step=STEPS,
        t=T0 + 20,
        loss="3.6146",
        **common,
    )
    rd.release_lease(lease, now=T0 + 20)
    files = {
        "attempts/1.json": json.dumps(_attempt_file(rd, PID)),
        "logs/attempt-1.log": f"step {STEPS}/{STEPS} loss 3.6146\ncommitted step {STEPS}\n",
        f"checkpoints/{STEPS}/{COMMIT_MARKER}": f"Checkpoint commit was successful to {rd.p('checkpoints', str(STEPS))}",
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(rd.p(rel)), exist_ok=True)
        Path(rd.p(rel)).write_text(text)
    return rd


def make_soup(root: Path, name: str = "soup") -> Composite:
    """A run of ingredients of the smoke-soup recipe, none of them started."""
    c = Composite(str(root), name)
    c.create(load_recipe("smoke-soup"), None, "cpu-1", 1)
    c.dir.append("supervisor_started", reason="3 ingredients", t=T0)
    return c


def cli_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env["XDG_CONFIG_HOME"] = str(root.parent / "no-config")
    return env


def events(rd: RunDir) -> list[str]:
    return [r["event"] for r in rd.journal()]


@pytest.fixture
def no_submission(monkeypatch):
    """A command that would start an attempt fails the test: every run here is done."""
    from olmo_ctl.backends.local import LocalBackend

    def send(self, request):
        raise AssertionError("an attempt was submitted")

    monkeypatch.setattr(LocalBackend, "send", send)


# ---------------------------------------------------------------- the journal


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def rd(request, tmp_path):
    if request.param == "local":
        return RunDir.of(str(tmp_path / "runs"), "r1")
    request.getfixturevalue("gcs").new_bucket("olmo-runs")
    return RunDir.of(f"gs://olmo-runs/{tmp_path.name}", "r1")


def test_an_append_after_a_torn_last_line_is_not_swallowed(rd, capsys):
    """A crash mid-append leaves a last line without its newline: the next record (`amended`,
    `submitted`) starts a line of its own instead of joining the torn one."""
    rd.append("submitted", attempt=1, device="cpu-1", reason="first attempt")
    whole = rd.store.read_bytes(rd.p("journal.jsonl"))
    rd.store.write_bytes(rd.p("journal.jsonl"), whole + b'{"time": "2026-12-06T06:55:3')
    rd.append("amended", reason="train.max_steps 20 -> 30 (from the next attempt)", amendment="a1")
    rd.append("submitted", attempt=2, device="cpu-1", reason="amended")
    assert events(rd) == ["submitted", "amended", "submitted"]
    assert rd.next_attempt_number() == 3
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "journal.jsonl`" in err and "line 2: not a JSON line" in err, err


BAD_LINES = [
    ("[1, 2]", "is not a record"),
    ('"submitted"', "is not a record"),
    ("7", "is not a record"),
    ('{"time": "2026-12-06T06:55:09.963844Z", "event": "submitted", "attempt": "x"}', '`attempt` is "x"'),
    ('{"time": "2026-12-06T06:55:09.963844Z", "event": 5}', "`event` is 5"),
    ('{"time": "yesterday", "event": "running", "attempt": 1}', "not an ISO 8601 time"),
    ('{"time": "2026-12-06T06:55:09.963844Z", "event": "submitted", "attempt": true}', "`attempt` is true"),
    ('{"event": "running", "attempt": 1}', "no `time`"),
    (
        '{"time": "2026-12-06T06:55:09.963844Z", "event": "submitted", "attempt": 2, "handle": {"x": 1}}',
        "`handle`",
    ),
    (
        '{"time": "2026-12-06T06:55:09.963844Z", "event": "exited", "attempt": 1, "exit_code": "0"}',
        "`exit_code`",
    ),
    (
        '{"time": "2026-12-06T06:55:09.963844Z", "event": "submitted", "attempt": 3, "slices": [2]}',
        "`slices`",
    ),
    ('{"time": "2026-12-06T06:55:09.963844Z", "event": "done", "committed_step": 20.5}', "`committed_step`"),
    (
        '{"time": "2026-12-06T06:55:09.963844Z", "event": "submitted", "attempt": null}',
        "without its `attempt`",
    ),
    ("\xff\xfe", "not a JSON line"),
]


def test_the_journal_reads_only_records_and_warns_once_naming_the_file_and_lines(tmp_path, capsys):
    rd = RunDir.of(str(tmp_path / "runs"), "r1")
    rd.append("submitted", attempt=1, device="cpu-1", reason="first attempt")
    with open(rd.p("journal.jsonl"), "ab") as f:
        for line, _ in BAD_LINES:
            f.write(line.encode("latin-1" if line.startswith("\xff") else "utf-8") + b"\n")
    rd.append("running", attempt=1, device="cpu-1")
    for _ in range(3):  # a supervisor or a watch reads it again and again: one warning
        assert events(rd) == ["submitted", "running"]
        assert rd.next_attempt_number() == 2  # attempts 2 and 3 above are not records: never counted
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert f"`{rd.p('journal.jsonl')}`: skipped {len(BAD_LINES)} records" in err, err
    for n, (_, why) in enumerate(BAD_LINES[:3], 2):  # the first three named, then how many more
        assert f"line {n}: " in err and why in err, (why, err)
    assert f"and {len(BAD_LINES) - 3} more" in err
    for line, why in BAD_LINES:  # each one's reason, one at a time
        rd.store.write_bytes(
            rd.p("journal.jsonl"), line.encode("latin-1" if line.startswith("\xff") else "utf-8")
        )
        assert rd.journal() == []
        assert "line 1: " in capsys.readouterr().err
        from olmo_ctl.rundir import journal_record_problem

        if not line.startswith("\xff"):
            assert why in (journal_record_problem(json.loads(line)) or ""), line


# ---------------------------------------------------------------- the lease


TORN_LEASES = [
    b"",
    b"{",
    b'{\n "holder": "user@vm pid 5154",\n "process": {\n  "host": "vm",\n  "pi',
    b"[]",
    b"null",
]
BAD_LEASES = [
    {"holder": 5},
    {"holder": "user@vm pid 1", "heartbeat_unix": "soon"},
    {"holder": "user@vm pid 1", "released": "no"},
    {"holder": "user@vm pid 1", "process": {"host": "vm", "pid": "1"}},
    {"holder": "user@vm pid 1", "epoch": None},
]


@pytest.mark.parametrize(
    "content", [*TORN_LEASES, *(json.dumps(d).encode() for d in BAD_LEASES)], ids=lambda c: c[:24].decode()
)
def test_an_unreadable_lease_is_never_taken_over(rd, content):
    """Nobody can tell which supervisor drives the run from a lease that cannot be read, so none takes
    it: exit 2 naming the file, with the way out, and the file left as it was."""
    rd.store.write_bytes(rd.p("lease.json"), content)
    for read in (lambda: rd.acquire_lease(ttl_s=60), rd.read_lease):
        with pytest.raises(BadInput) as ei:
            read()
        assert ei.value.exit_code == 2
        line = ei.value.one_line()
        assert f"`{rd.p('lease.json')}` cannot be read as a lease" in line
        assert "if no supervisor (`olmo-ctl resume-until-done r1`) is running for it, delete the file" in line
    assert rd.store.read_bytes(rd.p("lease.json")) == content


def test_a_lease_overwritten_with_garbage_is_lost_by_its_holder(rd):
    lease = rd.acquire_lease(ttl_s=60, now=1000.0)
    rd.store.write_bytes(rd.p("lease.json"), b'{"holder": ')
    with pytest.raises(LeaseLost, match="cannot be read as a lease"):
        rd.heartbeat(lease, now=1010.0)
    with pytest.raises(LeaseLost):
        rd.reserve_attempt(lease, 1)
    with pytest.raises(LeaseLost):
        rd.append("running", attempt=1, fence=lease)
    assert rd.store.read_bytes(rd.p("lease.json")) == b'{"holder": '


# ---------------------------------------------------------------- attempt files, the run root


@pytest.mark.parametrize("content", [b"[]", b"", b'{"pid": 1', b'{"pid": "x"}', b'{"hosts": [1]}', b'"x"'])
def test_an_unreadable_attempt_file_counts_as_absent_with_a_warning(tmp_path, capsys, content):
    from olmo_ctl.backends.local import LocalBackend, read_attempt_file

    rd = make_run(tmp_path / "runs")
    Path(rd.p("attempts", "1.json")).write_bytes(content)
    assert read_attempt_file(rd.p("attempts", "1.json")) is None
    be = LocalBackend(str(tmp_path / "runs"))
    h = Handle.from_dict(rd.last_attempt()["handle"])
    assert not be.status(h).state.live
    assert be.live_attempts("demo", rd.path) == []
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and f"`{rd.p('attempts', '1.json')}` is not an attempt file" in err, err


def test_a_dangling_symlink_in_a_directory_is_no_object(tmp_path):
    from olmo_ctl import storage

    (tmp_path / "a").mkdir()
    (tmp_path / "f").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    files, dirs = storage.store_for(str(tmp_path)).list(str(tmp_path))
    assert [f.path for f in files] == [str(tmp_path / "f")] and dirs == [str(tmp_path / "a") + "/"]
    files, _ = storage.store_for(str(tmp_path)).list(str(tmp_path), recursive=True)
    assert [f.path for f in files] == [str(tmp_path / "f")]


# ---------------------------------------------------------------- the commands, on each damage of the issue


def _journal_line(rd: RunDir, line: str) -> None:
    with open(rd.p("journal.jsonl"), "a") as f:
        f.write(line + "\n")


def _set_attempt(rd: RunDir, event: str, value) -> None:
    lines = Path(rd.p("journal.jsonl")).read_text().splitlines()
    for i, ln in enumerate(lines):
        rec = json.loads(ln)
        if rec["event"] == event:
            lines[i] = json.dumps({**rec, "attempt": value})
    Path(rd.p("journal.jsonl")).write_text("\n".join(lines) + "\n")


ALL = ("runs", "monitor", "logs", "amend", "stop", "resume")
OK = {c: 0 for c in ALL}
LIVE = ("amend", "stop", "resume")  # the commands that ask the backend whether an attempt is live

# damage -> (how, what the warning or error says of the file, the commands that say it, their exit codes)
DAMAGE = {
    "journal line not an object": (
        lambda rd, root: _journal_line(rd, "[1, 2]"),
        "journal.jsonl`: skipped 1 record that cannot be read (line 7: [1, 2] is not a record",
        ALL,
        OK,
    ),
    "attempt x in the exited record": (
        lambda rd, root: _set_attempt(rd, "exited", "x"),
        'journal.jsonl`: skipped 1 record that cannot be read (line 4: `attempt` is "x", not an integer)',
        ALL,
        OK,
    ),
    "attempt x in the submitted record": (
        lambda rd, root: _set_attempt(rd, "submitted", "x"),
        'journal.jsonl`: skipped 1 record that cannot be read (line 2: `attempt` is "x", not an integer)',
        ALL,
        {**OK, "logs": 2},  # no attempt left to show; the others decide without it
    ),
    "run.yaml a list": (
        lambda rd, root: Path(rd.p("run.yaml")).write_text("- a\n- b\n"),
        "run.yaml` is not a run description",
        ALL,
        {**OK, "logs": 2, "amend": 2, "stop": 2, "resume": 2},
    ),
    "lease truncated": (
        lambda rd, root: Path(rd.p("lease.json")).write_bytes(Path(rd.p("lease.json")).read_bytes()[:50]),
        "lease.json` cannot be read as a lease (not JSON)",
        ("amend-restart", "stop", "resume"),
        {**OK, "amend-restart": 2, "stop": 2, "resume": 2},
    ),
    "lease []": (
        lambda rd, root: Path(rd.p("lease.json")).write_text("[]"),
        "lease.json` cannot be read as a lease ([] is not a lease",
        ("amend-restart", "stop", "resume"),
        {**OK, "amend-restart": 2, "stop": 2, "resume": 2},
    ),
    "attempts/1.json []": (
        lambda rd, root: Path(rd.p("attempts", "1.json")).write_text("[]"),
        "attempts/1.json` is not an attempt file (not a JSON object)",
        LIVE,
        OK,
    ),
    "dangling symlink in the run root": (
        lambda rd, root: (root / "gone").symlink_to(root / "nowhere"),
        "",
        (),
        OK,
    ),
    "one bad ingredients.yaml among runs": (
        lambda rd, root: (make_soup(root), (root / "soup" / "ingredients.yaml").write_text("[oops\n")),
        "soup/ingredients.yaml` is not a run of ingredients",
        ("runs",),
        OK,
    ),
}


def cli(root: Path, *args: str):
    """`olmo-ctl ARGS` in this process, warning as a fresh process does (each warning once)."""
    from olmo_ctl import rundir

    rundir._WARNED.clear()
    return invoke(*args, env=cli_env(root))


def _commands(root: Path) -> dict[str, tuple[str, ...]]:
    at = ("--run-root", str(root), "--backend", "local")
    return {
        "runs": ("runs", "--run-root", str(root), "-o", "json"),
        "monitor": ("monitor", str(root / "demo"), "-o", "json"),
        "logs": ("logs", "demo", *at),
        "amend": ("amend", "demo", *at, "--set", "train.max_steps=30"),
        "amend-restart": ("amend", "demo", *at, "--set", "train.max_steps=30", "--restart"),
        "stop": ("stop", "demo", *at),
        "resume": ("resume-until-done", "demo", *at),
    }


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_damage_is_a_warning_or_exit_2_naming_the_file(tmp_path, damage, no_submission):
    root = tmp_path / "runs"
    pristine = make_run(tmp_path / "pristine")
    how, named, naming, expected = DAMAGE[damage]
    for cmd, rc in expected.items():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine.path, root / "demo", symlinks=True)
        rd = RunDir.of(str(root), "demo")
        how(rd, root)
        before = _files(root)
        p = cli(root, *_commands(root)[cmd])
        said = p.stdout + p.stderr
        assert p.returncode == rc, (cmd, p.returncode, said[-1500:])
        assert NO_TRACEBACK not in said
        if cmd in naming:
            assert named in p.stderr, (cmd, p.stderr)
        if rc == 2:  # refused: one line naming the file, nothing changed
            assert p.stderr.strip().splitlines()[-1].startswith("error: "), p.stderr
            assert _files(root) == before, cmd
        if cmd == "runs":
            rows = {r["name"]: r for r in json.loads(p.stdout)["runs"]}
            assert rows["demo"]["state"] == ("unreadable" if damage == "run.yaml a list" else "done")
            if "soup" in rows:
                assert rows["soup"]["state"] == "unreadable"
        if cmd == "resume" and rc == 0:
            assert events(rd)[-2:] == ["supervisor_started", "done"]
        if cmd == "amend" and rc == 0:
            assert events(rd)[-1] == "amended"


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


def test_monitor_of_a_file_or_with_a_plot_nowhere_is_exit_2(tmp_path):
    rd = make_run(tmp_path / "runs")
    for args, said in (
        ((rd.p("run.yaml"),), "is a file, not a run directory"),
        ((rd.path, "--plot", str(tmp_path / "missing" / "x.png")), "does not exist"),
        ((rd.path, "--plot", str(tmp_path)), "is a directory"),
    ):
        p = cli(tmp_path / "runs", "monitor", *args, "--no-backend")
        assert p.returncode == 2 and said in p.stderr and NO_TRACEBACK not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------- fuzz: every byte boundary of every file
#
# Each file of a finished run's directory (and of a run of ingredients) is cut at every byte boundary
# and read back by the readers every command shares (the journal, the lease, attempt files, checkpoint
# markers): each cut reads as the intact file's records or as none of a torn one, never as something
# else. The commands (`runs`, `monitor`, `logs`, `stop`, `resume-until-done`) then run once for each
# distinct thing the readers made of a cut (a CLI call costs a tenth of a second: one per byte would
# take minutes): exit 0 or 2, no traceback, and `resume-until-done` decides as on the intact run (done,
# nothing submitted) or refuses (exit 2, nothing journaled). run.yaml and ingredients.yaml too, at every
# byte: each cut is bad input or a run description whose recipe the readers compare with the intact one.


def _check(root: Path, what: str, rc_ok: set[int], *args: str):
    p = cli(root, *args)
    said = p.stdout + p.stderr
    assert p.returncode in rc_ok, (what, args[0], p.returncode, said[-1500:])
    assert NO_TRACEBACK not in said, (what, said[-1500:])
    if p.returncode == 2:
        assert p.stderr.strip().splitlines()[-1].startswith("error: "), (what, p.stderr)
    return p


def _resume_decides_the_same_or_refuses(rd: RunDir, root: Path, what: str) -> None:
    """`resume-until-done` on a done run: the same decision as on the intact run (done: no attempt
    submitted, `supervisor_started` and `done` journaled) or a refusal (exit 2, the journal as it was)."""
    path = Path(rd.p("journal.jsonl"))
    before = path.read_bytes() if path.exists() else b""
    rc = _check(
        root, what, {0, 2}, "resume-until-done", "demo", "--run-root", str(root), "--backend", "local"
    ).returncode
    after = path.read_bytes() if path.exists() else b""
    if rc == 2:
        assert after == before, what
    else:
        new = [json.loads(x) for x in after[len(before) :].split(b"\n") if x.strip().startswith(b"{")]
        assert [r["event"] for r in new] == ["supervisor_started", "done"], (what, new)
        assert new[-1]["committed_step"] == STEPS, what


def _records_prefix(recs: list[dict], intact: list[dict], what: str) -> int:
    assert recs == intact[: len(recs)], what  # the intact records, in order: never one made of a torn line
    return len(recs)


def test_fuzz_every_truncation_of_every_file_is_read_or_refused(tmp_path, no_submission, monkeypatch):
    from olmo_ctl.backends.local import read_attempt_file

    # thousands of appends and lease writes: their durability is not what is tested here
    monkeypatch.setattr(os, "fsync", lambda fd: None)

    root, soups = tmp_path / "runs", tmp_path / "soups"
    rd = make_run(root)
    soup = make_soup(soups)
    make_run(soups, "beside")  # `runs` of a root with a damaged run of ingredients lists this one
    pristine = {**_files(root), **_files(soups)}
    journal, soup_journal = rd.journal(), soup.dir.journal()
    lease, attempt = rd.read_lease(), read_attempt_file(rd.p("attempts", "1.json"))
    run_doc, spec, final_recipe = rd.read_run(), soup.spec(), rd.recipe(pending=True).fingerprint()
    at = ("--run-root", str(root), "--backend", "local")

    def journal_sig(what: str):
        n = _records_prefix(rd.journal(), journal, what)
        rd.append("amended", reason="after a cut")  # never swallowed by a torn last line
        assert (
            _records_prefix(rd.journal()[:-1], journal, what) == n and rd.journal()[-1]["event"] == "amended"
        )
        return n

    def lease_sig(what: str):
        try:
            doc = rd.read_lease()
        except BadInput as e:
            assert "cannot be read as a lease" in e.message, what
            with pytest.raises(BadInput):  # never taken over blind
                rd.acquire_lease(ttl_s=60)
            return "unreadable"
        assert doc == lease, what
        return "intact"

    def attempt_sig(what: str):
        info = read_attempt_file(rd.p("attempts", "1.json"))
        assert info in (None, attempt), what
        return info is None

    def marker_sig(what: str):
        assert rd.committed_steps() == [STEPS], what  # Orbax's marker counts by its presence
        return "committed"

    def soup_journal_sig(what: str):
        return _records_prefix(soup.dir.journal(), soup_journal, what)

    def run_yaml_sig(what: str):
        try:
            doc = rd.read_run()
            recipe = run_recipe(doc, rd.p("run.yaml"), pending=True)  # as RunDir.recipe(pending=True)
        except BadInput:
            return "bad input"
        same = tuple(sorted((k, doc[k] == run_doc.get(k)) for k in doc))
        return same, recipe.fingerprint() == final_recipe, int(recipe.train.max_steps)

    def spec_sig(what: str):
        c = Composite(str(soups), "soup")
        try:
            doc = c.spec()
        except BadInput:
            return "bad input"
        listed = doc["ingredients"]
        return tuple(sorted((str(k), doc[k] == spec.get(k)) for k in doc)), len(listed), str(listed[-1:])

    def journal_cmds(what: str):
        p = _check(root, what, {0}, "runs", "--run-root", str(root), "--no-backend-status", "-o", "json")
        [row] = json.loads(p.stdout)["runs"]
        assert row["state"] in ("done", "unreadable"), (what, row)  # as intact, or said to be unreadable
        _check(root, what, {0, 2}, "monitor", rd.path, "-o", "json")
        _check(root, what, {0, 2}, "logs", "demo", *at)
        _resume_decides_the_same_or_refuses(rd, root, what)

    def live_cmds(what: str):  # what reads the lease and the attempt file: is anything live?
        _check(root, what, {0, 2}, "stop", "demo", *at)
        _resume_decides_the_same_or_refuses(rd, root, what)

    def soup_cmds(what: str):
        _check(soups, what, {0}, "runs", "--run-root", str(soups), "--no-backend-status", "-o", "json")
        _check(soups, what, {0, 2}, "monitor", soup.dir.path, "-o", "json")

    def run_yaml_cmds(what: str):
        journal_cmds(what)
        _check(root, what, {0, 2}, "stop", "demo", *at)

    targets = [  # (file, where to cut, what its readers make of a cut, the commands to run on each)
        (rd.p("journal.jsonl"), None, journal_sig, journal_cmds),
        (rd.p("lease.json"), None, lease_sig, live_cmds),
        (rd.p("attempts", "1.json"), None, attempt_sig, live_cmds),
        (rd.p("checkpoints", str(STEPS), COMMIT_MARKER), None, marker_sig, journal_cmds),
        (soup.dir.p("journal.jsonl"), None, soup_journal_sig, soup_cmds),
        (rd.p("run.yaml"), None, run_yaml_sig, run_yaml_cmds),
        (soup.spec_path, None, spec_sig, soup_cmds),
    ]
    # what a reader's check (an append, a lease taken) writes; a command may write anything
    written = {Path(rd.p("journal.jsonl")), Path(rd.p("lease.json")), Path(soup.dir.p("journal.jsonl"))}

    def restore(but: Path, files: set[Path] | None = None) -> None:
        for p in set(_files(root)) | set(_files(soups)) if files is None else set():
            if p not in pristine:  # left by a command (stop.json, ...)
                p.unlink()
        for p in pristine if files is None else files:
            if p != but and (not p.exists() or p.read_bytes() != pristine[p]):
                p.write_bytes(pristine[p])

    cuts_read = commands_run = 0
    for path, where, sig_of, cmds in targets:
        whole = Path(path).read_bytes()
        seen: set = set()
        for n in where(whole) if where else range(len(whole)):
            restore(Path(path), written)
            Path(path).write_bytes(whole[:n])
            what = f"{os.path.relpath(path, tmp_path)} cut at byte {n} of {len(whole)}"
            sig = sig_of(what)
            cuts_read += 1
            if sig in seen:
                continue
            seen.add(sig)
            restore(Path(path))
            Path(path).write_bytes(whole[:n])  # as cut: its reader's check may have appended to it
            cmds(what)
            commands_run += 1
        restore(Path(path), written)
        restore(Path(""))
    assert _files(root) | _files(soups) == pristine  # every command ran on the run as it was, but the cut
    assert cuts_read > 3000 and commands_run > 20, (cuts_read, commands_run)


@pytest.mark.parametrize("ingredients", ["[]", "[3]", "[{run: ''}]", "[{name: a}]"])
def test_an_ingredients_list_that_names_no_run_is_bad_input_naming_the_file(tmp_path, ingredients):
    """`ingredients: []` (or an entry that names no run) edited by hand: exit 2 naming ingredients.yaml
    for the commands that take the run of ingredients by name, a warning from `runs`; no traceback."""
    root = tmp_path / "runs"
    soup = make_soup(root)
    spec = Path(soup.spec_path)
    doc = yaml.safe_load(spec.read_text())
    doc["ingredients"] = yaml.safe_load(ingredients)
    spec.write_text(yaml.safe_dump(doc))
    at = ("--run-root", str(root))
    for args in (("monitor", "soup", *at), ("logs", "soup", *at), ("stop", "soup", *at)):
        p = cli(root, *args)
        assert p.returncode == 2 and "ingredients.yaml" in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stdout + p.stderr, p.stderr
    p = cli(root, "runs", *at, "-o", "json")
    assert p.returncode == 0 and "ingredients.yaml" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_an_attempt_never_starts_from_step_0_when_the_journal_records_a_commit(tmp_path):
    """Every checkpoint's marker gone (a copy cut off, markers deleted): the journal says step STEPS was
    committed, so an attempt from step 0 is bad input naming the step directories, not a new start."""
    from olmo_ctl.core.errors import BadInput

    rd = make_run(tmp_path / "runs")
    rd.check_not_from_scratch(rd.committed_step())  # as made: its checkpoint counts
    (Path(rd.p("checkpoints", str(STEPS))) / COMMIT_MARKER).unlink()
    assert rd.committed_step() == 0
    with pytest.raises(BadInput, match=f"records checkpoint {STEPS} committed.*without one: {STEPS}.*step 0"):
        rd.check_not_from_scratch(rd.committed_step())
