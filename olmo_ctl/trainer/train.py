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
in, checkpoints it, waits for the write to commit, uploads events and exits 143.
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

import numpy as np

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

IGNORE_INDEX = -100
# Fault injection for tests only: shift the restored data position by +-N batches to prove that the
# resume A/B check detects a data/parameter off-by-one. Never set it in a real run.
TEST_DATA_SHIFT_ENV = "OLMO_CTL_TEST_DATA_SHIFT"


@dataclass
class TrainArgs:
    run_dir: str
    recipe: str | None = None
    device: str | None = None
    attempt: int = 0
    stop_at_step: int | None = None
    overrides: list[str] = field(default_factory=list)
    allow_data_change: bool = False
    init_from: str | None = None


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
    from olmo_ctl.storage import NotFound, is_gcs, join, store_for

    if args.recipe and is_gcs(args.recipe):
        text = store_for(args.recipe).read_text(args.recipe)
        return recipe_from_dict(yaml.safe_load(text), args.recipe, args.overrides)
    if args.recipe:
        return load_recipe(args.recipe, overrides=args.overrides)
    path = join(args.run_dir, "run.yaml")
    try:
        run = yaml.safe_load(store_for(path).read_text(path))
    except NotFound:
        raise BadInput(f"no --recipe given and `{path}` does not exist",
                       "pass --recipe FILE|NAME or submit the run first") from None
    return run_recipe(run, path, args.overrides)


# ---------------------------------------------------------------- the step (pure, jitted)


def token_losses(params, input_ids, labels, cfg):
    """(CE sum, z-loss sum, token count) over non-ignored labels; fp32, real vocab only."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import forward

    logits = forward(params, input_ids, cfg)[..., : cfg.vocab_size]  # drop padded rows: never predicted
    lse = jax.nn.logsumexp(logits, axis=-1)
    mask = labels != IGNORE_INDEX
    target = jnp.take_along_axis(logits, jnp.where(mask, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(mask, lse - target, 0.0))
    z = jnp.sum(jnp.where(mask, lse * lse, 0.0))
    return ce, z, jnp.sum(mask).astype(jnp.float32)


def make_train_step(recipe: Recipe):
    """state, batch {input_ids, labels: [accum, micro_global, T]} -> state, metrics (device scalars)."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer import optim

    cfg, z_coef = recipe.model, recipe.optimizer.z_loss

    def step(state, batch):
        params = state["params"]
        # One denominator for the whole global batch, so accumulation over micro-batches is exact.
        n_tokens = jnp.sum(batch["labels"] != IGNORE_INDEX).astype(jnp.float32)
        if "instance_mask" in batch:
            # Instances the n-gram repetition filter masked still count in the denominator (as in
            # OLMo-core): each would have contributed seq_len - 1 labelled tokens.
            filtered = jnp.sum(1 - batch["instance_mask"]).astype(jnp.float32)
            n_tokens = n_tokens + filtered * (batch["labels"].shape[-1] - 1)
        n_tokens = jnp.maximum(n_tokens, 1.0)

        def micro_loss(p, ids, labels):
            ce, z, _ = token_losses(p, ids, labels, cfg)
            return (ce + z_coef * z) / n_tokens, (ce, z)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def body(carry, mb):
            g_acc, ce_acc, z_acc = carry
            (_, (ce, z)), g = grad_fn(params, mb["input_ids"], mb["labels"])
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return (g_acc, ce_acc + ce, z_acc + z), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        micro = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        (grads, ce_sum, z_sum), _ = jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0)), micro)
        ce_loss, z_loss = ce_sum / n_tokens, z_sum / n_tokens
        adam = optim.AdamState(**state["opt"])
        window = optim.SkipWindow(**state["skip"])
        step_number = state["step"] + 1  # this is the (step+1)-th step; it produces checkpoint step+1
        params, adam, window, info = optim.optimizer_step(params, grads, adam, window, ce_loss, step_number, recipe)
        new_state = {"step": step_number, "params": params, "opt": adam._asdict(), "skip": window._asdict()}
        metrics = {"ce": ce_loss, "z": z_coef * z_loss, "grad_norm": info["grad_norm"], "lr": info["lr"],
                   "skipped": info["skipped"].astype(jnp.float32), "tokens": n_tokens}
        return new_state, metrics

    return step


