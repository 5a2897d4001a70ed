"""Storage deadlines for every client the trainer talks to GCS through (`runtime.storage_timeout_s`).

Three clients reach the run directory: google-cloud-storage (`olmo_ctl.storage`: run.yaml, the
journal, the epoch order, the packing, event segments), gcsfs (Orbax's metadata and its listing of
the committed steps) and tensorstore (Orbax's arrays). Left alone, gcsfs waits forever for an answer
and tensorstore retries 32 times with back-off, so a storage endpoint that accepts and never answers
stalls a restore or a save for as long as nobody looks. `apply(T)` gives each a timeout per try and
bounded retries so that one operation gives up after about T (a little more for gcsfs, whose six
tries are fixed: at most T + 40 s), and the error ends the attempt with exit 3:

- google-cloud-storage: each try waits T/4, the retries stop at T (`storage.set_deadline`);
- gcsfs: each request (its whole exchange) T/6 (`requests_timeout`, through fsspec's config, which
  every GCSFileSystem made later reads), at most six tries with gcsfs's own 1-16 s back-off;
- tensorstore: a transfer that moves no byte for T/4 s is aborted (curl's low-speed limit), a
  connection takes at most T/4, and a request is tried at most 4 times with back-off capped at T/8
  (the `gcs_request_retries` resource of the contexts Orbax builds for every save and restore).

Call it before the first Orbax call: tensorstore reads its environment when it makes its first
transport, and every GCSFileSystem is made on first use.
"""

from __future__ import annotations

import os

from olmo_ctl import storage

TENSORSTORE_TRIES = 4


def tensorstore_env(seconds: float) -> dict[str, str]:
    """The environment of tensorstore's HTTP transport for deadline `seconds`."""
    per_try = str(max(1, int(seconds / 4)))
    return {
        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": per_try,
        "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
        "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": per_try,
    }


def tensorstore_retries(seconds: float) -> dict:
    """The `gcs_request_retries` context resource for deadline `seconds`."""
    return {
        "max_retries": TENSORSTORE_TRIES - 1,
        "initial_delay": "1s",
        "max_delay": f"{max(1, int(seconds / 8))}s",
    }


def gcsfs_config(seconds: float) -> dict:
    return {"requests_timeout": max(1.0, seconds / 6)}


def apply(seconds: float) -> None:
    """Bound every storage client of this process by `seconds` (see the module docstring)."""
    storage.set_deadline(seconds)
    os.environ.update(tensorstore_env(seconds))
    import fsspec.config

    for proto in ("gs", "gcs"):
        fsspec.config.conf.setdefault(proto, {}).update(gcsfs_config(seconds))
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    # Orbax deep-copies these for the context of every save and restore (get_ts_context).
    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        context = getattr(ts_utils, name, None)
        if isinstance(context, dict):
            context["gcs_request_retries"] = tensorstore_retries(seconds)
