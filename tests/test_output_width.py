"""Human output fits the terminal (cli.app.output_width: $COLUMNS, else the terminal's width; a pipe is
never wrapped), laid out by core/text.py: lines broken at spaces, free-text table cells wrapped or put
under their row. Each command a new user found wider than 80 columns, rendered at COLUMNS=80: no
line over 80 (an `error:` line stays one line, as every error does), nothing lost; JSON unchanged."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core.recipe import load_recipe, shipped_recipes
from olmo_ctl.rundir import Composite, RunDir, ingredient_run

WIDTH = 80


@pytest.fixture
def short():
    """A directory with a short path: a path is one word, never broken, so the ones the output names
    (the config file, a run directory) must fit 80 columns themselves."""
    d = Path(tempfile.mkdtemp(prefix="ow", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def env(short):
    return {**clean_env(short / "xdg"), "COLUMNS": str(WIDTH)}


def too_wide(p) -> list[str]:
    """The lines over WIDTH, but an `error:` line and a line of one word longer than WIDTH (a URL is
    never broken: copied, it still works)."""
    lines = p.stdout.splitlines() + [x for x in p.stderr.splitlines() if not x.startswith("error: ")]
    return [x for x in lines if len(x) > WIDTH and len(x.split()) > 1]


def words(text: str) -> list[str]:
    return text.split()


def ingredients_run(root: Path) -> None:
    """A run of ingredients of the OLMo 2 32B anneal whose first ingredient's run exists: its state line
    and its ingredients' --set items are the widest `runs` and `monitor` print."""
    r = load_recipe(stage=2, model="olmo2-32b")
    c = Composite(str(root), "olmo2-32b-s2")
    c.create(r, "gs://my-bucket/runs/olmo2-32b-s1/checkpoints/721901", "v5p-512", 1)
    (root / "olmo2-32b-s2" / "journal.jsonl").write_text(
        '{"event": "created", "time": "2026-12-06T07:09:17Z"}\n'
    )
    sub = r.ingredient_recipe(0)
    RunDir.of(str(root), ingredient_run("olmo2-32b-s2", 0)).create_run(
        sub.to_dict(), sub.fingerprint(), "fp", "v5p-512"
    )


def test_recipes_fit_80_columns_with_every_description_whole(env):
    p = invoke("recipes", env=env)
    assert p.returncode == 0 and too_wide(p) == [], p.stdout
    for name in shipped_recipes():  # each description, word for word, under its recipe
        r = load_recipe(name)
        assert " ".join(words(r.description)) in " ".join(words(p.stdout)), name
    assert p.stdout.splitlines()[0].split()[:3] == ["NAME", "STAGE", "PARAMS"]
    wide = invoke("recipes", env={**env, "COLUMNS": "400"}).stdout  # room enough: one line each
    assert len(wide.splitlines()) == len(shipped_recipes()) + 1
    assert (
        invoke("recipes", "-o", "json", env=env).stdout
        == invoke("recipes", "-o", "json", env={**env, "COLUMNS": "400"}).stdout
    )


def test_config_show_and_its_notes_fit_80_columns(env):
    p = invoke("config", "show", env=env)
    assert p.returncode == 0 and too_wide(p) == [], p.stdout + p.stderr
    assert "us-docker.pkg.dev/YOUR-PROJECT/olmo-ctl/olmo-ctl:latest" in p.stdout.split()  # never broken
    notes = [x for x in p.stderr.splitlines() if x.startswith("note: ")]
    assert len(notes) == 3 and all(x.startswith(("note: ", "      ")) for x in p.stderr.splitlines())
    assert "to submit or resume-until-done" in " ".join(words(p.stderr))


@pytest.mark.parametrize("device", ["h100-mega-80gb-8", "h200-141gb-8", "b200-8", "tpu7x-128"])
def test_the_plan_fits_80_columns(device, env):
    p = invoke("plan", "--stage", "1", "--device", device, env=env)
    assert p.returncode == 0 and too_wide(p) == [], p.stdout
    if device != "tpu7x-128":  # the price line wraps under its value column
        text = " ".join(words(p.stdout))
        assert f"price unknown: set yours per GPU-hour for {device} (site setting `prices`)" in text


def test_runs_and_monitor_of_a_run_of_ingredients_fit_80_columns(env, short):
    root = short / "runs"
    ingredients_run(root)
    p = invoke("runs", "--run-root", str(root), "--no-backend-status", env=env)
    assert p.returncode == 0 and too_wide(p) == [], p.stdout
    state = "0/3 ingredients done, olmo2-32b-s2-i1 new"  # wrapped within its cell, word for word
    col = p.stdout.splitlines()[0].index("STATE")
    cell = [x[col:].split("  ")[0].strip() for x in p.stdout.splitlines()[1:] if x[col:].strip()]
    assert " ".join(cell).startswith(state), p.stdout
    m = invoke("monitor", "olmo2-32b-s2", "--run-root", str(root), "--no-backend", env=env)
    assert m.returncode == 0 and too_wide(m) == [], m.stdout
    assert "data.seed=2662 data.mix=dolmino300 train.max_steps=35763" in m.stdout
    wide = invoke(
        "monitor", "olmo2-32b-s2", "--run-root", str(root), "--no-backend", env={**env, "COLUMNS": "200"}
    )
    assert "seed2662-300b        0  not started  loss -  data.seed=2662 data.mix=dolmino300" in wide.stdout


