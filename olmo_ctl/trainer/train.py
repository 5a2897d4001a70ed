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
(`trainer/watchdog.py`) ends a host that stops making progress with exit 3.

The step itself (pure, jitted; also compiled by preflight) is in `trainer/step.py`. Here: `_setup`
(recipe, device, plan, mesh), `_restore_or_init` (the state and loader position), `_MetricLog`
(device metrics fetched in batches and logged) and `_Loop` (one step, then its hooks: evaluate,
checkpoint, flush, upload). Epoch orders are stored under `<run-dir>/data_order/` (see
`trainer/epoch_order.py`), so a restart reads its rows instead of recomputing the permutation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from olmo_ctl.core import stragglers
from olmo_ctl.core.contracts import (
    EXIT_FAILED,
    EXIT_RESTART,
    EXIT_SIGTERM,
    USER_EXIT_CODES,
    committed_line,
    step_line,
)
from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.storage import join
from olmo_ctl.trainer.step import (  # noqa: F401 - IGNORE_INDEX, init_state, token_losses: re-exported
    IGNORE_INDEX,
    abstract_train_state,
    fresh_state,
    init_state,
    jit_train_step,
    make_eval_step,
    make_train_step,
    micro_batch_sharding,
    token_losses,
)

# Fault injection for tests only: shift the restored data position by +-N batches to prove that the
# resume A/B check detects a data/parameter off-by-one. Never set it in a real run.
TEST_DATA_SHIFT_ENV = "OLMO_CTL_TEST_DATA_SHIFT"
# Fault injection for tests and demos: `H:MS` makes host H's data loading MS milliseconds slower per step.
SLOW_DATA_ENV = "OLMO_CTL_FAULT_SLOW_DATA"
ORDER_DIR = "data_order"  # <run-dir>/data_order/<fingerprint digest>-e<epoch>/: see trainer/epoch_order.py


@dataclass
class TrainArgs:
    run_dir: str
    recipe: str | None = None
    device: str | None = None
    slices: int = 1  # slices of `device` (multislice: N x the device's processes and devices)
    attempt: int = 0
    stop_at_step: int | None = None
    overrides: list[str] = field(default_factory=list)
    allow_data_change: bool = False
    init_from: str | None = None
    loaded_recipe: Recipe | None = None  # the recipe, when the entry point has already loaded it


