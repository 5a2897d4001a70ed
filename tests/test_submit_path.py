"""The one submit path: every command that submits an attempt checks it as `submit` does, before
anything is written; site options are declared once and a run's own are rendered by later commands;
no command branches on a backend's name."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"


def _cli(*argv: str) -> int:
    from olmo_ctl.cli import main

    return main(list(argv))


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture
def sandbox(clean_env, monkeypatch, gcs):
    """The sandbox cluster (XPK's Kueue set-up, pods kept running by the scripted runner) with a v5p-16
    and a v5p-8 slice, kubectl's environment pointed at it, and a run root on the GCS emulator."""
    from olmo_ctl.sandbox.sandbox import Sandbox, parse_slices

    with Sandbox(slices=parse_slices(["v5p-16=1", "v5p-8=1"])) as sb:
        monkeypatch.setenv("KUBECONFIG", str(sb.write_kubeconfig(clean_env / "kubeconfig")))
        yield sb, f"gs://{gcs.bucket}/runs"


# ---------------------------------------------------------------- refused before anything is written


def test_resume_until_done_on_the_local_backend_refuses_a_tpu_device_with_nothing_written(clean_env, capsys):
    root = clean_env / "runs"
    rc = _cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "tpu7x-128",
        "--backend",
        "local",
        "--run",
        "x1",
        "--run-root",
        str(root),
    )
    err = capsys.readouterr().err
    assert rc == 2 and "`tpu7x-128` is a TPU slice; the local backend runs cpu-N or gpu-N" in err
    assert not root.exists()


@pytest.mark.parametrize(
    "device,why",
    [
        ("cpu-l", "`cpu-l` is not a device type"),
        ("cpu-3", "cpu-3"),  # 8 instances do not split over 3 devices
    ],
)
def test_resume_until_done_refuses_a_bad_device_before_run_yaml_exists(clean_env, capsys, device, why):
    """A mistyped device, or one the batch cannot split over, leaves no run behind: the right device
    then creates the run as if nothing had happened."""
    root = clean_env / "runs"
    rc = _cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        device,
        "--backend",
        "local",
        "--run",
        "x1",
        "--run-root",
        str(root),
        "--poll",
        "0.5",
    )
    out = capsys.readouterr()
    assert rc == 2 and why in out.err and out.err.count("\n") == 1, out.err
    assert "supervisor_started" not in out.out
    assert not (root / "x1").exists()


@pytest.mark.gcs
@pytest.mark.parametrize(
    "flag,missing",
    [
        (("--priority-class", "no-such-class"), "WorkloadPriorityClass"),
        (("--queue", "no-such-queue"), "LocalQueue"),
    ],
)
def test_resume_until_done_on_gke_refuses_missing_kueue_objects_before_creating_anything(
    sandbox, capsys, flag, missing
):
    sb, root = sandbox
    rc = _cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "v5p-16",
        "--backend",
        "gke",
        "--run",
        "k1",
        "--run-root",
        root,
        "--image",
        IMAGE,
        "--no-preflight",
        *flag,
    )
    err = capsys.readouterr().err
    assert rc == 2 and missing in err and flag[1] in err, err
    from olmo_ctl.rundir import RunDir

    assert not RunDir.of(root, "k1").exists()  # no run.yaml, no journal
    assert sb.world.items("JobSet", None) == []


