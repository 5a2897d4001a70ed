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


def test_the_cache_key_follows_the_modules_the_steps_import_and_the_eval_micro_batch(tmp_path):
    # The LR schedule traced into the train step lives in core/, and so does the model config whose
    # methods the model calls: editing either recompiles. So does a module of ours the trainer starts
    # importing, found by following the imports, unlisted.
    pkg = Path(C.__file__).resolve().parents[1]
    copy = tmp_path / "olmo_ctl"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__", "recipes", "launch_templates"))
    hashed = {p.relative_to(copy).as_posix() for p in C.hashed_sources(copy)}
    assert {"trainer/step.py", "core/schedule.py", "core/recipe.py", "core/batching.py"} <= hashed
    assert "cli/preflight.py" not in hashed  # the command's printing compiles nothing
    versions = [C.trainer_version(copy)]
    for f in ("core/schedule.py", "core/recipe.py"):
        with open(copy / f, "a") as fh:
            fh.write("\n# a change\n")
        versions.append(C.trainer_version(copy))
    (copy / "core" / "kernel_rules.py").write_text("X = 1\n")
    versions.append(C.trainer_version(copy))
    assert versions[-1] == versions[-2]  # not imported by anything the compile runs: not hashed
    model = copy / "trainer" / "model.py"
    model.write_text(model.read_text() + "\n\ndef _rules():\n    from olmo_ctl.core import kernel_rules\n")
    versions.append(C.trainer_version(copy))
    (copy / "core" / "kernel_rules.py").write_text("X = 2\n")
    versions.append(C.trainer_version(copy))
    assert len(set(versions)) == len(versions) - 1

    # eval.micro_batch is outside the recipe fingerprint, inside the cache key.
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.recipe import load_recipe

    a, b = load_recipe("smoke"), load_recipe("smoke", overrides=["eval.micro_batch=4"])
    assert a.fingerprint() == b.fingerprint()
    v5p = get_device("v5p-8")
    assert C.cache_key(a, v5p, 2, "v") != C.cache_key(b, v5p, 2, "v")