class TrainingFailed(OlmoCtlError):
    """Deterministic failure in training (NaN loss, ...): restarting would fail again. Exit 1."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, exit_code=1)


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
        raise BadInput(f"no --recipe given and `{path}` does not exist",
                       "pass --recipe FILE|NAME or submit the run first")
    return run_recipe(rd.read_run(), path, args.overrides)  # garbage in run.yaml: one line, exit 2


# ---------------------------------------------------------------- the loop


class _Stop:
    """SIGTERM/SIGINT set a flag; the loop checks it between steps. On several hosts SIGTERM belongs
    to JAX's preemption service instead, and `requested(step)` is the step every host agreed on."""

    def __init__(self):
        self.signal: int | None = None
        self.hosts = False

    def install(self) -> None:
        from olmo_ctl.trainer import multihost

        self.hosts = multihost.joined()
        for sig in (signal.SIGINT,) if self.hosts else (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def requested(self, step: int) -> bool:
        """Called once per step, after it, on every host."""
        if self.hosts:
            from olmo_ctl.trainer import multihost

            if multihost.stop_agreed(step):
                print(f"stop requested: every host stops after step {step}", flush=True)
                self.signal = self.signal or signal.SIGTERM
                return True
        return self.signal is not None

    def _handler(self, signum, frame) -> None:
        if self.signal is None:
            print(f"received signal {signum}: finishing the current step, then checkpointing", flush=True)
        self.signal = signum


def _device_for(args: TrainArgs):
    import jax

    from olmo_ctl.core.devices import get_device

    if args.device:
        dev = get_device(args.device)
    else:
        acc = os.environ.get("TPU_ACCELERATOR_TYPE")
        platform = jax.default_backend()
        if platform == "tpu" and acc:
            dev = get_device(acc)
        elif platform == "tpu":
            raise BadInput("cannot tell the TPU slice type", "pass --device, e.g. --device v5p-256")
        else:
            dev = get_device(f"{platform}-{jax.device_count()}")
    n = args.slices
    what = dev.name if n == 1 else f"{n} x {dev.name}"
    if dev.devices * n != jax.device_count():
        raise BadInput(f"--device {what} has {dev.devices * n} devices but JAX sees {jax.device_count()}",
                       f"run with the matching device (e.g. cpu-{jax.device_count()})")
    if dev.processes * n != jax.process_count():
        raise BadInput(f"--device {what} runs {dev.processes * n} processes but JAX joined {jax.process_count()}",
                       "start every host of the slice with the same --device (and --slices)")
    return dev


def _micro_layout(x: np.ndarray, local_devices: int, accum: int) -> np.ndarray:
    """[rows, ...] (this process's rows, contiguous per device) -> [accum, rows/accum, ...].

    Micro-batch m takes rows m*b..(m+1)*b-1 of every device's share, so each device's part of each
    micro-batch is data it already holds: accumulation moves no data between devices.
    """
    rows = x.shape[0]
    b = rows // (local_devices * accum)
    y = x.reshape(local_devices, accum, b, *x.shape[1:])
    return np.ascontiguousarray(np.swapaxes(y, 0, 1)).reshape(accum, local_devices * b, *x.shape[1:])


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

    recipe = load_run_recipe(args)
    device = _device_for(args)
    plan = batching.make_plan(recipe, device, args.slices)
    t = recipe.train
    final_step = t.max_steps if args.stop_at_step is None else min(args.stop_at_step, t.max_steps)
    if args.stop_at_step is not None and args.stop_at_step < 0:
        raise BadInput("--stop-at-step must be >= 0")
    mesh = sharding.make_mesh(jax.devices(), t.mesh, t.data_parallel, slices=args.slices,
                              seq_shards=plan.seq_shards)
    return _Setup(recipe, device, plan, mesh, final_step, jax.process_index(), jax.process_count(),
                  jax.local_device_count())


def _restore_or_init(args: TrainArgs, s: _Setup, ckpt, loader):
    """The train state (and loader position) of the latest committed checkpoint, or a fresh one.

    The state is built into its abstract shapes and shardings, so nothing is ever materialised
    unsharded. Returns (state, its shardings, the step it is at).
    """
    import jax

    from olmo_ctl.trainer import optim

    recipe, t = s.recipe, s.recipe.train
    abstract_state, state_shard = abstract_train_state(recipe, s.mesh)
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract_state)
        if meta.get("data") is not None:
            note = loader.restore(meta["data"], allow_data_change=args.allow_data_change)
            if note:
                print(f"warning: {note}", flush=True)
            shift = int(os.environ.get(TEST_DATA_SHIFT_ENV, "0") or 0)
            if shift:
                _inject_data_shift(loader, shift)
        print(f"restored checkpoint {latest} from {ckpt.directory}", flush=True)
    else:
        params = None
        if args.init_from:
            params = _load_init_params(args.init_from, abstract_state["params"], state_shard["params"])
            print(f"initialised parameters from {args.init_from}", flush=True)
        state = fresh_state(recipe, state_shard, params)
        print(f"initialised from seed {t.seed}" if not args.init_from else "fresh optimizer state", flush=True)
    try:
        optim.check_fp32_state(state["params"], optim.AdamState(**state["opt"]), recipe.model.param_dtype)
    except optim.OptimizerDtypeError as e:
        raise TrainingFailed(str(e), "the Adam moments must be float32; check model.param_dtype") from None
    step = int(jax.device_get(state["step"]))
    if latest is not None and step != latest:
        raise TrainingFailed(f"checkpoint {latest} holds step {step}: the checkpoint is inconsistent")
    return state, state_shard, step


