"""Fixtures shared by the tests: the GCS emulator, the Kubernetes test server, a trained smoke run.

Set here before any test imports jax (and COLUMNS, which pytest-xdist sets in its workers, unset):
* a persistent JAX compilation cache in the repository's `.cache/jax-compilation/`, through the
  environment, so every trainer process a test starts reads and adds to the same compiled programs
  (JAX_COMPILATION_CACHE_DIR; a directory already set in the environment is kept);
* 8 host CPU devices for jax in this process only (`jax_num_cpu_devices`, not XLA_FLAGS: a child
  process, such as a trainer on `cpu-1`, keeps deciding its own device count), so sharding tests
  run in-process.

* `gcs_server` (session): one fake-gcs-server (olmo_ctl.sandbox.gcs_emulator) for the whole run; its URL.
* `gcs` (per test): the environment pointed at that server for this test and the subprocesses it
  starts (restored afterwards), and an empty bucket of its own: `gcs.bucket`. `gcs.new_bucket(name)`
  creates a bucket with a given name (once per session: later calls return the existing one).
* `kube_server` (per test; `srv` is the same): a fresh Kubernetes API server with its scripted cluster
  (olmo_ctl.sandbox.kube_server.KubeServer). Every test gets its own: the cluster keeps state.
* `smoke_run` (session): the directory of a finished smoke run (40 steps on cpu-1, checkpoints 20 and
  40), trained once for every test that only needs one to read (helpers/runs.py; copy it with
  `helpers.runs.copy_run` to change it).

See docs/testing.md.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from olmo_ctl.sandbox.gcs_emulator import create_bucket, fake_gcs_server, use_emulator
from olmo_ctl.sandbox.kube_server import KubeServer

ROOT = Path(__file__).resolve().parents[1]
HOST_DEVICES = 8  # the most a sharding test uses (test_seq_shards: a sequence split 4 ways x 2)

# pytest-xdist's workers run with COLUMNS=80 (the controller's terminal width): commands under test would
# wrap their human output as at an 80-column terminal. Tests see a pipe, as CI's log is, unless one sets
# COLUMNS itself (tests/test_output_width.py).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # CPU compiles are short: keep all
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_configure(config):
    import jax

    jax.config.update("jax_num_cpu_devices", HOST_DEVICES)


@pytest.fixture(autouse=True, scope="module")
def _quick_compiles(request):
    """A test module that sets `QUICK_COMPILES = True` (the model, attention, sharding, loss and optimizer
    checks: small programs compiled once or twice, where XLA's optimizing passes cost more than running)
    has its programs compiled without them (`jax_disable_most_optimizations`: LLVM's expensive passes
    and the backend's optimization level off; the same HLO, a slower machine code). For that module
    only, with JAX's in-memory caches cleared on the way in and out, so no program compiled this way is
    reused by a test that compares its numbers bit for bit with a trainer process (which compiles as a
    user's does: the flag is never put in the environment)."""
    if not getattr(request.module, "QUICK_COMPILES", False):
        yield
        return
    import jax

    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
        jax.clear_caches()


@dataclass
class GcsEmulator:
    url: str
    bucket: str  # an empty bucket made for this test

    def new_bucket(self, name: str) -> str:
        try:
            create_bucket(self.url, name)
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists already (made by an earlier test)
                raise
        return name


@pytest.fixture(autouse=True)
def _no_activation_mesh_left_behind():
    """A test that made a mesh with `activate` (trainer.sharding) leaves no activation mesh to the next
    test in its worker: the model traced there would pin its activations to another test's devices."""
    yield
    sharding = sys.modules.get("olmo_ctl.trainer.sharding")
    if sharding is not None:
        sharding.deactivate()


@pytest.fixture(scope="session")
def gcs_server():
    with fake_gcs_server() as url:
        yield url


@pytest.fixture
def gcs(gcs_server):
    with use_emulator(gcs_server):
        emu = GcsEmulator(gcs_server, "")
        emu.bucket = emu.new_bucket(f"t-{uuid.uuid4().hex[:16]}")
        yield emu


@pytest.fixture
def kube_server():
    with KubeServer() as server:
        yield server


@pytest.fixture
def srv(kube_server):
    return kube_server


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    from helpers.runs import train_smoke_run

    return train_smoke_run(tmp_path_factory.mktemp("smoke-run") / "run")
