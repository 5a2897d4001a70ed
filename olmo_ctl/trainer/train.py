"""The training loop: restore or initialise, train jitted sharded steps, checkpoint, log, exit cleanly.

Step semantics (docs/CONTRACTS.md): checkpoint `<N>` holds the state after N completed steps; the
next step run is step N+1, and every metric logged at step N describes the N-th step.

Everything that decides step k is a function of the checkpointed state: parameters, Adam moments and
count, the skip-step window, the step counter (the LR is a function of it) and the data-loader state
(JSON in the checkpoint's `meta` item). There is no running host RNG: parameter init uses the recipe
seed, and any per-step key is `fold_in(seed key, step)`. A resumed run therefore replays the
uninterrupted run bit for bit.

Metrics stay on device: each step returns a small dict of scalars that is kept (stacked) and fetched
every `logging.metrics_every` steps, at checkpoints and at exit, so no step waits on the host.

SIGTERM (preemption, `olmo-ctl resize`, the supervisor) sets a flag; the loop finishes the step it is
in, checkpoints it, waits for the write to commit, uploads events and exits 143. On several hosts,
JAX's preemption service makes every host agree on that step (`trainer/multihost.py`), so a SIGTERM
to any one host stops them all after the same step with one checkpoint.

Each host times its steps (data wait, compute) per logging window; process 0 writes every host's
figures as `hosts/<h>/...` scalars, which `monitor` reads to name a slow host. A hang watchdog
(`trainer/watchdog.py`) ends a host that stops making progress with exit 3, from the data set-up on.

The step itself (pure, jitted; also compiled by preflight) is in `trainer/step.py`. Here: `_setup`
(recipe, device, plan, mesh), `_restore_or_init` (the state and loader position) and `_Loop` (a step,
the fetch of its metrics, and the hooks of `trainer/hooks.py` around them: evaluation, stop checks,
checkpoints, metrics and MFU, per-host timings, event uploads, in that file's order). Where else:
the device (`trainer/device.py`), `--init-from` (`trainer/checkpoint.py`), the exit code of each
failure (`trainer/exits.py`), the fault knobs (`core/faults.py`, applied by `hooks.FaultHook`).
Epoch orders are stored under `<run-dir>/data_order/` (see `trainer/epoch_order.py`), so a restart
reads its rows instead of recomputing the permutation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.core.batching import Plan
from olmo_ctl.core.contracts import committed_line
from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.storage import join
from olmo_ctl.trainer import audit
from olmo_ctl.trainer import hooks as hooks_lib
from olmo_ctl.trainer.exits import TrainingFailed, exit_code_of
from olmo_ctl.trainer.step import (  # noqa: F401 - IGNORE_INDEX, init_state, make_train_step, token_losses: re-exported
    IGNORE_INDEX,
    abstract_train_state,
    device_batch,
    fresh_state,
    init_state,
    jit_train_step,
    make_train_step,
    micro_batch_sharding,
    token_losses,
)

ORDER_DIR = "data_order"  # <run-dir>/data_order/<fingerprint digest>-e<epoch>/: see trainer/epoch_order.py


@dataclass
class TrainArgs:
    run_dir: str
    recipe: str | None = None
    target: Target | None = None  # None: what this machine shows (trainer/device.py)
    plan: Plan | None = None  # the attempt's plan (`--plan`); None: made here for the target
    attempt: int = 0
    stop_at_step: int | None = None
    overrides: list[str] = field(default_factory=list)
    allow_data_change: bool = False
    init_from: str | None = None
    loaded_recipe: Recipe | None = None  # the recipe, when the entry point has already loaded it


# ---------------------------------------------------------------- recipe


def load_run_recipe(args: TrainArgs) -> Recipe:
    """`--recipe` (file, name or gs:// URL) or the `recipe:` section of `<run-dir>/run.yaml`."""
    import yaml

    from olmo_ctl.core.recipe import load_recipe, recipe_from_dict
    from olmo_ctl.rundir import run_recipe
    from olmo_ctl.storage import is_gcs, join, store_for

    if args.loaded_recipe is not None:
        return args.loaded_recipe
    if args.recipe and is_gcs(args.recipe):
        text = store_for(args.recipe).read_text(args.recipe)
        return recipe_from_dict(yaml.safe_load(text), args.recipe, args.overrides)
    if args.recipe:
        return load_recipe(args.recipe, overrides=args.overrides)
    from olmo_ctl.rundir import RunDir

    path = join(args.run_dir, "run.yaml")
    rd = RunDir(args.run_dir)
    if not rd.exists():
        raise BadInput(
            f"no --recipe given and `{path}` does not exist",
            "pass --recipe FILE|NAME or submit the run first",
        )
    return run_recipe(rd.read_run(), path, args.overrides)  # garbage in run.yaml: one line, exit 2


# ---------------------------------------------------------------- the loop


@dataclass
class _Setup:
    """What a run is: the recipe on this device and mesh, this process's place, the last step to run."""

    recipe: Recipe
    device: Any
    plan: Any
    mesh: Any
    final_step: int
    proc: int
    n_proc: int
    local_devices: int


def _setup(args: TrainArgs) -> _Setup:
    import jax

    from olmo_ctl.core import batching
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.device import detect_target

    recipe = load_run_recipe(args)
    target = detect_target(args.target)
    device = target.device
    if args.plan is None:  # started by hand: the plan of the recipe on what this machine is
        plan = batching.make_plan(recipe, device, target.slices)
    else:  # the attempt's own, made once by olmo-ctl; refused when it is not this recipe's
        plan = args.plan
        batching.check_plan(plan, recipe)
    t = recipe.train
    final_step = t.max_steps if args.stop_at_step is None else min(args.stop_at_step, t.max_steps)
    if args.stop_at_step is not None and args.stop_at_step < 0:
        raise BadInput("--stop-at-step must be >= 0")
    kind, replicas = batching.mesh_layout(recipe, device.devices)  # FSDP groups of the slice
    mesh = sharding.make_mesh(jax.devices(), kind, replicas, slices=target.slices, seq_shards=plan.seq_shards)
    return _Setup(
        recipe,
        device,
        plan,
        mesh,
        final_step,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
    )


def _restore_or_init(args: TrainArgs, s: _Setup, ckpt, loader, faults: hooks_lib.FaultHook):
    """The train state (and loader position) of the latest committed checkpoint, or a fresh one.

    The state is built into its abstract shapes and shardings, so nothing is ever materialised
    unsharded. Returns (state, its shardings, the step it is at).
    """
    import jax

    from olmo_ctl.trainer import optim
    from olmo_ctl.trainer.checkpoint import load_init_params, storage_bytes_read

    recipe, t = s.recipe, s.recipe.train
    abstract_state, state_shard = abstract_train_state(recipe, s.mesh)
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract_state)
        if meta.get("data") is not None:
            note = loader.restore(meta["data"], allow_data_change=args.allow_data_change)
            if note:
                print(f"warning: {note}", flush=True)
            faults.post_restore(loader)
        print(f"restored checkpoint {latest} from {ckpt.directory}", flush=True)
    else:
        params = None
        if args.init_from:
            read0 = storage_bytes_read()
            params = load_init_params(args.init_from, abstract_state["params"], state_shard["params"])
            mib = (storage_bytes_read() - read0) / 2**20
            print(
                f"initialised parameters from {args.init_from} ({mib:.1f} MiB read by this host)", flush=True
            )
        state = fresh_state(recipe, state_shard, params)
        print(
            f"initialised from seed {t.seed}" if not args.init_from else "fresh optimizer state", flush=True
        )
    try:
        optim.check_fp32_state(state["params"], optim.AdamState(**state["opt"]), recipe.model.param_dtype)
    except optim.OptimizerDtypeError as e:
        raise TrainingFailed(str(e), "the Adam moments must be float32; check model.param_dtype") from None
    step = int(jax.device_get(state["step"]))
    if latest is not None and step != latest:
        raise TrainingFailed(f"checkpoint {latest} holds step {step}: the checkpoint is inconsistent")
    return state, state_shard, step


