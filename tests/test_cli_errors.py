"""Every user mistake: exit 2, one line on stderr starting with `error:`, nothing on stdout, no traceback.

The cases run the command line's entry point (`olmo_ctl.cli.main`) in this process (helpers.cli.invoke);
one test runs the real `python -m olmo_ctl` as its own process, for what only a process shows."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.cli import ROOT, clean_env, invoke

DRY = ["submit", "--stage", "1", "--device", "tpu7x-128", "--dry-run"]

CASES = {
    "unknown device": (["plan", "--stage", "1", "--device", "v5p-9"], "not a device type"),
    "unknown generation": (["plan", "--stage", "1", "--device", "v4-8"], "unknown generation"),
    "devices --generation": (["devices", "--generation", "v4"], "not a device generation"),
    "no recipe": (["plan", "--device", "v5p-8"], "no recipe given"),
    "stage 4": (["plan", "--stage", "4", "--device", "v5p-8"], "not a stage"),
    "stage and recipe": (["plan", "--stage", "1", "--recipe", "smoke", "--device", "v5p-8"], "exclusive"),
    "a stage the model lacks": (
        ["plan", "--model", "olmo2-32b", "--stage", "3", "--device", "v5p-512"],
        "--model olmo2-32b has no stage 3",
    ),
    "unknown model": (
        ["plan", "--model", "olmo9-1b", "--stage", "1", "--device", "v5p-8"],
        "no shipped stage",
    ),
    "model without stage": (["plan", "--model", "olmo3-32b", "--device", "v5p-512"], "needs --stage"),
    "model with recipe": (
        ["submit", "--model", "olmo3-32b", "--recipe", "smoke", "--device", "cpu-1", "--dry-run"],
        "needs --stage",
    ),
    "model alone to resume": (
        ["resume-until-done", "--model", "olmo3-32b", "--device", "v5p-8"],
        "needs --stage",
    ),
    "model alone to submit": (["submit", "--model", "olmo3-32b", "--device", "v5p-8"], "needs --stage"),
    "model with data info": (["data", "info", "--model", "olmo2-32b", "--stage", "3"], "has no stage 3"),
    "model with preflight": (
        ["preflight", "--model", "olmo2-32b", "--stage", "3", "--device", "v5p-8"],
        "has no stage 3",
    ),
    "batch cannot split": (
        ["plan", "--stage", "1", "--device", "tpu7x-1024", "--set", "train.seq_shards=1"],
        "cannot be split",
    ),
    "bad recipe key": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "train.bogus=1"],
        "unknown key",
    ),
    "bad recipe type": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "train.global_batch=abc"],
        "must be an integer",
    ),
    # A value from --set is blamed on the --set, never on the shipped recipe file.
    "bad type names the --set": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "train.global_batch=abc"],
        "error: --set train.global_batch=abc: `train.global_batch` must be an integer",
    ),
    "negative seq_len is about seq_len": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "train.seq_len=-5"],
        "error: --set train.seq_len=-5: `train.seq_len` must be > 1",
    ),
    "short seq_len names the --set": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "train.seq_len=2048"],
        "error: --set train.seq_len=2048: `model.sliding_window` (4096) must not exceed",
    ),
    "remat budget without budget": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "model.remat_budget=0.5"],
        "has no effect with model.remat=full",
    ),
    "bad --set syntax": (
        ["plan", "--stage", "1", "--device", "v5p-8", "--set", "global_batch"],
        "key.sub=value",
    ),
    "missing recipe file": (
        ["plan", "--recipe", "/nonexistent/r.yaml", "--device", "v5p-8"],
        "does not exist",
    ),
    "unknown recipe name": (["plan", "--recipe", "olmo4", "--device", "v5p-8"], "not a recipe"),
    "mfu as percent": (["plan", "--stage", "1", "--device", "v5p-8", "--mfu", "40"], "not a fraction"),
    "does not fit": (["plan", "--stage", "1", "--device", "cpu-4"], "does not fit"),
    "uppercase run name": ([*DRY, "--run", "OLMo-7b"], "not a valid run name"),
    "underscore run name": ([*DRY, "--run", "olmo_7b"], "not a valid run name"),
    "leading digit run name": ([*DRY, "--run", "7b-olmo"], "not a valid run name"),
    "run name too long": ([*DRY, "--run", "a" * 64], "more than 63"),
    "local device on gke": (
        ["submit", "--recipe", "smoke", "--device", "cpu-4", "--dry-run"],
        "local device",
    ),
    "bad namespace": ([*DRY, "--namespace", "Bad_NS"], "not a valid namespace"),
    "bad backend": ([*DRY, "--backend", "k8s"], "not a backend"),
    "local run root for gke": ([*DRY, "--run-root", "/tmp/runs"], "not on GCS"),
    "manifest dir missing": ([*DRY, "--output-manifest", "/nonexistent/dir/m.yaml"], "does not exist"),
    "bad output format": ([*DRY, "-o", "table"], "--output"),
    "negative attempt": ([*DRY, "--attempt", "-1"], "--attempt"),
    "missing --device": (["submit", "--stage", "1", "--dry-run"], "--device"),
    "unknown option": (["plan", "--stage", "1", "--device", "v5p-8", "--fast"], "--fast"),
    "unknown command": (["launch"], "launch"),
    # preflight compiles only what it is told to: no silent default recipe or device.
    "preflight without --device": (["preflight", "--stage", "1"], "--device"),
    "preflight without a recipe": (["preflight", "--device", "v5p-8"], "no recipe given"),
    "submit with placeholders": (["submit", "--stage", "1", "--device", "v5p-8"], "placeholders"),
    # Refused before the preflight compile (minutes for the 7B step) and before any cluster call.
    "submit to a local run root on gke": (
        ["submit", "--stage", "1", "--device", "v5p-8", "--run-root", "/tmp/runs", "--image", "img:1"],
        "not on GCS",
    ),
    "submit a local device on gke": (
        ["submit", "--recipe", "smoke", "--device", "cpu-4", "--run-root", "gs://b/r", "--image", "img:1"],
        "local device",
    ),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return clean_env(tmp_path_factory.mktemp("xdg"))


def _assert_user_error(p, expect: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert p.stdout == ""
    errors = [line for line in p.stderr.splitlines() if not line.startswith("note: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), p.stderr
    assert expect in errors[0]


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_invocation(case, env):
    args, expect = CASES[case]
    _assert_user_error(invoke(*args, env=env), expect)


def test_the_real_entry_point_prints_one_line_and_exits_2(env):
    """`python -m olmo_ctl` itself: the exit status of the process and its two streams."""
    for case in ("unknown device", "unknown option"):
        args, expect = CASES[case]
        p = subprocess.run(
            [sys.executable, "-m", "olmo_ctl", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        _assert_user_error(p, expect)


def test_bad_files(env, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    _assert_user_error(
        invoke("plan", "--recipe", str(bad_yaml), "--device", "v5p-8", env=env), "not valid YAML"
    )
    cfg = tmp_path / "xdg" / "olmo-ctl" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("namespace: ok\nzone: us-central1\n")
    p = invoke("config", "show", env={**env, "XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    _assert_user_error(p, "unknown setting `zone`")


@pytest.mark.parametrize(
    "text,expect",
    [
        (
            "name: r\nbase: olmo3-7b-stage1\nmodel: {from: olmo3-7b, n_layers: 16}\n",
            "`model.n_layers` is set twice",
        ),
        (
            "name: r\nbase: olmo3-7b-stage1\ntrain: {max_steps: 10}\ntrain: {seq_len: 64}\n",
            "`train` is set twice",
        ),
        ("name: r\nstage: 1\ndata: {mix: OLMo-mix-0625-official}\n", "the recipe has no model"),
    ],
)
def test_recipe_layers_refused(env, tmp_path, text, expect):
    """A user delta recipe that sets a key twice at one level, or names no model: exit 2, one line."""
    (tmp_path / "r.yaml").write_text(text)
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "plan", "--recipe", str(tmp_path / "r.yaml"), "--device", "v5p-8"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    _assert_user_error(p, expect)


@pytest.mark.gcs
def test_data_missing_from_ai2_s_bucket_says_how_to_point_data_root_elsewhere(env, gcs_server, tmp_path):
    """The shipped recipes read AI2's gs://olmo-data: where that data is missing (here an empty bucket of
    that name on the GCS emulator), a submit and `data info` say so and how to read a copy elsewhere."""
    from conftest import GcsEmulator

    GcsEmulator(gcs_server, "").new_bucket("olmo-data")
    runs = GcsEmulator(gcs_server, "").new_bucket("runs-data-root")
    gcs_env = {**env, "STORAGE_EMULATOR_HOST": gcs_server}
    submit = [
        "submit", "--stage", "1", "--device", "tpu7x-128", "--run-root", f"gs://{runs}/runs",
        "--image", "img:1", "--no-preflight",
    ]  # fmt: skip
    for args in (["data", "info", "--stage", "1"], submit):
        p = invoke(*args, env=gcs_env)
        _assert_user_error(p, "`gs://olmo-data/preprocessed/dolma3-0625/")
        assert "does not exist" in p.stderr and "AI2's bucket" in p.stderr, p.stderr
        assert "--set data.root=gs://YOUR-BUCKET" in p.stderr, p.stderr
    # A root of one's own that lacks a file: the same way out.
    p = invoke("data", "info", "--stage", "3", "--set", f"data.root={tmp_path}", env=env)
    _assert_user_error(p, f"`{tmp_path}/preprocessed/")
    assert "--set data.root=" in p.stderr and "AI2" not in p.stderr
