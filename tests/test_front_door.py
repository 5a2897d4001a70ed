"""What a new user tries first: files of the wrong kind where a recipe, an output directory, a model or a
run directory is expected each give one line naming the file and what to do, exit 2, and write nothing;
a trainer on a machine without a TPU uses the CPU without loading libtpu, so preflights (which compile
for TPU with libtpu) can run beside it and beside each other.

Every invocation is the real command line in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import RunDir


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OLMO_CTL_", "TPU_", "XLA_", "JAX_"))}
    e["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    e["XDG_STATE_HOME"] = str(tmp_path / "state")
    return e


def snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def fails_cleanly(tmp_path: Path, env: dict, argv: list[str], names: str, module: str = "olmo_ctl") -> str:
    """Run `python -m module argv` in tmp_path: exit 2, one `error:` line naming `names`, nothing written."""
    before = snapshot(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    assert names in lines[0] and "; " in lines[0], lines[0]  # the file, then what to do
    assert snapshot(tmp_path) == before
    return lines[0]


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\xb0\x03\x3e\x00", "not UTF-8"),  # an executable
        (b"name: smoke\nstage: 1\n\x00\x00\x00\x00", "binary file"),  # NULs in UTF-8
        ("name: smoke\ndescription: caf\u00e9\n".encode("latin-1"), "not UTF-8"),  # Latin-1 text
    ],
)
def test_recipe_that_is_not_text(tmp_path, env, content, says):
    (tmp_path / "r.yaml").write_bytes(content)
    line = fails_cleanly(tmp_path, env, ["plan", "--recipe", "r.yaml", "--device", "cpu-1"], "`r.yaml`")
    assert says in line and "recipes/smoke.yaml" in line


def test_data_prepare_out_is_a_file(tmp_path, env):
    (tmp_path / "doc.txt").write_text("hello world\n" * 50)
    (tmp_path / "tokens").write_text("not a directory")
    line = fails_cleanly(
        tmp_path, env, ["data", "prepare", "doc.txt", "--out", "tokens"], "--out `tokens` is a file"
    )
    assert "choose a directory" in line
    fails_cleanly(tmp_path, env, ["data", "prepare", "doc.txt", "--out", "tokens/sub"], "is a file")


@pytest.mark.parametrize("config", [b"{not json", b"\xff\xfe{}", b"[1, 2]"])
def test_hf_directory_whose_config_is_not_json(tmp_path, env, config):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(config)
    (hf / "model.safetensors").write_bytes(b"\x00" * 16)
    (tmp_path / "orbax").mkdir()
    fails_cleanly(tmp_path, env, ["convert", "hf-to-orbax", "hf", "out"], "`hf/config.json` is not")
    if config != b"{not json":
        return
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fails_cleanly(tmp_path, env, ["parity", "hf", "orbax"], "`hf/config.json` is not")


def test_run_root_that_is_a_file(tmp_path, env):
    (tmp_path / "runs").write_text("a file")
    local = ["--backend", "local", "--run-root", "runs", "--run", "r1"]
    for argv in (
        ["resume-until-done", "--recipe", "smoke", "--device", "cpu-1", *local],
        ["submit", "--recipe", "smoke", "--device", "cpu-1", "--no-preflight", *local],
        ["resize", "r1", "--device", "cpu-2", "--run-root", "runs"],
    ):
        line = fails_cleanly(tmp_path, env, argv, f"run root `{tmp_path / 'runs'}` is a file")
        assert "--run-root DIR" in line


def test_run_directory_whose_run_yaml_is_garbage(tmp_path, env):
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints" / "2").mkdir(parents=True)
    says = f"`{run / 'run.yaml'}` is not a run description"
    for garbage in (b"\x89PNG\r\n\x1a\n\x00\x00", b"just a string\n", b"recipe: [1, 2\n"):
        (run / "run.yaml").write_bytes(garbage)
        fails_cleanly(
            tmp_path, env, ["resume-until-done", "r1", "--backend", "local", "--run-root", "runs"], says
        )
    fails_cleanly(
        tmp_path, env, ["--run-dir", str(run), "--device", "cpu-1"], says, module="olmo_ctl.trainer"
    )
    fails_cleanly(tmp_path, env, ["convert", "orbax-to-hf", str(run / "checkpoints" / "2"), "hf-out"], says)


def _libtpu_mapped(pid: int) -> bool:
    try:
        return "libtpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _tpu_here() -> bool:
    """A TPU on this machine. The trainer below runs without TPU_* variables (`env`), so only the
    devices count: a libtpu loaded earlier in this test process may have set such variables here."""
    from olmo_ctl.trainer.__main__ import _tpu_may_be_present

    return _tpu_may_be_present({k: v for k, v in os.environ.items() if not k.startswith("TPU_")})


def trainer_without_device(tmp_path: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    r = load_recipe("smoke", overrides=["train.max_steps=2", "schedule.warmup_steps=1", "eval.interval=1000"])
    run = tmp_path / "cpu-run"
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), "", "cpu-1")
    p = subprocess.Popen(
        [sys.executable, "-m", "olmo_ctl.trainer", "--run-dir", str(run)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return p, run


def watch(p: subprocess.Popen, timeout: float) -> tuple[str, bool]:
    """(output, whether libtpu was ever mapped into the process), sampled until it exits."""
    seen = False
    end = time.time() + timeout
    while p.poll() is None and time.time() < end:
        seen = seen or _libtpu_mapped(p.pid)
        time.sleep(0.05)
    out, _ = p.communicate(timeout=max(1.0, end - time.time()))
    return out, seen


@pytest.mark.skipif(_tpu_here(), reason="this machine has a TPU: the trainer rightly uses it")
def test_trainer_without_device_on_a_machine_without_tpu_uses_the_cpu_quietly(tmp_path, env):
    p, _ = trainer_without_device(tmp_path, env)
    out, libtpu = watch(p, 600)
    assert p.returncode == 0, out[-3000:]
    assert not libtpu, "the trainer loaded libtpu"
    assert "on cpu-1" in out
    noisy = [
        ln for ln in out.splitlines() if any(w in ln.lower() for w in ("libtpu", "tpu", "invalid_argument"))
    ]
    assert noisy == []


@pytest.mark.tpu_compile
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_tpu_here(), reason="this machine has a TPU")
def test_two_preflights_beside_a_cpu_trainer(tmp_path, env):
    """Two preflights started together (each compiles for v5p-8 with libtpu), and a trainer without
    --device at the same time: all three finish with exit 0."""
    from olmo_ctl.preflight.compile import libtpu_available

    if not libtpu_available():
        pytest.skip("needs libtpu (pip install 'olmo-ctl[tpu]')")
    pf_env = dict(env, OLMO_CTL_CACHE_DIR=str(tmp_path / "cache"))
    argv = [
        sys.executable,
        "-m",
        "olmo_ctl",
        "preflight",
        "--recipe",
        "smoke",
        "--device",
        "v5p-8",
        "--no-cache",
    ]
    trainer, _ = trainer_without_device(tmp_path, env)
    pfs = [
        subprocess.Popen(argv, env=pf_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    out, libtpu = watch(trainer, 1200)
    assert trainer.returncode == 0 and not libtpu, out[-3000:]
    for p in pfs:
        pout, _ = p.communicate(timeout=1200)
        assert p.returncode == 0, pout[-3000:]
        assert "lockfile" not in pout
