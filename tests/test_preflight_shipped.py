"""Preflight results shipped with the package (olmo_ctl/preflight/shipped.json, `make preflight-shipped`):
`submit` and `preflight` answer from them without compiling while the trainer is the one that compiled
them, or lowers its steps to the same program, and say how long a compile takes when none covers the recipe and slice. Nothing here compiles (a
compile that starts raises `Compiled`); tests/test_preflight.py (the tpu_compile lane) compiles one
shipped result again and compares its figures.

The lookup tests read a copy of the shipped file stamped with this checkout's trainer version, so they
test the lookup whether or not the trainer changed since the file was made; the file itself is checked
for its pairs, its compilers and one trainer version."""

from __future__ import annotations

import json

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.preflight import cache as C
from olmo_ctl.preflight import compile as pf
from tools import preflight_shipped as T

pytestmark = pytest.mark.skipif(
    not pf.libtpu_available(), reason="needs libtpu (pip install 'olmo-ctl[tpu]')"
)


class Compiled(Exception):
    """Raised where a compile would start."""


def _shipped() -> dict:
    return json.loads(C.SHIPPED_PATH.read_text())


@pytest.fixture
def no_compile(monkeypatch, tmp_path):
    """An empty user cache, a compile that raises if anything starts one, and the shipped results as
    this checkout's trainer version would have them (`no_compile` is that file's path)."""
    monkeypatch.setenv("OLMO_CTL_CACHE_DIR", str(tmp_path / "cache"))

    def compile_step(*a, **k):
        raise Compiled()

    monkeypatch.setattr(pf, "compile_step", compile_step)
    # where this process's libtpu started with other flags, the compile would run in a process of its own
    monkeypatch.setattr(pf, "compile_in_own_process", compile_step)
    data = _shipped()
    version = C.trainer_version()
    for result in data["results"].values():
        result["trainer_version"] = version
    path = tmp_path / "shipped.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(C, "SHIPPED_PATH", path)
    return path


def test_every_default_pair_is_shipped_for_the_locked_compilers():
    """The file holds a result for each of make preflight-shipped's pairs under the key a machine with
    constraints.txt's jax, jaxlib and libtpu looks up (a recipe, plan, flag or compiler change that
    moves a key fails here: run `make preflight-shipped`), all of one trainer version."""
    data = _shipped()
    assert data["compilers"] == C.compiler_versions()
    for pair in T.DEFAULT_PAIRS:
        name, _, device = pair.partition(":")
        hit = data["results"].get(pf.shipped_key_for(load_recipe(name), get_device(device)))
        assert hit is not None, f"{pair}: no shipped result; run `make preflight-shipped`"
        assert (hit["recipe"], hit["device"], hit["cached"], hit["shipped"]) == (name, device, False, False)
        assert hit["compiled_by_xla"] or hit["error"], pair
    assert len({r["trainer_version"] for r in data["results"].values()}) == 1


def test_submit_on_a_shipped_recipe_and_slice_compiles_nothing(no_compile):
    recipe, dev = load_recipe(stage=1), get_device("tpu7x-128")
    lines: list[str] = []
    r = pf.submit_check(recipe, dev, make_plan(recipe, dev), log=lines.append)
    assert r is not None and r.shipped and r.cached and r.fits
    assert len(lines) == 1 and lines[0].startswith(
        "preflight: olmo3-7b-stage1 fits on tpu7x-128 with remat="
    ), lines
    assert lines[0].endswith(f"(shipped with olmo-ctl, compiled by {C.trainer_version()})")