def test_doctor_wraps_its_messages_at_spaces(env, monkeypatch):
    from olmo_ctl.backends import doctor, kube

    message = (
        "the cluster does not serve jobset.x-k8s.io/v1alpha2 jobsets, which olmo-ctl renders; install "
        "JobSet v0.11.0 or later: kubectl apply --server-side -f https://github.com/kubernetes-sigs/"
        "jobset/releases/download/v0.11.0/manifests.yaml"
    )

    class Client:
        class configuration:
            host = "https://10.0.0.1:443"

    monkeypatch.setattr(kube, "make_api_client", lambda context=None: Client())
    monkeypatch.setattr(
        doctor,
        "run_checks",
        lambda *a, **k: [doctor.Check("jobset-crd", False, message), doctor.Check("rbac", True, "ok")],
    )
    p = invoke("doctor", env=env)
    assert p.returncode == 2 and too_wide(p) == [], p.stdout
    first, *rest = p.stdout.splitlines()
    assert first.startswith("FAIL  jobset-crd  the cluster")
    cont = rest[: next(i for i, x in enumerate(rest) if x.startswith("ok"))]
    # Under the message, never mid-word; the URL, longer than the room beside the names, on a line of its own.
    assert cont[-1] == "https://github.com/kubernetes-sigs/jobset/releases/download/v0.11.0/manifests.yaml"
    assert cont[:-1] and all(x.startswith(" " * 18) for x in cont[:-1])
    assert words(" ".join([first, *cont]))[2:] == words(message)


def test_the_resize_confirmation_fits_80_columns_and_summarizes_the_plan(short):
    env = {**clean_env(short / "xdg"), "COLUMNS": str(WIDTH)}
    root = short / "runs"
    r = load_recipe("smoke", overrides=["train.max_steps=40"])
    RunDir.of(str(root), "r").create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    args = (
        "resize",
        "r",
        "--device",
        "cpu-2",
        "--run-root",
        str(root),
        "--backend",
        "local",
        "--no-preflight",
    )
    p = invoke(*args, env=env)  # no terminal to confirm on: the confirmation, then exit 2
    assert p.returncode == 2 and "pass -y to confirm" in p.stderr
    assert too_wide(p) == [], p.stdout
    assert '"target"' not in p.stdout and "+- '<plan: cpu-2, per-device batch 4 x 1>'" in p.stdout
    assert "per_device_batch      8 -> 4" in p.stdout  # the values, in the plan lines above the diff


# ---------------------------------------------------------------- the layout rules themselves


def test_text_is_broken_at_spaces_only():
    from olmo_ctl.core.text import wrap

    text = "a value us-docker.pkg.dev/YOUR-PROJECT/olmo-ctl/olmo-ctl:latest and more words"
    assert wrap(text, None) == [text] and wrap(text, 200) == [text]
    lines = wrap(text, 30, 4)
    assert [x.strip() for x in lines] == [
        "a value",
        "us-docker.pkg.dev/YOUR-PROJECT/olmo-ctl/olmo-ctl:latest",
        "and more words",
    ]
    assert lines[2].startswith("    ") and lines[1].startswith("us-")  # a long word loses its indent first


def test_a_table_wraps_its_free_text_then_puts_it_under_the_row():
    from olmo_ctl.core.text import table_lines

    head = ("NAME", "N", "TEXT")
    rows = [("alpha", "1", "one two three four five six seven"), ("b", "22", "eight")]
    assert table_lines(head, rows) == [
        "NAME   N   TEXT",
        "alpha  1   one two three four five six seven",
        "b      22  eight",
    ]
    assert table_lines(head, rows, flex=("TEXT",), width=30) == [
        "NAME   N   TEXT",
        "alpha  1   one two three four",
        "           five six seven",
        "b      22  eight",
    ]
    assert table_lines(head, rows, right={"N"}, flex=("TEXT",), under="TEXT", width=16) == [
        "NAME    N",
        "alpha   1",
        "  one two three",
        "  four five six",
        "  seven",
        "b      22",
        "  eight",
    ]


def test_closest_names_one_or_none():
    from olmo_ctl.core.text import closest

    assert closest("cpu1", ["cpu-1", "cpu-2", "cpu-16"]) == "cpu-1"
    assert closest("cpu-l", ["cpu-1", "cpu-2"]) is None  # two equally close: no guess
    assert closest("zzz", ["cpu-1"]) is None


def test_a_pipe_is_never_wrapped(tmp_path):
    env = clean_env(tmp_path / "xdg")  # no COLUMNS, and stdout is not a terminal
    p = invoke("plan", "--stage", "1", "--device", "h100-mega-80gb-8", env=env)
    assert any(len(x) > WIDTH for x in p.stdout.splitlines())
    assert json.loads(invoke("recipes", "-o", "json", env=env).stdout)