@pytest.mark.gcs
def test_a_resize_renders_the_site_options_the_run_was_submitted_with(sandbox, capsys):
    """The service account (and queue, image, ...) given to `submit` is the run's own: a resize that
    does not name it renders it again."""
    sb, root = sandbox
    site = ["--backend", "gke", "--run-root", root, "--no-preflight"]
    with sb.server.store.lock:  # submit refuses a service account the namespace does not have
        sb.world.ensure_service_account("sa-of-the-run")
    assert (
        _cli(
            "submit",
            "--recipe",
            "smoke",
            "--device",
            "v5p-16",
            "--run",
            "r1",
            "--image",
            IMAGE,
            "--service-account",
            "sa-of-the-run",
            *site,
        )
        == 0
    )
    first = sb.world.get("JobSet", "default", "r1-a1")
    pod = first["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "sa-of-the-run"
    capsys.readouterr()

    assert _cli("resize", "r1", "--device", "v5p-8", "-y", "--now", "--timeout", "120", *site) == 0, (
        capsys.readouterr().err
    )
    second = sb.world.get("JobSet", "default", "r1-a2")
    pod = second["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "sa-of-the-run"
    assert pod["containers"][0]["image"] == IMAGE
    from olmo_ctl.rundir import RunDir

    subs = [r for r in RunDir.of(root, "r1").journal() if r["event"] == "submitted"]
    assert [(r["attempt"], r["device"], r["site"]["service_account"]) for r in subs] == [
        (1, "v5p-16", "sa-of-the-run"),
        (2, "v5p-8", "sa-of-the-run"),
    ]


@pytest.mark.gcs
def test_a_flag_wins_over_the_runs_own_site_setting(sandbox, gcs):
    from olmo_ctl.backends import resolve_settings
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import run_settings

    _, root = sandbox
    rd = RunDir.of(root, "own")
    rd.create_run({"name": "smoke"}, "fp", "v1:test", "v5p-16")
    rd.append(
        "submitted",
        attempt=1,
        device="v5p-16",
        backend="gke",
        site={"service_account": "sa-run", "queue": "q-run", "image": "img:run"},
    )
    got = run_settings(resolve_settings(run_root=root, service_account="sa-flag"), rd)
    assert (got.service_account, got.queue, got.image) == ("sa-flag", "q-run", "img:run")
    assert got.sources["queue"] == "run own (attempt 1)"


@pytest.mark.gcs
def test_a_run_of_the_same_name_from_another_run_root_is_refused_and_never_mistaken_for_ours(sandbox, capsys):
    """JobSet names are `<run>-a<attempt>`: a second run `twin` from another run root in the same
    namespace is refused at submit in one line, nothing written; and the first run's supervisor never
    takes the other's JobSets for its own (reattach, stray stop), telling them apart by run directory."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.rundir import RunDir

    sb, root = sandbox
    other = root + "-elsewhere"
    site = ["--backend", "gke", "--no-preflight", "--image", IMAGE]
    assert (
        _cli("submit", "--recipe", "smoke", "--device", "v5p-16", "--run", "twin", "--run-root", root, *site)
        == 0
    )
    capsys.readouterr()
    rc = _cli(
        "submit", "--recipe", "smoke", "--device", "v5p-16", "--run", "twin", "--run-root", other, *site
    )
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "already holds run `twin` of another run directory" in err and f"{root}/twin" in err
    assert not RunDir.of(other, "twin").exists()
    assert [js["metadata"]["name"] for js in sb.world.items("JobSet", None)] == ["twin-a1"]
    b = GKEBackend.from_settings(resolve_settings_for_test(root))
    assert b.find_live("twin", f"{root}/twin").name == "twin-a1"
    assert b.find_live("twin", f"{other}/twin") is None  # another run's attempt is not this run's
    assert b.live_attempts("twin", f"{other}/twin") == []


def resolve_settings_for_test(root: str):
    from olmo_ctl.backends import resolve_settings

    return resolve_settings(run_root=root, backend="gke", image=IMAGE)


# ---------------------------------------------------------------- an existing run's next attempt


@pytest.mark.chaos
def test_submit_on_a_finished_run_submits_nothing_and_an_existing_run_needs_no_recipe(clean_env, capsys):
    """`submit --run R` continues R from its run.yaml (no --recipe or --set); on a complete run it says
    so and exits 0 with nothing submitted."""
    from olmo_ctl.rundir import RunDir

    root = clean_env / "runs"
    args = ["--backend", "local", "--run-root", str(root), "--run", "f1"]
    assert _cli("submit", "--recipe", "smoke", "--device", "cpu-1", "--set", "train.max_steps=12", *args) == 0
    rd = RunDir.of(str(root), "f1")
    from helpers.waiting import wait_for

    wait_for(lambda: rd.committed_step() >= 12 and not _live(rd), 300, "the first attempt")
    capsys.readouterr()
    assert _cli("submit", *args) == 0
    out = capsys.readouterr().out
    assert "is complete (checkpoint 12 of 12 committed): nothing submitted" in out
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1]


def _smoke_run(root: Path, name: str, *, attempts: int = 0):
    """Run `name` of the smoke recipe on cpu-2 under `root`, made by hand: run.yaml, and `attempts`
    submitted attempts in its journal (nothing ran)."""
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint

    r = load_recipe("smoke")
    rd = RunDir.of(str(root), name)
    rd.create_run(r.to_dict(), r.fingerprint(), data_fingerprint(r), "cpu-2", 1)
    for n in range(1, attempts + 1):
        rd.append("submitted", attempt=n, device="cpu-2", slices=1, reason="by hand", committed_step=0)
    return rd


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_dry_run_refuses_what_submit_refuses_and_shows_the_attempt_submit_would_send(clean_env, capsys):
    """`submit --dry-run` of an existing run prepares it as `submit` does: the run's own recipe and device
    (no --recipe or --device needed), the same refusal (line and exit code) for another recipe, another
    device or a live supervisor's lease, the attempt number submit would give (the journal's next, above
    any the lease reserved), and nothing sent for a complete run. Nothing is written."""
    import json

    root = clean_env / "runs"
    rd = _smoke_run(root, "e", attempts=2)
    loc = ["--backend", "local", "--run-root", str(root), "--run", "e"]

    def attempt_shown(*extra: str) -> str:
        assert _cli("submit", *loc, *extra, "--dry-run", "-o", "json") == 0
        argv = json.loads(capsys.readouterr().out)["argv"]
        return argv[argv.index("--attempt") + 1]

    assert attempt_shown() == "3"
    assert attempt_shown("--recipe", "smoke", "--device", "cpu-2") == "3"
    lease = rd.acquire_lease(ttl_s=60)  # a live supervisor of the run (this process)
    rd.reserve_attempt(lease, 5)
    before = _listing(root)
    for refused in (
        ["--recipe", "smoke", "--set", "optimizer.lr=0.05"],
        ["--device", "cpu-4"],
        ["--no-preflight"],  # the lease
    ):
        assert _cli("submit", *loc, *refused) == 2
        real = capsys.readouterr().err
        assert _cli("submit", *loc, *refused, "--dry-run") == 2
        dry = capsys.readouterr()
        assert dry.err == real and real.count("\n") == 1 and dry.out == "", (refused, real, dry.err)
    assert "is supervised by" in real
    assert _listing(root) == before
    rd.release_lease(lease)
    assert attempt_shown() == "6"  # above the number the lease reserved, as submit takes it
    rd.store.write_bytes(rd.p("checkpoints/100/commit_success.txt"), b"")
    before = _listing(root)
    assert _cli("submit", *loc, "--dry-run") == 0
    done = capsys.readouterr()
    assert done.out == "" and "run `e` is complete (checkpoint 100 of 100 committed)" in done.err
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1, 2]
    assert _listing(root) == before


def test_a_run_directory_that_lost_its_run_yaml_is_not_a_new_run(clean_env, capsys):
    """A run's journal and checkpoints without its run.yaml: `submit` (and its --dry-run) and
    `resume-until-done`, with a recipe or without, exit 2 naming the directory and how to restore the
    recipe, and write nothing (no new run.yaml that would train steps 41-50 under another recipe)."""
    root = clean_env / "runs"
    run = root / "x"
    (run / "checkpoints" / "40").mkdir(parents=True)
    (run / "checkpoints" / "40" / "commit_success.txt").write_text("")
    (run / "journal.jsonl").write_text(
        '{"time": "2026-01-01T00:00:00.000000Z", "event": "submitted", "attempt": 1, "device": "cpu-1", '
        '"reason": "first attempt", "committed_step": 0}\n'
    )
    before = _listing(root)
    loc = ["--backend", "local", "--run-root", str(root)]
    new = ["--recipe", "smoke", "--set", "optimizer.lr=0.05", "--device", "cpu-1"]
    for argv in (
        ["submit", "--run", "x", *new, "--dry-run"],
        ["submit", "--run", "x", *new],
        ["submit", "--run", "x"],
        ["resume-until-done", "x", *new],
        ["resume-until-done", "x"],
    ):
        assert _cli(*argv, *loc) == 2, argv
        err = capsys.readouterr().err
        assert err == (
            f"error: run `x` has no run.yaml, but {run} still holds its journal (1 record) and checkpoints up "
            "to step 40, which a new run.yaml would continue under whatever recipe it was given; copy the "
            f"run's run.yaml back to {run}/run.yaml (from a backup) to continue it, or move the directory "
            "aside to start a new run of that name\n"
        ), (argv, err)
        assert _listing(root) == before, argv


def _live(rd) -> bool:
    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.supervise.attempts import live_attempt

    return live_attempt(rd, LocalBackend(rd.path.rsplit("/", 1)[0]))[0] is not None


# ---------------------------------------------------------------- one registry, no name checks


def test_no_command_branches_on_a_backends_name():
    for path in sorted((ROOT / "olmo_ctl" / "cli").glob("*.py")) + sorted(
        (ROOT / "olmo_ctl" / "supervise").glob("*.py")
    ):
        text = path.read_text()
        hits = re.findall(r"backend\s*[!=]=|[!=]=\s*[\"'](?:gke|local)[\"']", text)
        assert not hits, f"{path.name}: {hits}"


def _calls(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every call of a plain or attribute name in `path`."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            out.append((node.lineno, name))
    return out


def test_one_prepare_makes_every_attempt():
    """`supervise.attempts.prepare` is the one maker of attempts: submit and resume-until-done (through
    `submit.prepare_run`), resize, the supervisor, amend, smoke and the eval job call it, and nothing else in
    the package builds an `Attempt`."""
    callers = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "olmo_ctl").rglob("*.py"))
        for _, name in _calls(path)
        if name == "prepare" and "supervise" in path.parts
    }
    assert callers == {
        "olmo_ctl/supervise/submit.py",  # submit, resume-until-done (prepare_run), submit --dry-run
        "olmo_ctl/supervise/resize.py",  # resize, and a supervisor carrying out a resize request
        "olmo_ctl/supervise/supervisor.py",  # each attempt resume-until-done submits
        "olmo_ctl/supervise/smoke.py",
        "olmo_ctl/supervise/evaljob.py",
        "olmo_ctl/supervise/amend.py",  # amend --restart with no supervisor: the next attempt
    }, callers
    makers = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "olmo_ctl").rglob("*.py"))
        if path != ROOT / "olmo_ctl" / "supervise" / "attempts.py"
        for n, name in _calls(path)
        if name == "Attempt"
    ]
    assert not makers, makers
    from olmo_ctl.cli import resize, resume, smoke, submit  # noqa: F401  (the commands load their operations)

    text = {m: (ROOT / "olmo_ctl" / "cli" / f"{m}.py").read_text() for m in ("submit", "resume", "resize")}
    assert "prepare_run" in text["submit"] and "prepare_run" in text["resume"]
    assert "prepare_resize" in text["resize"]


def test_device_names_are_parsed_by_the_backend_contract():
    """A device name becomes a `Target` once (`backends.base.Target.parse`); above the trainer nothing
    calls the catalog's parser itself."""
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "olmo_ctl").rglob("*.py"))
        if path.parts[-2] not in ("backends", "trainer") and path != ROOT / "olmo_ctl" / "core" / "devices.py"
        for n, name in _calls(path)
        if name == "get_device"
    ]
    assert not hits, hits


