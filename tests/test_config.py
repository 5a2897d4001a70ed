"""Site settings: flags > OLMO_CTL_* environment > config file > defaults, shown by `olmo-ctl config show`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from olmo_ctl.backends import placeholders, resolve_settings
from olmo_ctl.core.batching import read_launch_record
from olmo_ctl.core.config import PLACEHOLDER_RUN_ROOT
from olmo_ctl.core.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OLMO_CTL_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "olmo-ctl").mkdir()
    return tmp_path / "olmo-ctl" / "config.yaml"


def test_defaults_without_a_file(xdg):
    s = resolve_settings()
    assert s.run_root == PLACEHOLDER_RUN_ROOT and s.backend == "gke" and s.priority_class is None
    assert set(s.sources.values()) == {"default"}
    assert placeholders(s) == ["run_root", "image"]


def test_precedence_flag_over_env_over_file(xdg, monkeypatch):
    xdg.write_text(
        yaml.safe_dump(
            {
                "namespace": "from-file",
                "queue": "file-q",
                "run_root": "gs://file/runs",
                "priority_class": "file-prio",
            }
        )
    )
    monkeypatch.setenv("OLMO_CTL_QUEUE", "env-q")
    monkeypatch.setenv("OLMO_CTL_NAMESPACE", "from-env")
    monkeypatch.setenv("OLMO_CTL_PRIORITY_CLASS", "")  # empty clears an optional setting
    s = resolve_settings(namespace="from-flag")
    assert (s.namespace, s.queue, s.run_root, s.priority_class) == (
        "from-flag",
        "env-q",
        "gs://file/runs",
        None,
    )
    assert s.sources["namespace"] == "flag --namespace"
    assert s.sources["queue"] == "env OLMO_CTL_QUEUE"
    assert s.sources["run_root"] == f"file {xdg}"
    assert s.sources["image"] == "default"
    assert placeholders(s) == ["image"]


@pytest.mark.parametrize(
    "content,match",
    [
        ("namespce: x\n", "unknown setting `namespce`"),
        ("namespace: [a, b]\n", "must be a string"),
        ("- just\n- a list\n", "YAML mapping"),
        ("namespace: 'unclosed\n", "not valid YAML"),
        ("namespace: Bad_NS\n", "not a valid namespace"),
        ("backend: k8s\n", "not a backend"),
        ("run_root: s3://b/runs\n", "gs://"),
        ("placement_policy: 'pp-{zone}'\n", "unknown placeholder"),
        ("queue: ''\n", "not a valid Kubernetes object name"),
    ],
)
def test_bad_config_files(xdg, content, match):
    xdg.write_text(content)
    with pytest.raises(BadInput, match=match):
        resolve_settings()


def test_bad_env_value_names_its_source(xdg, monkeypatch):
    monkeypatch.setenv("OLMO_CTL_SERVICE_ACCOUNT", "Not A Name")
    with pytest.raises(BadInput) as e:
        resolve_settings()
    assert "OLMO_CTL_SERVICE_ACCOUNT" in e.value.message


def test_config_show_and_dry_run_use_the_file(xdg):
    xdg.write_text(yaml.safe_dump({"namespace": "research", "run_root": "gs://bkt/olmo", "image": "img:7"}))
    env = dict(os.environ)
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "config", "show", "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout)
    assert shown["config_file"] == str(xdg) and shown["config_file_exists"]
    assert shown["settings"]["namespace"] == "research"
    assert shown["sources"]["namespace"] == f"file {xdg}"
    assert shown["placeholders"] == []
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "config", "show"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert "research" in p.stdout and str(xdg) in p.stdout
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "submit",
            "--stage",
            "1",
            "--device",
            "v5p-256",
            "--dry-run",
            "--namespace",
            "override",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    js = json.loads(p.stdout)
    assert js["metadata"]["namespace"] == "override"
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "img:7"
    assert "gs://bkt/olmo/olmo3-7b-stage1" in pod["containers"][0]["command"]
    assert "placeholder" not in p.stderr


def test_local_backend_defaults_and_dry_run(xdg, tmp_path):
    s = resolve_settings(backend="local")
    assert s.run_root == os.path.abspath("runs") and s.sources["run_root"] == "default for the local backend"
    assert placeholders(s) == []
    assert resolve_settings(backend="local", run_root="my-runs/").run_root == os.path.abspath("my-runs")
    pytest.importorskip("olmo_ctl.backends.local")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "submit",
            "--recipe",
            "smoke",
            "--device",
            "cpu-2",
            "--backend",
            "local",
            "--run-root",
            str(tmp_path / "runs"),
            "--dry-run",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    req = json.loads(p.stdout)
    argv = req["argv"]
    assert argv[1:] == [
        "-m",
        "olmo_ctl.trainer",
        "--run-dir",
        str(tmp_path / "runs" / "smoke"),
        "--device",
        "cpu-2",
        "--attempt",
        "1",
        "--plan",
        argv[-1],
    ]
    # The trainer is handed the launcher's parsed target and plan, not a name to parse again.
    target, plan = read_launch_record(argv[-1])
    assert target.device.name == "cpu-2" and target.slices == 1
    assert plan.devices == 2 and plan.recipe == "smoke"
    assert req["env"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert p.stderr == ""


def test_the_shipped_recipes_data_root_is_said_to_be_ai2_s_bucket_before_any_submit(xdg, tmp_path):
    """`submit --dry-run`, `config show` and `config init` say that data.root is AI2's bucket, and how to
    read a copy elsewhere; a recipe that reads other data hears nothing of it."""
    says = "--set data.root=gs://YOUR-BUCKET"

    def olmo_ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "olmo_ctl", *args],
            capture_output=True, text=True, env=dict(os.environ), cwd=tmp_path, timeout=60,
        )  # fmt: skip

    for stage in ("1", "2", "3"):
        p = olmo_ctl("submit", "--stage", stage, "--device", "tpu7x-128", "--dry-run")
        assert p.returncode == 0, p.stderr
        ai2 = [ln for ln in p.stderr.splitlines() if "gs://olmo-data" in ln]
        assert len(ai2) == 1 and "AI2's bucket" in ai2[0] and says in ai2[0], p.stderr
    p = olmo_ctl(
        "submit", "--stage", "1", "--device", "tpu7x-128", "--dry-run", "--set", "data.root=gs://mine"
    )
    assert p.returncode == 0 and "olmo-data" not in p.stderr, p.stderr
    p = olmo_ctl("submit", "--recipe", "smoke", "--device", "cpu-1", "--backend", "local", "--dry-run")
    assert p.returncode == 0 and "olmo-data" not in p.stderr, p.stderr
    p = olmo_ctl("config", "show")
    assert p.returncode == 0 and "gs://olmo-data" in p.stderr and says in p.stderr, p.stderr
    p = olmo_ctl("config", "init")
    assert p.returncode == 0, p.stderr
    text = xdg.read_text()
    assert (
        "AI2's\n# bucket, gs://olmo-data (data.root)" in text
        and says in text
        and yaml.safe_load(text) is None
    )
