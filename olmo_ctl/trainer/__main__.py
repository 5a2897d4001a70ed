"""`python -m olmo_ctl.trainer`: the bundled trainer's entry point (see docs/CONTRACTS.md).

Parses arguments without importing jax, so that a CPU target (`--device cpu-N`) can set XLA_FLAGS first.
An attempt olmo-ctl renders carries its target and plan (`--plan`, made once by the CLI); `--device`
(and `--slices`) is for starting the trainer by hand, which makes the plan here.
Exit codes: 0 reached the final step (or --stop-at-step) with it committed; 143 stopped by SIGTERM
after checkpointing; 1 deterministic training error; 2 bad input; 3 restartable (storage, network,
joining the slice's hosts, a lost peer, a hang, any runtime error not proven deterministic).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m olmo_ctl.trainer", description="OLMo 3 trainer (JAX).")
    p.add_argument(
        "--recipe", help="recipe file, name from recipes/, or gs:// URL (default: <run-dir>/run.yaml)"
    )
    p.add_argument("--run-dir", required=True, help="run directory (local path or gs://)")
    p.add_argument("--device", help="device type, e.g. v5p-256, tpu7x-128, cpu-4")
    p.add_argument("--slices", type=int, default=1, help="slices of --device (multislice, joined over DCN)")
    p.add_argument(
        "--plan",
        dest="launch",
        metavar="JSON",
        help="the attempt's target and batch plan as olmo-ctl renders them (instead of --device); "
        "refused when it disagrees with the recipe or with the devices JAX sees",
    )
    p.add_argument("--attempt", type=int, default=0, help="attempt number (names the event segments)")
    p.add_argument(
        "--stop-at-step", type=int, default=None, help="stop after step N with checkpoint N committed"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value (repeatable)",
    )
    p.add_argument(
        "--allow-data-change", action="store_true", help="resume although the data fingerprint changed"
    )
    p.add_argument(
        "--init-from", help="initialise parameters from this converted checkpoint when the run has none"
    )
    p.add_argument(
        "--allow-version-change",
        action="store_true",
        help="restore although the Orbax version differs from the run's (run.yaml `versions`)",
    )
    p.add_argument(
        "--eval",
        dest="eval_spec",
        metavar="SPEC",
        help="evaluate instead of training: SPEC is an eval job's JSON (olmo-ctl eval --backend gke); "
        "--run-dir is the job's output directory, which gets result.json",
    )
    return p.parse_args(argv)


def _tpu_may_be_present(environ=None) -> bool:
    """Cheap and without libtpu: TPU chips show up as /dev/accel* (v4, v5e) or VFIO groups under /dev/vfio
    (v5p, v6e, Ironwood), and TPU VMs and GKE TPU pods set TPU_* variables (in `environ`, default ours)."""
    import glob

    if glob.glob("/dev/accel*") or [g for g in glob.glob("/dev/vfio/*") if not g.endswith("/vfio")]:
        return True
    return any(k.startswith("TPU_") for k in (os.environ if environ is None else environ))


def _target_and_plan(ns: argparse.Namespace):
    """(target, plan) of this process: the attempt's (`--plan`), the one `--device` names (plan None:
    made by the trainer), or (None, None): what this machine shows. BadInput for a name the catalog
    does not know or a `--device` that disagrees with the `--plan` beside it."""
    from olmo_ctl.core.batching import read_launch_record
    from olmo_ctl.core.devices import Target
    from olmo_ctl.core.errors import BadInput

    if ns.launch is not None:
        target, plan = read_launch_record(ns.launch)
        if ns.device and (ns.device, ns.slices) != (target.name, target.slices):
            raise BadInput(
                f"--device {ns.device} x {ns.slices} disagrees with --plan's {target.on}", "pass one of them"
            )
        return target, plan
    if ns.device:
        return Target.parse(ns.device, ns.slices), None
    return None, None


def _prepare_env(target) -> None:
    """A CPU target: its devices per process (unless the launcher set XLA_FLAGS) and the CPU platform
    only; no target on a machine without a TPU: the CPU platform.

    With a GCS emulator (STORAGE_EMULATOR_HOST), point every client at it: tensorstore (Orbax arrays)
    would otherwise retry real GCS, and gcsfs (Orbax metadata) would probe for cloud credentials.
    """
    from olmo_ctl.trainer.checkpoint import emulator_env_defaults

    emulator_env_defaults()
    if target is None and not _tpu_may_be_present():
        # No TPU here: the CPU, quietly. jax would otherwise initialise libtpu, which logs pages of
        # INVALID_ARGUMENT and holds /tmp/libtpu_lockfile while this process lives.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if target is None or target.device.platform != "cpu":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = target.device.devices_per_process
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


GPU_DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"


def _gpu_determinism(target, model, environ=None) -> str | None:
    """On a GPU target, XLA's deterministic ops where the model's attention allows them, so that a
    resumed run replays its uninterrupted twin bit for bit as on TPUs (without them two processes on
    one GPU differ from the first step, ~1e-5). cuDNN's fused attention does not run with them (JAX
    0.11.2 aborts the step), so a model on cuDNN attention keeps XLA's defaults and is told so. Sets
    XLA_FLAGS (read when the backend comes up), unless it names the flag already; returns the line
    it prints (None off GPUs). docs/benchmarks.md#the-train-step-on-one-gpu has the measurements."""
    env = os.environ if environ is None else environ
    if target is None or target.device.platform != "gpu":
        return None
    flags = env.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" in flags:
        line = "gpu: XLA_FLAGS sets xla_gpu_deterministic_ops itself; kept as it is"
    elif model.attention in ("blocked", "banded", "reference") or (
        model.attention in ("auto", "cudnn") and model.compute_dtype == "float32"  # cuDNN takes bf16 only
    ):
        env["XLA_FLAGS"] = f"{flags} {GPU_DETERMINISM_FLAG}".strip()
        runs = "banded and blocked" if model.attention == "banded" else "blocked"
        line = f"gpu: {GPU_DETERMINISM_FLAG} ({model.attention} attention runs {runs}): resume replays bit for bit"
    else:
        line = (
            f"gpu: {model.attention} attention runs on cuDNN, which XLA's deterministic ops do not take: a"
            " resumed run matches an uninterrupted one to about 1e-5, not bit for bit"
        )
    print(line, flush=True)
    return line