def make_eval_step(recipe: Recipe):
    def step(params, batch):
        ce, _, n = token_losses(params, batch["input_ids"], batch["labels"], recipe.model)
        return ce, n

    return step


def abstract_train_state(recipe: Recipe, mesh):
    """The train state as sharded `ShapeDtypeStruct`s, and its shardings: FSDP-sharded params and
    Adam moments, everything else replicated. Nothing is allocated (the trainer restores or
    initialises into these; preflight compiles against them)."""
    import jax

    from olmo_ctl.trainer import model, sharding

    abstract_params = jax.eval_shape(lambda k: model.init_params(recipe.model, k), jax.random.PRNGKey(recipe.train.seed))
    p_shard = sharding.param_shardings(abstract_params, mesh)
    rep = sharding.replicated(mesh)
    abstract_state = jax.eval_shape(lambda p: init_state(recipe, p), abstract_params)
    state_shard = {
        "step": rep, "params": p_shard, "opt": {"mu": p_shard, "nu": p_shard, "count": rep},
        "skip": jax.tree.map(lambda _: rep, abstract_state["skip"]),
    }
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_state, state_shard)
    return state, state_shard


def micro_batch_sharding(mesh):
    """[accum, micro-batch, ...]: the accumulation axis replicated, the batch over every device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_ctl.trainer import sharding

    return NamedSharding(mesh, PartitionSpec(None, *sharding.batch_sharding(mesh).spec))


def init_state(recipe: Recipe, params):
    import jax.numpy as jnp

    from olmo_ctl.trainer import optim

    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt": optim.init_adam(params)._asdict(),
        "skip": optim.init_skip_window(recipe.optimizer.skip_step.window)._asdict(),
    }


# ---------------------------------------------------------------- the loop


class _Stop:
    """SIGTERM/SIGINT set a flag; the loop checks it between steps."""

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

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
    if dev.devices != jax.device_count():
        raise BadInput(f"--device {dev.name} has {dev.devices} devices but JAX sees {jax.device_count()}",
                       f"run with the matching device (e.g. cpu-{jax.device_count()})")
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


def run(args: TrainArgs) -> int:
    import jax

    from olmo_ctl.core import batching, flops
    from olmo_ctl.trainer import data as data_lib
    from olmo_ctl.trainer import model, optim, sharding
    from olmo_ctl.trainer.checkpoint import Checkpointer
    from olmo_ctl.trainer.metrics import EventLog

    stop = _Stop()
    stop.install()
    recipe = load_run_recipe(args)
    device = _device_for(args)
    plan = batching.make_plan(recipe, device)
    t, cfg = recipe.train, recipe.model
    final_step = t.max_steps if args.stop_at_step is None else min(args.stop_at_step, t.max_steps)
    if args.stop_at_step is not None and args.stop_at_step < 0:
        raise BadInput("--stop-at-step must be >= 0")

    mesh = sharding.make_mesh(jax.devices(), t.mesh, t.data_parallel)
    n_proc, proc = jax.process_count(), jax.process_index()
    local_devices = jax.local_device_count()

    # ---- data
    loader = data_lib.make_train_loader(recipe, proc, n_proc)
    fingerprint = loader.fingerprint

    # ---- state: abstract shapes and shardings first, so nothing is ever materialised unsharded
    abstract_state, state_shard = abstract_train_state(recipe, mesh)
    p_shard = state_shard["params"]

    ckpt = Checkpointer.for_run(args.run_dir, keep=recipe.checkpoint.keep, async_save=recipe.checkpoint.async_save)
    events = EventLog(args.run_dir, attempt=args.attempt)
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
        if args.init_from:
            params = _load_init_params(args.init_from, abstract_state["params"], p_shard)
            print(f"initialised parameters from {args.init_from}", flush=True)
        else:
            params = jax.jit(lambda k: model.init_params(cfg, k), out_shardings=p_shard)(jax.random.PRNGKey(t.seed))
        state = jax.jit(lambda p: init_state(recipe, p), out_shardings=state_shard)(params)
        print(f"initialised from seed {t.seed}" if not args.init_from else "fresh optimizer state", flush=True)
    try:
        optim.check_fp32_state(state["params"], optim.AdamState(**state["opt"]), cfg.param_dtype)
    except optim.OptimizerDtypeError as e:
        raise TrainingFailed(str(e), "the Adam moments must be float32; check model.param_dtype") from None
    step = int(jax.device_get(state["step"]))
    if latest is not None and step != latest:
        raise TrainingFailed(f"checkpoint {latest} holds step {step}: the checkpoint is inconsistent")

    def meta_now() -> dict:
        return {"data": loader.state(), "data_fingerprint": fingerprint, "seed": t.seed,
                "recipe": recipe.name, "recipe_fingerprint": recipe.fingerprint(), "step": step}

    if step >= final_step:
        print(committed_line(step), flush=True)
        ckpt.close()
        return 0

    # ---- compiled steps
    micro_shard = micro_batch_sharding(mesh)
    train_step = jax.jit(make_train_step(recipe), donate_argnums=(0,), out_shardings=(state_shard, None))
    eval_step = jax.jit(make_eval_step(recipe))
    eval_sets = _eval_batches(recipe, data_lib, mesh, proc, n_proc)

    if proc == 0:
        events.session_start(step + 1)  # readers drop what an earlier attempt logged from here on
    tokens_per_step = recipe.tokens_per_step
    fpt = flops.flops_per_token_olmo_core(cfg, t.seq_len)
    pending: list[tuple[int, dict, float]] = []  # (step, device metrics, data loading s)
    t_start = time.monotonic()
    t_last = t_start
    steps_this_attempt = 0
    print(f"training steps {step + 1}..{final_step} of {t.max_steps} on {device.name}: per-device batch "
          f"{plan.per_device_batch} x {plan.grad_accum} accumulation", flush=True)

    def flush_metrics() -> None:
        nonlocal t_last
        if not pending:
            return
        items = list(pending)
        pending.clear()  # a step is logged once, even when a non-finite loss stops us below
        host = jax.device_get([m for _, m, _ in items])
        now = time.monotonic()
        step_time = (now - t_last) / len(items)
        t_last = now
        elapsed = now - t_start
        wall = time.time()
        for (s, _, load_s), m in zip(items, host, strict=True):
            ce = float(m["ce"])
            if not math.isfinite(ce) or not math.isfinite(float(m["grad_norm"])):
                raise TrainingFailed(f"loss is not finite at step {s} (CE {ce}, grad norm {float(m['grad_norm'])})",
                                     "lower the learning rate or check the data; restarting would fail again")
            tps = tokens_per_step / step_time / device.devices
            tps_avg = tokens_per_step * steps_this_attempt / max(elapsed, 1e-9) / device.devices
            mfu = flops.mfu(flops.tflops_per_device(tps, fpt), device)
            mfu_avg = flops.mfu(flops.tflops_per_device(tps_avg, fpt), device)
            lr = float(m["lr"])
            values = {
                "train/CE loss": ce, "train/PPL": math.exp(min(ce, 80.0)), "train/Z loss": float(m["z"]),
                "optim/total grad norm": float(m["grad_norm"]), "optim/LR (group 0)": lr,
                "optim/LR (group 1)": lr, "optim/step skipped": float(m["skipped"]),
                "optim/step_skipped": float(m["skipped"]), "throughput/total tokens": float(s * tokens_per_step),
                "perf/total_tokens": float(s * tokens_per_step), "throughput/device/TPS": tps,
                "throughput/device/TPS (actual avg)": tps_avg, "throughput/device/MFU": mfu,
                "throughput/device/MFU (actual avg)": mfu_avg, "throughput/device/data loading (s)": load_s,
                "perf/step_time_s": step_time,
            }
            if proc == 0:
                events.scalars(s, values, wall)
            print(step_line(s, t.max_steps, ce, float(m["grad_norm"]), lr, tps, mfu, bool(m["skipped"])), flush=True)

    def upload_events() -> None:
        """A storage hiccup must not end a week-long run: the records stay pending for the next upload."""
        if proc != 0:
            return
        try:
            events.upload()
        except Exception as e:  # noqa: BLE001 - storage errors come in many types (requests, api_core, OSError)
            print(f"warning: event upload to {events.dir} failed ({e}); retrying at the next upload", flush=True)

    def save(final: bool) -> None:
        flush_metrics()  # a non-finite loss stops here, before it is checkpointed
        secs = ckpt.save(step, state, meta_now())
        if final:
            ckpt.wait()
        if proc == 0:
            events.scalars(step, {"checkpoint/save_duration_s": secs})
        upload_events()

    exit_code = 0
    try:
        while step < final_step:
            if stop.signal is not None and steps_this_attempt == 0:
                exit_code = EXIT_SIGTERM  # nothing new since the restored (or initial) state
                break
            t0 = time.monotonic()
            batch = loader.next()
            local = {k: _micro_layout(np.asarray(batch[k], np.int32), local_devices, plan.grad_accum)
                     for k in ("input_ids", "labels")}
            if recipe.data.ngram_filter:
                local["instance_mask"] = _micro_layout(
                    np.asarray(batch["instance_mask"], np.int32)[:, None], local_devices, plan.grad_accum)
            dev_batch = {k: jax.make_array_from_process_local_data(
                micro_shard, v, (plan.grad_accum, t.global_batch // plan.grad_accum, v.shape[-1]))
                for k, v in local.items()}
            load_s = time.monotonic() - t0
            state, m = train_step(state, dev_batch)
            step += 1
            steps_this_attempt += 1
            pending.append((step, m, load_s))

            if eval_sets and step % recipe.eval.interval == 0:
                flush_metrics()
                loss = _evaluate(eval_step, state["params"], eval_sets)
                if proc == 0:
                    events.scalars(step, {"eval/lm_loss": loss})
                print(f"eval step {step} lm_loss {loss:.4f}", flush=True)
            if step >= final_step:
                save(final=True)
                break
            if stop.signal is not None:
                save(final=True)
                exit_code = EXIT_SIGTERM
                break
            if step % recipe.checkpoint.interval == 0:
                save(final=False)
            elif len(pending) >= recipe.logging.metrics_every:
                flush_metrics()
            if events.due(recipe.logging.upload_every_s):
                upload_events()
        else:
            flush_metrics()
    finally:
        try:
            ckpt.close()  # waits for an async save in flight
        finally:
            try:
                flush_metrics()
            finally:
                upload_events()
                _close_loader(loader)
    print(committed_line(step), flush=True)
    return exit_code


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
    """Storage or network trouble (retrying the attempt may succeed), as opposed to a bug."""
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
# preempted or failed peer, not a bug here. Exit 1 would fail the JobSet at once; exit 3 restarts it.
_PEER_LOST = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED)\b|coordination service|heartbeat|"
                        r"barrier timed out|connection reset|socket closed|task .* (?:failed|disconnected)",
                        re.IGNORECASE)


def main_run(args: TrainArgs) -> int:
    """Run and map errors to exit codes: 0, 143 (SIGTERM), 1 deterministic failure, 2 bad input,
    3 storage unreachable (transient: the supervisor retries the attempt; exit 1 it would not)."""
    try:
        return run(args)
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        if e.exit_code == EXIT_RESTART:
            return EXIT_RESTART
        return e.exit_code if e.exit_code in USER_EXIT_CODES else EXIT_FAILED
    except Exception as e:
        if not _is_transient_io_error(e):
            raise  # a bug: traceback and exit 1
        import traceback

        traceback.print_exc()
        sys.stderr.write(f"error: storage or network unreachable ({type(e).__name__}: {e}); the attempt can be retried\n")
        return EXIT_RESTART
