"""Errors by cause: what the trainer's exit code says, and what a GCS permission error names."""

from __future__ import annotations

import pytest

from olmo_ctl.storage import PermissionDenied, describe_permission_error
from olmo_ctl.trainer import train

GCS_403 = (
    "403 POST https://storage.googleapis.com/upload/storage/v1/b/olmo-runs/o?uploadType=multipart: "
    '{"error": {"code": 403, "message": "node-sa@my-proj.iam.gserviceaccount.com does not have '
    "storage.objects.create access to the Google Cloud Storage object. Permission 'storage.objects.create' "
    'denied on resource (or it may not exist).", "errors": [{"reason": "forbidden"}]}}'
)
TENSORSTORE_403 = (
    'PERMISSION_DENIED: Error writing "gs://olmo-runs/r/checkpoints/40.orbax-checkpoint-tmp/state/'
    'd/0": HTTP response code: 403 with body: {"error": {"code": 403, "message": '
    '"gke-wi@my-proj.iam.gserviceaccount.com does not have storage.objects.create access to the '
    'Google Cloud Storage object."}}'
)


def test_a_gcs_403_names_identity_permission_and_bucket():
    from google.api_core import exceptions

    d = describe_permission_error(exceptions.Forbidden(GCS_403))
    assert isinstance(d, PermissionDenied) and d.exit_code == 2
    assert (d.identity, d.permission, d.bucket) == (
        "node-sa@my-proj.iam.gserviceaccount.com",
        "storage.objects.create",
        "olmo-runs",
    )
    assert d.one_line().startswith(
        "GCS denied storage.objects.create on bucket gs://olmo-runs to "
        "node-sa@my-proj.iam.gserviceaccount.com"
    )
    # Orbax's arrays go through tensorstore, whose error wraps the same message.
    try:
        try:
            raise ValueError(TENSORSTORE_403)
        except ValueError as inner:
            raise RuntimeError("async save failed") from inner
    except RuntimeError as e:
        d = describe_permission_error(e)
    assert (d.identity, d.permission, d.bucket) == (
        "gke-wi@my-proj.iam.gserviceaccount.com",
        "storage.objects.create",
        "olmo-runs",
    )
    assert describe_permission_error(ValueError("shape mismatch (3, 4) vs (4, 3)")) is None


@pytest.mark.parametrize(
    "exc, code, says",
    [
        (ValueError(TENSORSTORE_403), 2, "GCS denied storage.objects.create on bucket gs://olmo-runs"),
        (RuntimeError("INTERNAL: gloo all-reduce failed: connection reset by peer"), 3, "exit 3"),
        (KeyError("a bug nobody proved deterministic"), 3, "not proven deterministic"),
        (train.TrainingFailed("loss is not finite at step 7"), 1, "loss is not finite"),
    ],
)
def test_the_trainer_exit_code_follows_the_cause(monkeypatch, capsys, exc, code, says):
    def boom(args):
        raise exc

    monkeypatch.setattr(train, "run", boom)
    assert train.main_run(train.TrainArgs(run_dir="/nonexistent")) == code
    assert says in capsys.readouterr().err
