"""The preflight cache's key: a compiled result is reused only while nothing it depends on changed."""

from __future__ import annotations

import shutil
from pathlib import Path

from olmo_ctl.preflight import cache as C


def test_the_cache_key_follows_every_trainer_source_and_the_compiler_versions(tmp_path, monkeypatch):
    # A copy of the package: editing the step function (trainer/step.py), a file added to the trainer,
    # or another jax / libtpu version each make a different trainer version, so no stale result is read.
    pkg = Path(C.__file__).resolve().parents[1]
    copy = tmp_path / "olmo_ctl"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__", "recipes", "launch_templates"))
    first = C.trainer_version(copy)
    assert C.trainer_version(copy) == first  # deterministic
    with open(copy / "trainer" / "step.py", "a") as f:
        f.write("\n# a change to the step\n")
    edited = C.trainer_version(copy)
    assert edited != first
    (copy / "trainer" / "new_kernel.py").write_text("X = 1\n")
    added = C.trainer_version(copy)
    assert added != edited
    real = C._package_version
    monkeypatch.setattr(C, "_package_version", lambda n: "0.0.0-other" if n == "libtpu" else real(n))
    assert C.trainer_version(copy) != added