class _MetricLog:
    """Device metrics of finished steps, kept until `flush()` fetches them in one transfer, checks the
    loss is finite, and logs each step (TensorBoard scalars on process 0, one line on stdout)."""

    def __init__(self, s: _Setup, events, watchdog=None):
        from olmo_ctl.core import flops

        self.s, self.events, self.watchdog = s, events, watchdog
        self.fpt = flops.flops_per_token_olmo_core(s.recipe.model, s.recipe.train.seq_len)
        self.pending: list[tuple[int, dict, float]] = []  # (step, device metrics, data loading s)
        self.steps = 0  # steps run by this attempt
        self.windows = 0  # windows fetched by this attempt (the first one holds the compile)
        self.host_windows: dict[int, list[dict]] = {}  # process 0: every host's recent windows
        self.named: set[tuple[int, str]] = set()  # slow hosts already logged by this attempt
        self.t_start = self.t_last = time.monotonic()

    def start_clock(self) -> None:
        self.t_start = self.t_last = time.monotonic()

    def add(self, step: int, metrics: dict, load_s: float) -> None:
        self.pending.append((step, metrics, load_s))
        self.steps += 1

    def flush(self) -> None:
        import jax

        if not self.pending:
            return
        items = list(self.pending)
        self.pending.clear()  # a step is logged once, even when a non-finite loss stops us below
        if self.watchdog:
            self.watchdog.beat(items[0][0] - 1, waiting_for=len(items))
        host = jax.device_get([m for _, m, _ in items])
        now = time.monotonic()
        step_time = (now - self.t_last) / len(items)
        self.t_last = now
        elapsed = now - self.t_start
        wall = time.time()
        self.windows += 1
        if self.watchdog:
            if self.windows > 1:  # the first window of an attempt holds the compile
                self.watchdog.step_times(step_time, len(items))
            self.watchdog.beat(items[-1][0])
        if self.windows > 1:  # the first window holds the compile (and host 0's epoch order): no timing
            self._host_timings(items[-1][0], step_time, sum(ld for _, _, ld in items) / len(items), wall)
        for (step, _, load_s), m in zip(items, host, strict=True):
            self._log(step, m, load_s, step_time, elapsed, wall)

    def _host_timings(self, step: int, step_time: float, data_wait: float, wall: float) -> None:
        """Every host's window: step time, data wait and compute (the rest), as `hosts/<h>/...` scalars."""
        from olmo_ctl.trainer import multihost

        mine = [step_time, data_wait, max(0.0, step_time - data_wait)]
        rows = multihost.allgather_floats(mine) if self.s.n_proc > 1 else [mine]
        if self.s.proc != 0:
            return
        values = {}
        for h, (st, dw, comp) in enumerate(rows):
            values.update({f"hosts/{h}/step_time_s": st, f"hosts/{h}/data_wait_s": dw, f"hosts/{h}/compute_s": comp})
            self.host_windows.setdefault(h, []).append({"data_wait_s": dw, "compute_s": comp})
            del self.host_windows[h][:-stragglers.RECENT]
        self.events.scalars(step, values, wall)
        for slow in stragglers.slow_hosts(self.host_windows):
            if (slow.host, slow.part) not in self.named:  # once per host and part per attempt
                self.named.add((slow.host, slow.part))
                print(stragglers.slow_host_line(slow), flush=True)

    def _log(self, step: int, m: dict, load_s: float, step_time: float, elapsed: float, wall: float) -> None:
        from olmo_ctl.core import flops

        s, tokens_per_step = self.s, self.s.recipe.tokens_per_step
        ce, grad_norm = float(m["ce"]), float(m["grad_norm"])
        if not math.isfinite(ce) or not math.isfinite(grad_norm):
            raise TrainingFailed(f"loss is not finite at step {step} (CE {ce}, grad norm {grad_norm})",
                                 "lower the learning rate or check the data; restarting would fail again")
        tps = tokens_per_step / step_time / s.plan.devices  # every slice's devices
        tps_avg = tokens_per_step * self.steps / max(elapsed, 1e-9) / s.plan.devices
        mfu = flops.mfu(flops.tflops_per_device(tps, self.fpt), s.device)
        mfu_avg = flops.mfu(flops.tflops_per_device(tps_avg, self.fpt), s.device)
        lr = float(m["lr"])
        values = {
            "train/CE loss": ce, "train/PPL": math.exp(min(ce, 80.0)), "train/Z loss": float(m["z"]),
            "optim/total grad norm": grad_norm, "optim/LR (group 0)": lr,
            "optim/LR (group 1)": lr, "optim/step skipped": float(m["skipped"]),
            "optim/step_skipped": float(m["skipped"]), "throughput/total tokens": float(step * tokens_per_step),
            "perf/total_tokens": float(step * tokens_per_step), "throughput/device/TPS": tps,
            "throughput/device/TPS (actual avg)": tps_avg, "throughput/device/MFU": mfu,
            "throughput/device/MFU (actual avg)": mfu_avg, "throughput/device/data loading (s)": load_s,
            "perf/step_time_s": step_time,
        }
        if s.proc == 0:
            self.events.scalars(step, values, wall)
            print(step_line(step, s.recipe.train.max_steps, ce, grad_norm, lr, tps, mfu, bool(m["skipped"])),
                  flush=True)


