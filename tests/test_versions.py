"""The versions a run trains with: recorded in run.yaml by the first attempt, a change reported in one
line (trainer output, journal, monitor), a restore refused when the checkpoint format may not read
(orbax-checkpoint major/minor) unless --allow-version-change. Real trainer processes, real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from olmo_ctl.core import versions
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.observe.monitor import build_report, load
from olmo_ctl.rundir import RunDir

SMOKE = ["train.max_steps=2", "schedule.warmup_steps=1", "eval.interval=1000", "checkpoint.interval=2"]


def new_run(path: Path) -> RunDir:
    r = load_recipe("smoke", overrides=SMOKE)
    rd = RunDir(str(path))
    rd.create_run(r.to_dict(), r.fingerprint(), "", "cpu-1")
    return rd


def set_recorded(rd: RunDir, **changed: str) -> dict:
    doc = yaml.safe_load(Path(rd.p("run.yaml")).read_text())
    doc["versions"] = {**doc["versions"], **{k.replace("_", "-"): v for k, v in changed.items()}}
    Path(rd.p("run.yaml")).write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc["versions"]


def test_installed_reads_metadata_without_importing():
    code = (
        "import json, sys; from olmo_ctl.core.versions import installed; v = installed(); "
        "print(json.dumps([v, sorted(m for m in ('jax', 'jaxlib', 'optax', 'orbax') if m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got, imported = json.loads(out.stdout)
    assert imported == []
    assert list(got) == list(versions.PACKAGES)
    for name, v in got.items():
        try:
            assert v == metadata.version(name)
        except metadata.PackageNotFoundError:
            assert v is None


@pytest.mark.parametrize(
    "old,new,blocks",
    [
        ({"orbax-checkpoint": "0.11.0"}, {"orbax-checkpoint": "0.12.8"}, True),  # minor: format may change
        ({"orbax-checkpoint": "0.12.1"}, {"orbax-checkpoint": "0.12.8"}, False),  # patch
        ({"orbax-checkpoint": "1.0.0"}, {"orbax-checkpoint": "0.12.8"}, True),  # major
        ({"orbax-checkpoint": "0.12.8"}, {"orbax-checkpoint": None}, True),  # not installed any more
        (
            {"jax": "0.6.0", "libtpu": "0.0.17"},
            {"jax": "0.10.2", "libtpu": "0.0.42.1"},
            False,
        ),  # numerics only
    ],
)
def test_blocking_rule(old, new, blocks):
    diff = versions.changes(old, new)
    assert diff and bool(versions.blocking(diff)) is blocks


def test_changes_compare_only_recorded_packages_and_say_so_in_one_line():
    diff = versions.changes(
        {"jax": "0.6.0", "optax": "0.2.8"}, {"jax": "0.10.2", "optax": "0.2.8", "libtpu": None}
    )
    assert diff == [("jax", "0.6.0", "0.10.2")]
    assert (
        versions.describe([*diff, ("libtpu", "0.0.17", None)]) == "jax 0.6.0 -> 0.10.2, libtpu 0.0.17 -> none"
    )


def test_run_dir_records_then_reports_then_refuses(tmp_path):
    rd = new_run(tmp_path / "r")
    now = versions.installed()
    assert rd.check_versions(now, attempt=1) is None  # the first attempt records
    assert rd.read_run()["versions"] == now
    assert rd.check_versions(now, attempt=2, restoring=True) is None  # same versions: nothing
    assert [r["event"] for r in rd.journal()] == []

    old = set_recorded(rd, jax="0.0.1")  # numerics: reported, not refused
    line = rd.check_versions(now, attempt=3, restoring=True)
    assert line == f"versions changed since the run's last attempt: jax 0.0.1 -> {now['jax']}"
    (rec,) = rd.journal()
    assert (rec["event"], rec["attempt"], rec["reason"], rec["previous"], rec["versions"]) == (
        "versions_changed",
        3,
        line,
        old,
        now,
    )
    assert rd.read_run()["versions"] == now  # the run now trains with these

    old = set_recorded(rd, orbax_checkpoint="0.1.0")
    before = Path(rd.p("run.yaml")).read_text()
    with pytest.raises(BadInput) as e:
        rd.check_versions(now, attempt=4, restoring=True)
    assert f"orbax-checkpoint 0.1.0 -> {now['orbax-checkpoint']}" in e.value.one_line()
    assert "--allow-version-change" in e.value.one_line()
    assert Path(rd.p("run.yaml")).read_text() == before  # refused: the record stays
    assert rd.journal()[-1]["refused"] is True and rd.journal()[-1]["attempt"] == 4
    # Nothing to restore (no committed checkpoint): a new format is no danger.
    assert rd.check_versions(now, attempt=5, restoring=False).startswith("versions changed")
    set_recorded(rd, orbax_checkpoint="0.1.0")
    line = rd.check_versions(now, attempt=6, restoring=True, allow_change=True)
    assert line.endswith("; restoring anyway (--allow-version-change)")
    assert rd.journal()[-1]["allowed"] is True and rd.read_run()["versions"] == now

    # Other processes of a multi-host attempt compare and refuse, and write nothing.
    set_recorded(rd, orbax_checkpoint="0.1.0")
    n = len(rd.journal())
    with pytest.raises(BadInput):
        rd.check_versions(now, attempt=7, restoring=True, write=False)
    assert len(rd.journal()) == n


def trainer(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl.trainer", "--run-dir", str(run_dir), "--device", "cpu-1", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_trainer_restores_a_run_recorded_with_other_versions(tmp_path):
    rd = new_run(tmp_path / "run")
    p = trainer(tmp_path / "run", "--attempt", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    now = versions.installed()
    assert rd.read_run()["versions"] == now and "versions changed" not in p.stdout
    assert rd.committed_steps() == [2]

    # An image rebuilt with another Orbax minor and another jax: refused before anything is restored.
    old = set_recorded(rd, orbax_checkpoint="0.1.0", jax="0.0.1")
    p = trainer(tmp_path / "run", "--attempt", "2")
    assert p.returncode == 2, p.stdout + p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: run `run`: versions changed"), p.stderr
    assert f"jax 0.0.1 -> {now['jax']}, orbax-checkpoint 0.1.0 -> {now['orbax-checkpoint']}" in err[0]
    assert "restored" not in p.stdout
    assert rd.read_run()["versions"] == old and rd.committed_steps() == [2]

    # --allow-version-change: the warning, then the restore (of the final step: nothing left to train).
    p = trainer(tmp_path / "run", "--attempt", "3", "--allow-version-change")
    assert p.returncode == 0, p.stdout + p.stderr
    warn = [ln for ln in p.stdout.splitlines() if "versions changed" in ln]
    assert warn == [
        f"warning: versions changed since the run's last attempt: jax 0.0.1 -> {now['jax']}, "
        f"orbax-checkpoint 0.1.0 -> {now['orbax-checkpoint']}; restoring anyway (--allow-version-change)"
    ]
    assert "restored checkpoint 2" in p.stdout and "committed step 2" in p.stdout
    events = [
        (r["event"], r["attempt"], bool(r.get("refused")), bool(r.get("allowed"))) for r in rd.journal()
    ]
    assert events == [("versions_changed", 2, True, False), ("versions_changed", 3, False, True)]

    rep = build_report(load(str(tmp_path / "run")), ask_backend=False)
    assert f"attempt 3: {warn[0].removeprefix('warning: ')}" in rep["warnings"]