def _check_versions(ns: argparse.Namespace, committed: list[int]) -> None:
    """run.yaml's `versions` against this environment's (see RunDir.check_versions): recorded by the first
    attempt, a change reported in one line, a restore refused when its checkpoint format may not read."""
    from olmo_ctl.core.versions import installed
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.trainer import multihost

    primary = True
    if multihost.joined():  # several hosts: one process records, every one checks
        primary = sys.modules["jax"].process_index() == 0
    rd = RunDir(ns.run_dir)
    if not rd.exists():
        return
    line = rd.check_versions(
        installed(),
        attempt=ns.attempt,
        restoring=bool(committed),
        allow_change=ns.allow_version_change,
        write=primary,
    )
    if line:
        print(f"warning: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    from olmo_ctl.trainer import multihost

    multihost.prefix_output(os.environ.get(multihost.LOG_PREFIX_ENV, ""))
    try:
        code = _main(ns)
        multihost.exit_alone(code)  # one failing host of several: exit now, as the others can notice
        return code
    finally:
        multihost.drain_output()


def _eval_main(ns: argparse.Namespace) -> int:
    """An eval job (`--eval SPEC`): the slice's processes (one per host, joined as training joins
    them) evaluate SPEC's checkpoint on every device, each host reading only its own devices' shards,
    and process 0 writes `<run-dir>/result.json`. Exit codes as training's (`exits.exit_code_of`): 0
    written, 2 bad input, 1 an error proven deterministic, 3 restartable (storage, a runtime error, a
    host that could not join)."""
    from olmo_ctl.trainer import multihost
    from olmo_ctl.trainer.exits import exit_code_of

    def evaluate() -> int:
        target, _ = _target_and_plan(ns)
        _prepare_env(target)
        import json

        from olmo_ctl.checkpoints.evaluate import EvalSpec, run_job
        from olmo_ctl.core.errors import BadInput
        from olmo_ctl.core.recipe import RuntimeConfig

        spec = EvalSpec.from_json(ns.eval_spec)
        if target is not None and target.slices > 1:
            raise BadInput(
                f"an eval job runs on one slice, and {target.name} x {target.slices} is several",
                "one slice: --device v5p-8, v5p-16, tpu7x-8, ...",
            )
        if target is not None:
            multihost.join(target.device, RuntimeConfig())  # one process per host, before any jax call
        import jax

        # The spec as it was sent: the command that sent it recognises its result by it.
        record = run_job(
            spec, ns.run_dir, jax.devices(), sent=json.loads(ns.eval_spec), log=lambda m: print(m, flush=True)
        )
        d = record["devices"]
        if jax.process_index() == 0:
            print(
                f"eval: wrote {ns.run_dir.rstrip('/')}/result.json ({d['count']} {d['kind']} devices)",
                flush=True,
            )
        return 0

    return exit_code_of(evaluate)  # main() ends a failing host of several at once (exit_alone)


def _main(ns: argparse.Namespace) -> int:
    if ns.eval_spec is not None:
        return _eval_main(ns)
    from olmo_ctl.core.contracts import EXIT_RESTART
    from olmo_ctl.core.errors import OlmoCtlError
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.trainer import multihost

    try:
        target, plan = _target_and_plan(ns)
        _prepare_env(target)
        from olmo_ctl.trainer.train import TrainArgs, load_run_recipe, main_run

        args = TrainArgs(
            run_dir=ns.run_dir,
            recipe=ns.recipe,
            target=target,
            plan=plan,
            attempt=ns.attempt,
            stop_at_step=ns.stop_at_step,
            overrides=list(ns.overrides),
            allow_data_change=ns.allow_data_change,
            init_from=ns.init_from,
        )
        recipe = load_run_recipe(args)
        _gpu_determinism(target, recipe.model)  # before the first jax call brings the backend up
        from olmo_ctl.trainer import deadlines

        # Every storage client of this process, from the first listing on and before the first Orbax
        # call (tensorstore and gcsfs read it then): set here, once.
        deadlines.apply(recipe.runtime.storage_timeout_s)
        committed = RunDir(ns.run_dir).committed_steps()  # listed once: the join and the version check
        if target is not None:
            # Several hosts join before any other jax call (the TPU slice's VMs, or cpu-PxD's processes),
            # and tell the runtime's stop agreement at once where this attempt starts.
            multihost.join(
                target.device,
                recipe.runtime,
                committed=max(committed, default=0),
                slices=target.slices,  # multislice: one world of every slice's hosts
            )
        _check_versions(ns, committed)
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        return EXIT_RESTART if e.exit_code == EXIT_RESTART else 2
    code = main_run(dataclasses.replace(args, loaded_recipe=recipe))
    _journal_exit(ns, code, None if target is None else target.name)
    return code


def _journal_exit(ns: argparse.Namespace, code: int, device: str | None) -> None:
    """Process 0 of an olmo-ctl attempt (one the run's journal records as submitted) journals how it
    exited, so the attempt's end is recorded when no supervisor watches it (a detached supervisor,
    `submit`). A storage hiccup here must not change the exit code."""
    from olmo_ctl.core.contracts import EXITED_EVENT, exit_state, stop_unsaved_note
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.trainer import hooks, multihost

    try:
        if multihost.joined() and sys.modules["jax"].process_index() != 0:
            return
        rd = RunDir(ns.run_dir)
        if not any(r.get("event") == "submitted" and r.get("attempt") == ns.attempt for r in rd.journal()):
            return  # not an attempt of olmo-ctl's (a trainer started by hand): its run has no journal to keep
        unsaved = hooks.STOP_UNSAVED
        extra: dict[str, Any] = {"stop_unsaved": unsaved} if unsaved else {}
        note = stop_unsaved_note(unsaved)
        rd.append(
            EXITED_EVENT,
            attempt=ns.attempt,
            device=device,
            reason=exit_state(code)[1] + (f"; {note}" if note else ""),
            committed_step=rd.committed_step(),
            exit_code=code,
            **extra,
        )
    except Exception as e:  # noqa: BLE001 - storage errors come in many types
        print(f"warning: could not journal this attempt's exit ({type(e).__name__}: {e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