def _device_batch(batch: dict, s: _Setup, micro_shard) -> dict:
    """This process's rows of a global batch as global device arrays `[accum, micro_global, T]`."""
    import jax

    accum, t = s.plan.grad_accum, s.recipe.train
    rows_per_proc = s.local_devices // s.plan.seq_shards  # devices of one row share it over its seq shards
    local = {k: _micro_layout(np.asarray(batch[k], np.int32), rows_per_proc, accum)
             for k in ("input_ids", "labels", "segment_ids") if k in batch}
    if s.recipe.data.ngram_filter:
        local["instance_mask"] = _micro_layout(np.asarray(batch["instance_mask"], np.int32)[:, None],
                                               rows_per_proc, accum)
    from olmo_ctl.trainer.step import micro_row_sharding

    return {k: jax.make_array_from_process_local_data(micro_row_sharding(s.mesh) if k == "instance_mask" else micro_shard,
                                                      v, (accum, t.global_batch // accum, v.shape[-1]))
            for k, v in local.items()}


class _Loop:
    """The training loop and its hooks: evaluate, checkpoint, flush metrics, upload events."""

    def __init__(self, s: _Setup, state, state_shard, step: int, loader, ckpt, events, stop: _Stop):
        import jax

        from olmo_ctl.trainer import data as data_lib
        from olmo_ctl.trainer.watchdog import Watchdog

        self.s, self.state, self.step = s, state, step
        self.loader, self.ckpt, self.events, self.stop = loader, ckpt, events, stop
        rt = s.recipe.runtime
        self.watchdog = Watchdog(rt.watchdog_factor, rt.watchdog_min_s)
        self.metrics = _MetricLog(s, events, self.watchdog)
        self.slow_data_s = _slow_data_s(s.proc)
        self.micro_shard = micro_batch_sharding(s.mesh)
        self.train_step = jit_train_step(s.recipe, state_shard)
        self.eval_step = jax.jit(make_eval_step(s.recipe))
        self.eval_sets = _eval_batches(s.recipe, data_lib, s.mesh, s.proc, s.n_proc)

    def meta(self) -> dict:
        r = self.s.recipe
        return {"data": self.loader.state(), "data_fingerprint": self.loader.fingerprint, "seed": r.train.seed,
                "recipe": r.name, "recipe_fingerprint": r.fingerprint(), "step": self.step}

    def upload_events(self) -> None:
        """A storage hiccup must not end a week-long run: the records stay pending for the next upload."""
        if self.s.proc != 0:
            return
        try:
            self.events.upload()
        except Exception as e:  # noqa: BLE001 - storage errors come in many types (requests, api_core, OSError)
            print(f"warning: event upload to {self.events.dir} failed ({e}); retrying at the next upload", flush=True)

    def save(self, final: bool) -> None:
        self.metrics.flush()  # a non-finite loss stops here, before it is checkpointed
        with self.watchdog.paused():
            secs = self.ckpt.save(self.step, self.state, self.meta())
            if final:
                self.ckpt.wait()
        if self.s.proc == 0:
            self.events.scalars(self.step, {"checkpoint/save_duration_s": secs})
        self.upload_events()

    def train_one(self) -> None:
        from olmo_ctl.trainer.watchdog import maybe_hang

        maybe_hang(self.step + 1, self.s.proc)
        t0 = time.monotonic()
        if self.slow_data_s:
            time.sleep(self.slow_data_s)
        batch = _device_batch(self.loader.next(), self.s, self.micro_shard)
        load_s = time.monotonic() - t0
        self.state, m = self.train_step(self.state, batch)
        self.step += 1
        self.metrics.add(self.step, m, load_s)
        self.watchdog.beat(self.step, waiting_for=len(self.metrics.pending))

    def evaluate(self) -> None:
        self.metrics.flush()
        with self.watchdog.paused():
            loss = _evaluate(self.eval_step, self.state["params"], self.eval_sets)
        if self.s.proc == 0:
            self.events.scalars(self.step, {"eval/lm_loss": loss})
        print(f"eval step {self.step} lm_loss {loss:.4f}", flush=True)

    def after_step(self) -> int | None:
        """The hooks after each step, in order; an exit code ends the loop."""
        r = self.s.recipe
        if self.eval_sets and self.step % r.eval.interval == 0:
            self.evaluate()
        if self.step >= self.s.final_step:
            self.save(final=True)
            return 0
        if self.stop.requested(self.step):
            self.save(final=True)
            return EXIT_SIGTERM
        if self.step % r.checkpoint.interval == 0:
            self.save(final=False)
        elif len(self.metrics.pending) >= r.logging.metrics_every:
            self.metrics.flush()
        if self.events.due(r.logging.upload_every_s):
            self.upload_events()
        return None

    def run(self) -> int:
        s = self.s
        if s.proc == 0:
            self.events.session_start(self.step + 1)  # readers drop what an earlier attempt logged from here on
        self.metrics.start_clock()
        self.watchdog.start()
        print(f"training steps {self.step + 1}..{s.final_step} of {s.recipe.train.max_steps} on {s.device.name}: "
              f"per-device batch {s.plan.per_device_batch} x {s.plan.grad_accum} accumulation", flush=True)
        try:
            while self.step < s.final_step:
                if not self.stop.hosts and self.stop.signal is not None and self.metrics.steps == 0:
                    return EXIT_SIGTERM  # nothing new since the restored (or initial) state
                self.train_one()
                code = self.after_step()
                if code is not None:
                    return code
            self.metrics.flush()
            return 0
        finally:
            self.watchdog.close()
            try:
                self.ckpt.close()  # waits for an async save in flight
            finally:
                try:
                    self.metrics.flush()
                finally:
                    self.upload_events()
                    _close_loader(self.loader)


def run(args: TrainArgs) -> int:
    """Restore or initialise, train to the final step (or a signal), checkpoint; the exit code."""
    from olmo_ctl.trainer import data as data_lib
    from olmo_ctl.trainer.checkpoint import Checkpointer
    from olmo_ctl.trainer.metrics import EventLog

    stop = _Stop()
    stop.install()
    s = _setup(args)
    # Epoch orders are stored in the run directory: later attempts and other hosts read their rows of it.
    loader = data_lib.make_train_loader(s.recipe, s.proc, s.n_proc, order_dir=join(args.run_dir, ORDER_DIR))
    ckpt = Checkpointer.for_run(args.run_dir, keep=s.recipe.checkpoint.keep, async_save=s.recipe.checkpoint.async_save)
    events = EventLog(args.run_dir, attempt=args.attempt)
    state, state_shard, step = _restore_or_init(args, s, ckpt, loader)
    if step >= s.final_step:
        print(committed_line(step), flush=True)
        ckpt.close()
        return 0
    loop = _Loop(s, state, state_shard, step, loader, ckpt, events, stop)
    exit_code = loop.run()
    print(committed_line(loop.step), flush=True)
    return exit_code


def _slow_data_s(proc: int) -> float:
    """The slow-host fault knob (OLMO_CTL_FAULT_SLOW_DATA=H:MS): seconds added to host H's data loading."""
    host, _, ms = os.environ.get(SLOW_DATA_ENV, "").partition(":")
    if host.isdigit() and int(host) == proc and ms.replace(".", "", 1).isdigit():
        print(f"FAULT INJECTION: data loading on host {proc} slowed by {ms} ms per step ({SLOW_DATA_ENV})", flush=True)
        return float(ms) / 1000.0
    return 0.0


def _close_loader(loader) -> None:
    close = getattr(loader, "close", None)
    if close:
        close()


def _inject_data_shift(loader, shift: int) -> None:
    """Test-only fault injection (OLMO_CTL_TEST_DATA_SHIFT): resume the data `shift` batches off."""
    state = dict(loader.state())
    state["batch_in_epoch"] = max(0, int(state["batch_in_epoch"]) + shift)
    state["batches_seen"] = max(0, int(state["batches_seen"]) + shift)
    loader.restore(state)
    print(f"FAULT INJECTION: data resumed {shift:+d} batch(es) off ({TEST_DATA_SHIFT_ENV})", flush=True)


def _eval_batches(recipe: Recipe, data_lib, mesh, proc: int, n_proc: int):
    """The held-out batches, identical every time (device arrays, reused at each eval)."""
    import jax

    from olmo_ctl.trainer import sharding

    if recipe.eval.batches <= 0 or not recipe.data.eval:
        return []
    bs = recipe.eval.batch_size or recipe.train.global_batch
    shard = sharding.batch_sharding(mesh)
    out = []
    for b in data_lib.eval_batches(recipe, recipe.eval.batches, bs, proc, n_proc):
        out.append({k: jax.make_array_from_process_local_data(
            shard, np.asarray(b[k], np.int32), (bs, recipe.train.seq_len)) for k in ("input_ids", "labels")})
    return out


def _evaluate(eval_step, params, eval_sets) -> float:
    import jax

    parts = [eval_step(params, b) for b in eval_sets]
    host = jax.device_get(parts)
    ce = sum(float(c) for c, _ in host)
    n = sum(float(k) for _, k in host)
    return ce / max(n, 1.0)


def _load_init_params(path: str, abstract_params, p_shard):
    """Parameters from a converted checkpoint: an Orbax step dir (`.../<N>` with a `state` item holding
    `params`) or a plain Orbax PyTree directory (of `params`, or of a dict with `params`)."""
    import jax
    import orbax.checkpoint as ocp

    from olmo_ctl.storage import is_gcs
    from olmo_ctl.trainer.checkpoint import open_step

    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, p_shard)
    name = path.rstrip("/").rpartition("/")[2]
    if name.isdigit():
        ck, step = open_step(path)
        tree, _ = ck.restore_host(step)
        params = tree["params"] if "params" in tree else tree
        _check_same_tree(params, abstract_params, path)
        return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x).astype(s.dtype), s.sharding), params, target)
    p = path if is_gcs(path) else os.path.abspath(path)
    meta = ocp.StandardCheckpointer().metadata(p)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if isinstance(tree, dict) and "params" in tree:
        _check_same_tree(tree["params"], abstract_params, path)
        full = {"params": target}
        out = ocp.StandardCheckpointer().restore(p, _partial_target(tree, full))
        return out["params"]
    _check_same_tree(tree, abstract_params, path)
    return ocp.StandardCheckpointer().restore(p, target)