class _Loop:
    """Steps and the fetch of their metrics; everything else is a hook (`trainer/hooks.py`), in its order."""

    def __init__(self, s: _Setup, state, state_shard, step: int, loader, ckpt, events, hooks, watchdog):
        from olmo_ctl.trainer import multihost

        self.s, self.state, self.step = s, state, step
        self.loader, self.ckpt, self.events = loader, ckpt, events
        self.watchdog = watchdog  # started by run(), which closes it after the last commit
        self.micro_shard = micro_batch_sharding(s.mesh)
        self.train_step = multihost.first_call_together(jit_train_step(s.recipe, state_shard))
        self.hooks = hooks  # hooks_lib.default_hooks: the order they act in
        self.pending: list[tuple[int, Any, float]] = []  # (step, device metrics, data loading s), not fetched
        self.steps_run = 0  # steps run by this attempt
        self.windows = 0  # windows fetched by this attempt (the first one holds the compile)
        self.exit_code: int | None = None  # set by StopHook: the loop ends after this step's hooks
        self.t_start = self.t_last = time.monotonic()

    def train_one(self) -> None:
        from olmo_ctl.trainer.watchdog import storage_phase_s

        t0 = time.monotonic()
        hooks_lib.pre_batch(self.hooks, self)  # counted as the step's data loading
        s = self.s
        first = self.steps_run == 0  # its batch reads the epoch order; its dispatch compiles the step
        with self.watchdog.first_batch(first, storage_phase_s(s.recipe.runtime)):
            batch = device_batch(
                self.loader.next(), s.recipe, s.plan, s.mesh, s.local_devices, self.micro_shard
            )
        load_s = time.monotonic() - t0
        with self.watchdog.first_dispatch(first):
            self.state, m = self.train_step(self.state, batch)
        self.step += 1
        self.pending.append((self.step, m, load_s))
        self.steps_run += 1
        self.watchdog.beat(self.step, waiting_for=len(self.pending))

    def flush(self, gather: bool = True) -> None:
        """Fetch the pending metrics in one transfer and hand the window to the hooks (`gather=False`:
        the exception path, where no collective may run)."""
        import jax

        if not self.pending:
            return
        items = list(self.pending)
        self.pending.clear()  # a step is logged once, even when a non-finite loss stops us
        self.watchdog.beat(items[0][0] - 1, waiting_for=len(items))
        host = jax.device_get([m for _, m, _ in items])
        now = time.monotonic()
        step_time = (now - self.t_last) / len(items)
        self.t_last = now
        w = hooks_lib.Window(
            [(st, m, ld) for (st, _, ld), m in zip(items, host, strict=True)],
            step_time,
            now - self.t_start,
            time.time(),
            self.windows + 1,
            self.steps_run,
            gather,
        )
        self.windows += 1
        if self.windows > 1:  # the first window of an attempt holds the compile
            self.watchdog.step_times(step_time, len(items))
        self.watchdog.beat(items[-1][0])
        hooks_lib.window(self.hooks, self, w)

    def run(self) -> int:
        s = self.s
        hooks_lib.pre_train(self.hooks, self)
        self.t_start = self.t_last = time.monotonic()
        print(
            f"training steps {self.step + 1}..{s.final_step} of {s.recipe.train.max_steps} on {s.device.name}: "
            f"per-device batch {s.plan.per_device_batch} x {s.plan.grad_accum} accumulation",
            flush=True,
        )
        ok = False
        try:
            code = self._train()
            ok = True
            return code
        finally:
            hooks_lib.post_train(self.hooks, self, ok, getattr(self.loader, "close", lambda: None))

    def _train(self) -> int:
        while self.step < self.s.final_step:
            code = hooks_lib.pre_step(self.hooks, self)
            if code is not None:
                return code
            self.train_one()
            code = hooks_lib.post_step(self.hooks, self)
            if code is not None:
                return code
        self.flush()
        return 0


