"""Fixtures shared by the tests: the GCS emulator and the Kubernetes test server.

* `gcs_server` (session): one fake-gcs-server (olmo_ctl.testing.gcs_emulator) for the whole run; its URL.
* `gcs` (per test): the environment pointed at that server for this test and the subprocesses it
  starts (restored afterwards), and an empty bucket of its own: `gcs.bucket`. `gcs.new_bucket(name)`
  creates a bucket with a given name (once per session: later calls return the existing one).
* `kube_server` (per test; `srv` is the same): a fresh Kubernetes API server with its scripted cluster
  (olmo_ctl.testing.kube_server.KubeServer). Every test gets its own: the cluster keeps state.

See docs/testing.md.
"""

from __future__ import annotations

import urllib.error
import uuid
from dataclasses import dataclass

import pytest

from olmo_ctl.testing.gcs_emulator import create_bucket, fake_gcs_server, use_emulator
from olmo_ctl.testing.kube_server import KubeServer


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