def _partial_target(tree, full):
    import jax

    out = {}
    for k, v in tree.items():
        if k in full:
            out[k] = full[k]
        else:
            out[k] = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), v)
    return out


def _check_same_tree(tree, abstract_params, path: str) -> None:
    import jax

    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(abstract_params)}
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise BadInput(f"`{path}` does not hold parameters of this recipe's model (differences: {diff})",
                       "convert the checkpoint for the same model configuration")


def replace_args(args: TrainArgs, **kw) -> TrainArgs:
    return dataclasses.replace(args, **kw)


def _is_transient_io_error(e: BaseException) -> bool:
    """Storage or network trouble, or a lost peer (retrying the attempt may succeed): named as such."""
    from olmo_ctl.core.errors import Unreachable

    for exc in (e, e.__cause__, e.__context__):
        if exc is None:
            continue
        if isinstance(exc, Unreachable | ConnectionError | TimeoutError):
            return True
        name = type(exc).__name__
        if any(w in name for w in ("Connect", "Timeout", "ServiceUnavailable", "TooManyRequests",
                                    "InternalServerError", "GatewayTimeout", "DeadlineExceeded")):
            return True
        if "RuntimeError" in name and _PEER_LOST.search(str(exc)):
            return True
    return False


# A multi-host runtime error that means another host (or the coordination service) went away: a
# preempted or failed peer, not a bug here.
_PEER_LOST = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED)\b|coordination service|heartbeat|"
                        r"barrier timed out|connection reset|socket closed|task .* (?:failed|disconnected)",
                        re.IGNORECASE)


def main_run(args: TrainArgs) -> int:
    """Run and map errors to exit codes by cause: 0 done, 143 stopped by SIGTERM after checkpointing,
    1 a failure proven deterministic (non-finite loss, optimizer dtype, an inconsistent checkpoint:
    restarting would fail again), 2 bad input, 3 everything else (storage, network, a lost peer, a
    runtime error nobody has proven deterministic): the attempt is restarted, and the supervisor's
    crash-loop rule stops a run that exits 3 at the same step again and again."""
    try:
        return run(args)
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        if e.exit_code == EXIT_RESTART:
            return EXIT_RESTART
        return e.exit_code if e.exit_code in USER_EXIT_CODES else EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - every other error: restartable by rule (errors by cause)
        import traceback

        from olmo_ctl.storage import describe_permission_error

        denied = describe_permission_error(e)
        if denied is not None:  # GCS said no: the same identity would be refused again
            sys.stderr.write(f"error: {denied.one_line()}\n")
            return denied.exit_code

        traceback.print_exc()
        what = ("storage, network or a peer host unreachable" if _is_transient_io_error(e)
                else "an unexpected runtime error, not proven deterministic")
        sys.stderr.write(f"error: {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "exit 3: the attempt can be restarted\n")
        return EXIT_RESTART