def run(args: TrainArgs) -> int:
    """Restore or initialise, train to the final step (or a signal), checkpoint; the exit code."""
    from olmo_ctl.trainer import data as data_lib
    from olmo_ctl.trainer.checkpoint import Checkpointer
    from olmo_ctl.trainer.metrics import EventLog
    from olmo_ctl.trainer.watchdog import Watchdog, storage_phase_s

    signals = hooks_lib.StopSignals()
    signals.install()
    s = _setup(args)
    faults = hooks_lib.FaultHook(s.proc)
    rt = s.recipe.runtime
    watchdog, phase_s = Watchdog(rt.watchdog_factor, rt.watchdog_min_s).start(), storage_phase_s(rt)
    try:
        setup = [time.time()]
        with watchdog.judged("the data set-up", phase_s):  # the packing is stored in the run directory too
            batches = data_lib.make_train_loader(
                s.recipe, s.proc, s.n_proc, join(args.run_dir, ORDER_DIR), watchdog.progress
            )
        setup.append(time.time())
        loader = audit.recorded(faults.wrap_loader(batches), args.run_dir, args.attempt, s.proc, s.n_proc)
        with watchdog.judged("the checkpoint listing", phase_s):
            ckpt = Checkpointer.for_recipe(args.run_dir, s.recipe)
        events = EventLog(args.run_dir, attempt=args.attempt)
        faults.pre_restore()
        restore = [time.time()]
        with watchdog.judged("restore", phase_s):
            state, state_shard, step = _restore_or_init(args, s, ckpt, loader, faults)
        if s.proc == 0:  # the start-up's parts, for goodput (observe/goodput.py)
            events.startup(step, setup, [*restore, time.time()])
        loader.first_step = step + 1  # the data-coverage record numbers the steps from here
        if step >= s.final_step:
            print(committed_line(step), flush=True)
            with watchdog.judged("a checkpoint write", phase_s):
                ckpt.close()
            return 0
        hooks = hooks_lib.default_hooks(s, signals, args.run_dir, faults, args.attempt)
        loop = _Loop(s, state, state_shard, step, loader, ckpt, events, hooks, watchdog)
        exit_code = loop.run()
        # The step this attempt ends on, committed; a stop with no time for its write ends on the
        # previous checkpoint (hooks.CheckpointHook._no_time_to_write).
        print(committed_line(getattr(loop, "committed_at_stop", loop.step)), flush=True)
        return exit_code
    finally:
        watchdog.close()


def main_run(args: TrainArgs) -> int:
    """`run(args)` and its exit code by cause (trainer/exits.py): 0, 143, 1, 2 or 3."""
    return exit_code_of(lambda: run(args))