def _target_parses(path: Path) -> list[int]:
    """Lines of `path` that call `Target.parse` (or `recorded_target`, the run directory's reader)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "parse" and getattr(f.value, "id", "") == "Target":
                out.append(node.lineno)
            elif getattr(f, "id", getattr(f, "attr", "")) == "recorded_target":
                out.append(node.lineno)
    return out


# Where a device name (a string) becomes a `Target`: the input edges. The command line (cli/), the run
# directory's records (rundir.py: run.yaml, the journal, resize requests), the trainer's own command
# line (trainer/__main__.py; trainer/device.py for a trainer started with no device), the sandbox's
# `--slices` (its cluster's node pools), the catalog itself and the backends.
PARSING_EDGES = ("cli/", "rundir.py", "trainer/__main__.py", "trainer/device.py", "sandbox/sandbox.py")


def test_device_names_become_targets_only_at_the_edges():
    """supervise/, observe/, checkpoints/, preflight/ and the rest take a `Target` (or a `Device`) as
    given; only the input edges parse a name, so a device is never re-derived on the way down."""
    hits = []
    for path in sorted((ROOT / "olmo_ctl").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "olmo_ctl"))
        if rel.startswith("backends/") or rel in ("core/devices.py",):
            continue
        for n in _target_parses(path):
            if not any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in PARSING_EDGES):
                hits.append(f"olmo_ctl/{rel}:{n}")
    assert not hits, hits
    # The rule sees what it is meant to see: the command line does parse.
    assert _target_parses(ROOT / "olmo_ctl" / "cli" / "submit.py")
    assert not any(_target_parses(p) for p in (ROOT / "olmo_ctl" / "supervise").rglob("*.py"))
    assert not any(_target_parses(p) for p in (ROOT / "olmo_ctl" / "observe").rglob("*.py"))


def test_only_the_local_backend_and_the_registry_name_the_local_backend():
    """A backend's name is its own and the registry's: no other module spells "local" (or asks for it)."""
    allowed = {ROOT / "olmo_ctl" / "backends" / "local.py", ROOT / "olmo_ctl" / "backends" / "__init__.py"}
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "olmo_ctl").rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if '"local"' in line
    ]
    assert not hits, hits


def test_the_registry_names_every_backend_setting_and_each_class_by_its_name():
    from olmo_ctl.backends import DEFAULT_RUN_ROOTS, REGISTRY, THIS_MACHINE, backend_class
    from olmo_ctl.backends.base import Backend

    assert set(REGISTRY) == set(DEFAULT_RUN_ROOTS) and backend_class(THIS_MACHINE).trains_here
    for name in REGISTRY:
        cls = backend_class(name)
        assert issubclass(cls, Backend) and cls.name == name


def test_the_site_flags_are_the_backends_declared_options():
    """Each backend declares its site options in a dataclass of its own (the class it carries and the
    registry names); the command line's site flags are exactly those, with `--backend` and
    `--run-root`, and each names a setting of `core.config.Settings`."""
    from dataclasses import fields

    from olmo_ctl.backends import OPTIONS, REGISTRY, backend_class, options_class
    from olmo_ctl.backends.options import RunOptions
    from olmo_ctl.cli.options import DECLARED, SITE_OPTIONS
    from olmo_ctl.core.config import setting_names

    assert set(OPTIONS) == set(REGISTRY)
    declared = [f.name for f in fields(RunOptions)]
    for name in REGISTRY:
        assert backend_class(name).options is options_class(name)
        declared += [f.name for f in fields(options_class(name)) if f.name not in declared]
    assert list(SITE_OPTIONS) == list(DECLARED) == declared
    assert set(declared) <= set(setting_names())
    assert "queue" in declared and DECLARED["queue"].role == "render"


def test_every_command_that_renders_an_attempt_takes_the_same_site_options():
    from typer.main import get_command

    from olmo_ctl.cli import load_commands
    from olmo_ctl.cli.options import SITE_OPTIONS

    group = get_command(load_commands())
    want = {"--" + n.replace("_", "-") for n in SITE_OPTIONS}
    for name in ("submit", "resume-until-done", "resize", "smoke"):
        opts = {o for p in group.commands[name].params for o in p.opts}
        assert want <= opts, (name, want - opts)


def test_a_device_the_run_directory_records_is_read_once_and_named_where_it_came_from(tmp_path):
    """`RunDir.target()` reads the run's current target from its newest attempt (else run.yaml);
    `run_target` refuses another device or slice count naming `resize`, a slice count the run's own
    device cannot take naming that first, and a device name the catalog does not know naming the run
    directory it was read from (not the command line)."""
    from olmo_ctl.core.devices import Target, get_device
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import ensure_run, run_target

    rd = RunDir.of(str(tmp_path), "r")
    ensure_run(rd, load_recipe("smoke"), "cpu-1", 1)
    assert rd.target() == Target.parse("cpu-1") == run_target(rd, None, None)
    rd.append("submitted", attempt=1, device="cpu-2", slices=1)  # the newest attempt's device wins
    assert rd.target() == Target.parse("cpu-2") == run_target(rd, get_device("cpu-2"), 1)
    with pytest.raises(BadInput, match=r"runs on cpu-2, not cpu-4") as e:
        run_target(rd, get_device("cpu-4"), None)
    assert "olmo-ctl resize r --device cpu-4" in (e.value.hint or "")
    with pytest.raises(BadInput, match=r"`cpu-2` is a local device"):  # not a resize hint that fails
        run_target(rd, None, 2)
    rd.append("submitted", attempt=2, device="cpu-3x7z", slices=1)  # edited by hand
    with pytest.raises(BadInput, match=r"^run `r` \(.*\) records device `cpu-3x7z` x 1, which this olmo-ctl"):
        rd.target()