def test_preflight_answers_from_the_shipped_result_and_no_cache_compiles(no_compile, tmp_path):
    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_CACHE_DIR": str(tmp_path / "cache")}
    p = invoke("preflight", "--stage", "2", "--device", "v5p-256", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    key = pf.shipped_key_for(load_recipe(stage=2), get_device("v5p-256"))
    want = json.loads(no_compile.read_text())["results"][key]
    assert row["shipped"] and row["cached"] and row["compile_s"] == want["compile_s"]
    assert row["peak_bytes_per_device"] == want["peak_bytes_per_device"] and "compiling" not in p.stderr
    table = invoke("preflight", "--stage", "2", "--device", "v5p-256", env=env)
    assert table.returncode == 0 and "+ shipped with olmo-ctl" in table.stdout, table.stdout
    with pytest.raises(Compiled):  # --no-cache compiles here, shipped results or not
        pf.run_preflight(load_recipe(stage=2), get_device("v5p-256"), use_cache=False)


def test_the_json_of_a_sequence_sharded_step_says_its_layout(no_compile, tmp_path):
    """Stage 3 (65,536 tokens, 64 instances over 128 devices): `-o json` says each sequence is split over
    2 devices, on one slice, as docs/preflight.md states."""
    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_CACHE_DIR": str(tmp_path / "cache")}
    p = invoke("preflight", "--stage", "3", "--device", "tpu7x-128", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    assert (row["seq_shards"], row["slices"], row["shipped"]) == (2, 1, True)


@pytest.mark.parametrize(
    "change",
    [
        {"overrides": ["train.seq_len=4096"]},  # another fingerprint
        {"slices": 2},
        {"remat": "none"},
        {"head_dim": 256},
        {"n_layers": 2},
        {"per_device_batch": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_what_changes_the_compiled_program_finds_no_shipped_result(no_compile, change):
    kw = dict(change)
    recipe = load_recipe(stage=1, overrides=kw.pop("overrides", []))
    with pytest.raises(Compiled):
        pf.run_preflight(recipe, get_device("tpu7x-128"), **kw)


def test_a_run_reading_its_own_bucket_answers_from_the_same_result(no_compile):
    """data.root is where the data is read, not what is compiled: `--set data.root=` keeps the result."""
    mine = load_recipe(stage=1, overrides=["data.root=gs://my-bucket"])
    assert mine.fingerprint() != load_recipe(stage=1).fingerprint()
    r = pf.run_preflight(mine, get_device("tpu7x-128"))
    assert r.shipped and r.fits
    with pytest.raises(Compiled):  # any other change is another recipe, as for the cache
        pf.run_preflight(
            load_recipe(stage=1, overrides=["data.root=gs://my-bucket", "data.seed=7"]),
            get_device("tpu7x-128"),
        )


def test_site_xla_flags_find_no_shipped_result(no_compile):
    from olmo_ctl.core.config import Settings

    site = Settings(xla_flags="--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true")
    with pytest.raises(Compiled):
        pf.run_preflight(load_recipe(stage=1), get_device("tpu7x-128"), settings=site)


def _stamp(path, **fields) -> None:
    data = json.loads(path.read_text())
    for result in data["results"].values():
        result.update(fields)
        if fields.get("program", "") is None:
            del result["program"]
    path.write_text(json.dumps(data))


def test_another_trainer_versions_result_stands_where_this_trainer_lowers_the_same_program(
    no_compile, monkeypatch
):
    """A result shipped by another trainer version answers without a compile when this trainer lowers
    the train and eval steps to the program it was compiled from (seconds), and is kept in the user's
    cache; another program compiles and says why; a result without a program (an older file) too."""
    _stamp(no_compile, trainer_version="0.0.1+000000000000")
    recipe, dev = load_recipe(stage=1), get_device("tpu7x-128")
    lines: list[str] = []
    r = pf.submit_check(recipe, dev, make_plan(recipe, dev), log=lines.append)
    assert r is not None and r.shipped and r.fits and r.trainer_version == C.trainer_version(), r
    assert "was compiled by trainer 0.0.1+000000000000: lowering this trainer's step" in lines[0], lines
    assert any("the same program: its figures stand, nothing to compile" in line for line in lines), lines
    assert "compiled by trainer 0.0.1+000000000000: this trainer lowers to the same program" in r.notes

    def lowered(*a, **k):
        raise AssertionError("lowered again: the user's cache holds the answer")

    with monkeypatch.context() as m:
        m.setattr(pf, "program_digest", lowered)
        assert pf.run_preflight(recipe, dev).cached

    monkeypatch.setenv("OLMO_CTL_CACHE_DIR", str(no_compile.parent / "cache2"))
    _stamp(no_compile, program="sha256:0")
    lines.clear()
    with pytest.raises(OlmoCtlError):  # the compile this test stops is reported as one that failed
        pf.submit_check(recipe, dev, make_plan(recipe, dev), log=lines.append)
    assert "lowers to another program than trainer 0.0.1+000000000000's" in lines[-1], lines

    _stamp(no_compile, program=None)
    lines.clear()
    with pytest.raises(OlmoCtlError):
        pf.submit_check(recipe, dev, make_plan(recipe, dev), log=lines.append)
    assert "; the shipped result is trainer 0.0.1+000000000000's, not this" in lines[0], lines


def test_a_comment_in_the_trainer_keeps_the_shipped_results(tmp_path):
    """A copy of the package whose trainer differs by a comment (another trainer version) answers
    `preflight` from the shipped result, and `make preflight-shipped` re-keys it without compiling."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(C.__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    shutil.copytree(root / "olmo_ctl", copy / "olmo_ctl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "tools", copy / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    model = copy / "olmo_ctl" / "trainer" / "model.py"
    model.write_text(model.read_text().replace("\ndef forward(", "\n# A comment.\ndef forward(", 1))
    assert C.trainer_version(copy / "olmo_ctl") != C.trainer_version()
    env = {
        **clean_env(tmp_path / "xdg"),
        "OLMO_CTL_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": str(copy),
    }
    run = [sys.executable, "-c", "from olmo_ctl.cli import entry; entry()"]
    p = subprocess.run(
        [*run, "preflight", "--stage", "1", "--device", "tpu7x-128", "-o", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=copy,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    assert row["shipped"] and row["trainer_version"] == C.trainer_version(copy / "olmo_ctl"), row
    assert "nothing to compile" in p.stderr and "compiled in" not in p.stderr, p.stderr
    shipped = copy / "olmo_ctl" / "preflight" / "shipped.json"
    p = subprocess.run(
        [sys.executable, "-m", "tools.preflight_shipped", "smoke:v5p-8"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=copy,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    assert "smoke:v5p-8: the same program as trainer" in p.stdout and "compiled in" not in p.stderr, p.stdout
    (smoke,) = json.loads(shipped.read_text())["results"].values()  # the other versions' results dropped
    want = next(r for r in _shipped()["results"].values() if r["recipe"] == "smoke")
    assert smoke["trainer_version"] == C.trainer_version(copy / "olmo_ctl")
    assert {k: v for k, v in smoke.items() if k != "trainer_version"} == {
        k: v for k, v in want.items() if k != "trainer_version"
    }


def test_a_slice_no_shipped_result_covers_says_so_and_how_long_it_takes(no_compile):
    recipe, dev = load_recipe(stage=1), get_device("tpu7x-256")
    lines: list[str] = []
    with pytest.raises(OlmoCtlError):
        pf.submit_check(recipe, dev, make_plan(recipe, dev), log=lines.append)
    took = C.shipped_compile_s("olmo3-7b-stage1")
    assert took is not None and took > 10
    assert lines[0].startswith("preflight: compiling the train step of olmo3-7b-stage1 for tpu7x-256 (")
    assert f"; no shipped result covers it; this takes about {pf._duration(took)} on a 2-core" in lines[0]
    assert lines[0].endswith("(--no-preflight skips it)")


def test_preflight_says_why_it_compiles_and_how_long_that_takes(no_compile):
    """`olmo-ctl preflight` (`run_preflight` with a log) says, as `submit` does, that no shipped result
    covers the slice and how long the compile takes, from the shipped compiles of the recipe: seconds
    for smoke, not minutes."""
    lines: list[str] = []
    with pytest.raises(Compiled):
        pf.run_preflight(load_recipe("smoke"), get_device("v5p-16"), log=lines.append)
    took = C.shipped_compile_s("smoke")
    assert took is not None and took < 90
    assert lines[0].startswith("preflight: compiling the train step of smoke for v5p-16 ("), lines
    assert f"; no shipped result covers it; this takes about {pf._duration(took)} on a 2-core" in lines[0]
    assert "minutes" not in lines[0]


def test_the_tool_refuses_a_pair_it_cannot_read_before_compiling(no_compile, tmp_path):
    out = tmp_path / "out.json"
    with pytest.raises(BadInput, match="is not RECIPE:DEVICE"):
        T.record(["olmo3-7b-stage1"], out)
    with pytest.raises(BadInput):
        T.record(["smoke:v5p-8", "smoke:v9z-8"], out)  # the unknown device is refused before any compile
    assert not out.exists()
    assert T.main(["smoke", "--out", str(out)]) == 2 and not out.exists()


def test_the_table_fits_an_80_column_terminal_with_every_header_whole(no_compile, tmp_path):
    """The widest row (a step over the HBM, TFLOP in six figures) and every header fit in 80 columns:
    nothing is cut to an ellipsis."""
    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80"}
    p = invoke("preflight", "--stage", "1", "--device", "tpu7x-128", "--hbm-gib", "16", env=env)
    assert p.returncode == 1, p.stderr  # does not fit: the table, then the verdict
    header = next(line for line in p.stdout.splitlines() if "remat" in line and "fits" in line)
    for name in ("remat", "batch", "peak GiB", "eval GiB", "fits", "TFLOP/step", "compile s"):
        assert name in header, header
    assert "…" not in p.stdout and max(len(line) for line in p.stdout.splitlines()) <= 80, p.stdout
    assert "no (+" in p.stdout and "94.75" not in p.stdout and "16.00 GiB HBM per device" in p.stdout


def test_the_widest_rows_fit_80_columns(no_compile, monkeypatch, capsys):
    """Rows as wide as preflight makes them (save_proj, a micro-batch of 1 x 1024, a four-digit
    shortfall, six-figure TFLOP): headers and cells whole, every line within 80 columns."""
    import dataclasses

    from olmo_ctl.cli.preflight import _print_table

    key = pf.shipped_key_for(load_recipe(stage=1), get_device("tpu7x-128"))
    base = pf.PreflightResult(**json.loads(no_compile.read_text())["results"][key])
    wide = dataclasses.replace(
        base,
        remat="save_proj",
        per_device_batch=1,
        grad_accum=1024,
        peak_bytes_per_device=2000 * pf.GIB,
        eval_peak_bytes_per_device=1500 * pf.GIB,
        fits=False,
        shortfall_bytes_per_device=1905 * pf.GIB,
        xla_flops_per_step=123_456_789e12,
        compile_s=12345.0,
        notes=[],
        largest_buffers=[],
    )
    monkeypatch.setenv("COLUMNS", "80")
    _print_table([base, wide])
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80, out
    assert "save_proj" in out and "1x1024" in out and "no (+1905.00)" in out and "12345" in out, out
    header = next(line for line in out.splitlines() if "remat" in line and "fits" in line)
    for name in ("remat", "batch", "peak GiB", "eval GiB", "fits", "compile s"):
        assert name in header, header


def test_a_compile_in_a_process_of_its_own_brings_back_bad_input_as_bad_input(tmp_path, monkeypatch):
    """The child's refusal reaches the caller as the same error: its message, hint and exit code 2."""
    monkeypatch.setenv("OLMO_CTL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(BadInput) as e:  # 8 instances over 4 devices: a micro-batch of 3 does not divide
        pf.compile_in_own_process(load_recipe("smoke"), get_device("v5p-8"), per_device_batch=3)
    want = None
    try:
        pf.plan_for(load_recipe("smoke"), get_device("v5p-8"), 3)
    except BadInput as here:
        want = here
    assert want is not None
    assert (e.value.message, e.value.hint, e.value.exit_code) == (want.message, want.hint, 2)
