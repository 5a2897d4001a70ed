"""Orbax checkpoints of a run: `<run-dir>/checkpoints/<step>/` on a local path or gs://.

Step semantics: checkpoint `<N>` holds the state after N completed steps (parameters, Adam moments
and count, skip-step window, step counter) plus a JSON `meta` item (data-loader state, dataset
fingerprint, seed). The next step to run after restoring `<N>` is step N+1.

Each checkpoint is an Orbax `Composite(state=StandardSave, meta=JsonSave)` written by a
`CheckpointManager`; only committed steps count: a step directory that holds Orbax's commit marker
(`rundir.committed_steps_in`, the one rule everywhere), so neither a kill during a write nor a step
directory copied by hand and cut off midway yields a step that a restart would restore. Saves may be asynchronous: `wait()` before the process exits.

Upload throttling (`upload_hosts` K > 0, OLMo-core's `throttle_uploads`): the hosts write their
array shards in rounds of K by process index, each round after the previous one has finished writing
(`UploadRounds`); the commit that follows is Orbax's own, with every host.

`load_init_params` (`--init-from`) reads the parameters of a converted checkpoint into a run that has
none yet: only the parameters, each process only its own shards.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from olmo_ctl import storage
from olmo_ctl.core.errors import OlmoCtlError
from olmo_ctl.storage import is_gcs, join


def emulator_env_defaults() -> None:
    """With a GCS emulator (STORAGE_EMULATOR_HOST), point every client Orbax uses at it: tensorstore
    (arrays) would otherwise retry real GCS, and gcsfs (metadata) would probe for cloud credentials,
    which stalls off Google Cloud. Call before orbax/fsspec are imported (fsspec reads env at import)."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return
    for k, v in (
        ("TENSORSTORE_GCS_HTTP_URL", emulator),
        ("FSSPEC_GCS_TOKEN", "anon"),
        ("NO_GCE_CHECK", "true"),
        ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false"),
        ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "dummy"),
    ):
        os.environ.setdefault(k, v)


def checkpoints_dir(run_dir: str) -> str:
    return join(run_dir, "checkpoints")


def _path(p: str) -> str:
    return p if is_gcs(p) else os.path.abspath(p)


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


class Checkpointer:
    """The run's CheckpointManager with the two items every checkpoint holds.

    Tiered (`permanent_every` > 0, the recipe's `checkpoint.interval` when it also has an
    `ephemeral_interval`): a checkpoint whose step is a multiple of `permanent_every` when it is saved
    is permanent (the newest `keep` of them stay; 0 keeps all), any other is ephemeral. The class is
    fixed at the save (`meta["permanent"]`), so an amended interval never turns a permanent
    checkpoint into an ephemeral one (`saved_permanent`). Orbax then deletes nothing
    itself: `prune` deletes what a newer committed checkpoint makes redundant (every ephemeral one but
    the newest checkpoint, and the permanent ones beyond `keep`), and runs only when no save is in
    flight (before the next save starts, and at close), so a checkpoint is deleted only after a later
    one has committed. A kill anywhere in between leaves the newer checkpoint, the older one, or both.
    """

    def __init__(
        self,
        directory: str,
        keep: int = 0,
        async_save: bool = True,
        read_only: bool = False,
        permanent_every: int = 0,
        upload_hosts: int = 0,
        past_intervals: tuple[int, ...] = (),
    ):
        ocp = _ocp()
        self.directory = _path(directory)
        self.keep, self.permanent_every, self._read_only = keep, permanent_every, read_only
        # The permanent intervals the run had before (an amended `checkpoint.interval`): a checkpoint
        # saved before its class was recorded is permanent when it is a multiple of any of them.
        self.past_intervals = tuple(i for i in past_intervals if i and i > 0)
        self._permanent: dict[int, bool] = {}  # step -> its class as saved (read once per process)
        if not read_only:
            self.set_aside_uncommitted()
        # Throttled only when it holds some host back: one process, or K >= hosts, is Orbax's own handler.
        self._rounds = None if read_only else UploadRounds.for_world(upload_hosts)
        writes_async = async_save and not read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=(keep or None) if not permanent_every else None,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            # When an async write has committed: how long the whole write took (`last_write_s`).
            # Orbax takes the callback only where it writes asynchronously.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_committed)
            if writes_async
            else None,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler()
                if self._rounds is None
                else _throttled_state_handler(self._rounds),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self.last_save_s = 0.0
        # Seconds the last committed write took, from its start to its commit (0: none yet); what a
        # stop weighs against the time it has left (hooks.CheckpointHook).
        self.last_write_s = 0.0
        self._write_started: float | None = None
        self._async = writes_async

    def _write_committed(self) -> None:
        if self._write_started is not None:
            self.last_write_s = time.monotonic() - self._write_started

    @classmethod
    def for_run(
        cls,
        run_dir: str,
        keep: int = 0,
        async_save: bool = True,
        permanent_every: int = 0,
        upload_hosts: int = 0,
    ) -> Checkpointer:
        return cls(
            checkpoints_dir(run_dir),
            keep,
            async_save,
            permanent_every=permanent_every,
            upload_hosts=upload_hosts,
        )

    @classmethod
    def for_recipe(cls, run_dir: str, recipe) -> Checkpointer:
        """The run's manager as its recipe's `checkpoint` section says (tiered when it has ephemeral
        ones, throttled when it has `upload_hosts`)."""
        c = recipe.checkpoint
        return cls(
            checkpoints_dir(run_dir),
            c.keep,
            c.async_save,
            permanent_every=c.interval if c.ephemeral_interval else 0,
            upload_hosts=c.upload_hosts,
            past_intervals=past_intervals(run_dir),
        )

    def set_aside_uncommitted(self) -> list[str]:
        """Move each local step directory without a commit marker (`rundir.uncommitted_step_dirs`: a
        copy cut off midway) out of the checkpoints, to `checkpoints.uncommitted/<N>-<time>` beside
        them: it is never restored, and Orbax would refuse to save that step again. Nothing is deleted.
        Every process may call it; the one whose rename wins moves it. The new paths."""
        from olmo_ctl.rundir import uncommitted_step_dirs

        moved = []
        for step in uncommitted_step_dirs(self.directory):
            aside = self.directory.rstrip("/") + ".uncommitted"
            dst = os.path.join(aside, f"{step}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            try:
                os.makedirs(aside, exist_ok=True)
                os.rename(os.path.join(self.directory, str(step)), dst)
            except FileNotFoundError:  # another process of this attempt moved it first
                continue
            except OSError as e:
                raise OlmoCtlError(
                    f"checkpoint step directory `{os.path.join(self.directory, str(step))}` has no commit"
                    f" marker and could not be moved aside ({e})",
                    "move it out of the checkpoints directory by hand; it is not a committed checkpoint",
                    exit_code=3,
                ) from None
            print(
                f"warning: `{os.path.join(self.directory, str(step))}` has no commit marker (a copy cut off"
                f" midway?): not a checkpoint; moved to `{dst}`",
                flush=True,
            )
            moved.append(dst)
        if moved and hasattr(self, "_mngr"):
            self._mngr.reload()
        return moved

    def saved_permanent(self, step: int) -> bool:
        """Whether committed checkpoint `step` is permanent (`rundir.saved_permanent`: the class it was
        saved with), read once per process."""
        from olmo_ctl.rundir import saved_permanent

        if step not in self._permanent:
            intervals = (self.permanent_every, *self.past_intervals)
            self._permanent[step] = saved_permanent(self.directory, step, intervals)
        return self._permanent[step]

    def prune(self, at_step: int) -> list[int]:
        """Delete the committed checkpoints a newer committed one made redundant (tiered only:
        `redundant_steps`); the steps deleted. Every process calls it at the same point (Orbax's delete
        is collective), with no save in flight; `at_step` is the step about to be saved (or the last)."""
        from olmo_ctl.trainer import injected

        doomed = redundant_steps(
            self.committed_steps(), self.permanent_every, self.keep, self.saved_permanent
        )
        for i, step in enumerate(doomed):
            injected.kill_in_prune(at_step, i)  # tests only: a kill before the i-th deletion
            self._mngr.delete(step)
        if doomed:
            injected.kill_in_prune(at_step, len(doomed))
        return doomed

    def committed_steps(self) -> list[int]:
        """The committed steps (`rundir.committed_steps_in`: the one rule everywhere)."""
        from olmo_ctl.rundir import committed_steps_in

        self._mngr.reload()
        return committed_steps_in(self.directory)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict) -> float:
        """Start saving `state` (after `step` completed steps); returns the blocking seconds spent."""
        ocp = _ocp()
        t0 = time.monotonic()
        self._write_started = t0
        if self.permanent_every:
            self._mngr.wait_until_finished()  # the previous save committed (save() would wait too) ...
            self.prune(step)  # ... so what it made redundant goes, before this one starts
            # The class is fixed now: a later `checkpoint.interval` never reclassifies it.
            meta = {**meta, "permanent": step % self.permanent_every == 0}
            self._permanent[step] = meta["permanent"]
        if self._rounds is not None:
            self._rounds.step = step  # read by the array handler within save(), on this thread
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self.last_save_s = time.monotonic() - t0
        if not self._async:
            self.last_write_s = self.last_save_s  # a synchronous save has committed on return
        return self.last_save_s

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into the shapes, dtypes and shardings of `abstract_state` (ShapeDtypeStructs)."""
        ocp = _ocp()
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"] or {})

    def restore_host(self, step: int) -> tuple[Any, dict]:
        """Restore onto the first local device without knowing the model (surgery, souping, tests)."""
        import jax

        meta_tree = self._mngr.item_metadata(step)["state"]
        tree = meta_tree.tree if hasattr(meta_tree, "tree") else meta_tree
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        abstract = _tree_map_meta(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), tree)
        return self.restore(step, abstract)

    def close(self) -> None:
        self._mngr.wait_until_finished()
        if self.permanent_every and not self._read_only:
            steps = self.committed_steps()
            if steps:
                self.prune(steps[-1])
        self._mngr.close()


# ---------------------------------------------------------------- upload throttling


class UploadRounds:
    """Which hosts write their shards when: host `i` of `hosts` writes in round `i // per_round`, and a
    round starts once every host of the previous one has finished writing.

    Each host runs the same `rounds - 1` barriers of the coordination service, in the same order, from
    a background commit thread of its own (`_Turn.drive`): after round r's barrier, round r+1's hosts write.
    A barrier's name carries the step and a per-process save count, so no name is used twice.
    """

    def __init__(self, per_round: int, host: int, hosts: int):
        self.per_round, self.host, self.hosts = per_round, host, hosts
        self.rounds = -(-hosts // per_round)
        self.round = host // per_round
        self.step = 0  # the step being saved (set by Checkpointer.save)
        self._saves = 0

    @classmethod
    def for_world(cls, upload_hosts: int) -> UploadRounds | None:
        """This process's rounds, or None when throttling would hold no host back (K = 0, K >= hosts,
        or one process: then the distributed client is never touched)."""
        if upload_hosts <= 0:
            return None
        import jax

        if jax.process_count() <= upload_hosts:
            return None
        return cls(upload_hosts, jax.process_index(), jax.process_count())

    def turn(self) -> _Turn:
        """This host's turn in the save now starting (called once per save, on the saving thread)."""
        self._saves += 1
        return _Turn(self, f"checkpoint-upload/{self.step}/{self._saves}")


class _Turn:
    """One save's turn: `wait` (the shard writes) returns once this host's round has come; `drive` (a
    commit future of its own) runs the rounds' barriers and opens the gate when the round comes."""

    def __init__(self, rounds: UploadRounds, name: str):
        self.rounds, self.name, self.step = rounds, name, rounds.step
        self.gated: list = []  # the ParamInfos whose directory waits for this turn
        self._opener: int | None = None  # the thread resolving the directories, which never waits
        self._open = threading.Event()

    async def wait(self) -> None:
        if threading.get_ident() != self._opener:
            await asyncio.to_thread(self._open.wait)

    async def _open_gate(self) -> None:
        # Several commit threads share the ParamInfos, and a ParamInfo resolves its directory without a
        # lock (check, then replace): resolve them all here, while the writers wait on the gate, so none
        # of them replaces a directory that another is about to read.
        self._opener = threading.get_ident()
        try:
            for info in self.gated:
                await info.await_path_creation()
        finally:
            self._open.set()

    async def drive(self, writes: list) -> None:
        from orbax.checkpoint import multihost as ocp_multihost

        from olmo_ctl.trainer import multihost

        r = self.rounds
        timeout_s = float(ocp_multihost.coordination_timeout())
        failed: BaseException | None = None
        try:
            for k in range(r.rounds):
                if k == r.round:
                    t0 = time.time()
                    try:
                        await self._open_gate()
                        for f in writes:
                            await asyncio.to_thread(f.result)
                    except BaseException as e:  # noqa: BLE001 - raised after the barriers, which others wait on
                        failed = e
                    print(
                        f"checkpoint {self.step}: host {r.host} wrote shards in round {k} "
                        f"({t0:.3f}..{time.time():.3f})",
                        flush=True,
                    )
                if k < r.rounds - 1:  # after the last round Orbax's own commit barrier follows
                    await asyncio.to_thread(multihost.barrier, f"{self.name}/round-{k}", timeout_s)
        finally:
            self._open.set()  # never leave a write waiting on a gate nobody opens
        if failed is not None:
            raise failed


class _AfterTurn:
    """A shard directory (Orbax's `PathAwaitingCreation` protocol) that this host may write into once
    its round has come: every array write awaits it before it opens its tensorstore."""

    def __init__(self, parent, turn: _Turn):
        self._parent, self._turn = parent, turn

    def __truediv__(self, other) -> _AfterTurn:
        return _AfterTurn(self._parent / other, self._turn)

    @property
    def path(self):
        return getattr(self._parent, "path", self._parent) if _awaiting(self._parent) else self._parent

    async def await_creation(self):
        await self._turn.wait()
        return await self._parent.await_creation() if _awaiting(self._parent) else self._parent


def _awaiting(p) -> bool:
    from orbax.checkpoint._src.path.types import PathAwaitingCreation

    return isinstance(p, PathAwaitingCreation)


def _throttled_state_handler(rounds: UploadRounds):
    """Orbax's StandardCheckpointHandler whose jax.Array shards are written in this host's round.

    The hook is the array type handler: its `serialize` copies the shards to host memory at once (the
    blocking part of an async save, as before) and returns the futures of the writes, which each start
    by awaiting their directory; that directory is an `_AfterTurn`, and one more future drives the
    rounds. Restore, the on-disk format and the handler's name in the checkpoint are Orbax's own.
    Written against Orbax 0.12.8 (`ParamInfo._parent_dir`, `StandardCheckpointHandler._impl`)."""
    ocp = _ocp()
    import jax
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.metadata import array_metadata_store

    class ThrottledArrayHandler(ocp.type_handlers.ArrayHandler):  # type: ignore[name-defined]
        async def serialize(self, values, infos, args=None):
            turn = rounds.turn()
            # `_parent_dir`: `parent_dir` refuses to return a directory still being created
            gated = [
                i.replace(
                    parent_dir=_AfterTurn(i._parent_dir, turn), path=_AfterTurn(i._parent_dir, turn) / i.name
                )
                for i in infos
            ]
            turn.gated = gated
            writes = list(await super().serialize(values, gated, args))
            drive = future.CommitFutureAwaitingContractedSignals(turn.drive(writes), name="upload_rounds")
            return [*writes, drive]

    registry = ocp.type_handlers.create_type_handler_registry(
        *[(ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types()]
    )
    # as Orbax's default jax.Array handler, with the same typestr ("jax.Array") in the metadata
    registry.add(
        jax.Array,
        ThrottledArrayHandler(array_metadata_store=array_metadata_store.Store()),
        override=True,
        ignore_warnings=True,
    )

    # Orbax's own class (its StandardSave/StandardRestore args are registered to exactly that class, and
    # its name goes into the checkpoint), over a PyTree handler as its own with the registry above.
    handler = ocp.StandardCheckpointHandler()
    handler._impl = ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=96, restore_concurrent_gb=96, type_handler_registry=registry
    )
    return handler


def redundant_steps(
    steps: list[int], permanent_every: int, keep: int, is_permanent: Callable[[int], bool] | None = None
) -> list[int]:
    """Of the committed `steps`, those a tiered run deletes: every one but the newest that is not
    permanent (ephemeral), and the permanent ones older than the newest `keep` of them (0 keeps all).
    A step is permanent as `is_permanent` says (the class it was saved with: `saved_permanent`), else
    when it is a multiple of `permanent_every`. The newest checkpoint is never one of them. Nothing
    when not tiered."""
    if not permanent_every or not steps:
        return []
    steps = sorted(steps)
    permanent = [s for s in steps if (is_permanent(s) if is_permanent else s % permanent_every == 0)]
    kept = set(permanent[-keep:] if keep else permanent) | {steps[-1]}
    return [s for s in steps if s not in kept]


def past_intervals(run_dir: str) -> tuple[int, ...]:
    """Every `checkpoint.interval` the run at `run_dir` had (`rundir.checkpoint_intervals` of its
    run.yaml); () where there is none to read (a trainer run on a bare directory)."""
    from olmo_ctl.rundir import RunDir, checkpoint_intervals

    try:
        return checkpoint_intervals(RunDir(run_dir).read_run())
    except OlmoCtlError:
        return ()


def _tree_map_meta(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map_meta(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_tree_map_meta(fn, v) for v in tree)
    return fn(tree)


def split_step_dir(path: str) -> tuple[str, int]:
    """`<...>/checkpoints/<N>` -> (`<...>/checkpoints`, N); a BadInput if it is not a step directory."""
    from olmo_ctl.core.errors import BadInput

    p = path.rstrip("/")
    parent, _, name = p.rpartition("/")
    if not name.isdigit() or not parent:
        raise BadInput(f"`{path}` is not a checkpoint step directory", "pass <run-dir>/checkpoints/<step>")
    return parent, int(name)


def open_step(path: str) -> tuple[Checkpointer, int]:
    """A read-only manager on the checkpoint step directory `path`, checked to be committed."""
    from olmo_ctl.core.errors import BadInput

    parent, step = split_step_dir(path)
    store = storage.store_for(parent)
    if not any(store.list(parent)):  # no checkpoints directory at all: not a run's checkpoint
        raise BadInput(
            f"`{path}` does not exist", "pass a committed checkpoint: <run-dir>/checkpoints/<step>"
        )
    ckpt = Checkpointer(parent, read_only=True, async_save=False)
    if step not in ckpt.committed_steps():
        raise BadInput(
            f"`{path}` is not a committed checkpoint", f"committed steps: {ckpt.committed_steps()}"
        )
    return ckpt, step


# ---------------------------------------------------------------- --init-from: a converted checkpoint

# The largest stored chunk of a parameter array the converter writes. A host reads whole chunks, so
# with one chunk per array every host would read every array whole; 64 MiB chunks keep a host's
# reads near its own shards (a stacked 7B MLP matrix of 5.4 GiB is ~86 chunks) without many small requests.
INIT_CHUNK_BYTES = 64 * 2**20


def load_init_params(path: str, abstract_params, p_shard, run_step: bool | None = None):
    """Parameters from a converted checkpoint (`--init-from`), placed in the shardings `p_shard`: an Orbax
    step dir (`.../<N>` with a `state` item holding `params`) or a plain Orbax PyTree directory (of
    `params`, or of a dict with `params`). A BadInput when it holds another model's parameters.

    Only the parameters are read (an Orbax partial restore of the `params` subtree: not the Adam
    moments or anything else beside them), straight into their shardings: each process reads the
    parts of each array its own devices hold, never a whole copy. `run_step`: whether `path` is a
    run's step directory (None: a path whose last part is a number is one).
    """
    import jax

    ocp = _ocp()
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, p_shard
    )
    if run_step is None:
        run_step = path.rstrip("/").rpartition("/")[2].isdigit()
    if run_step:
        ck, step = open_step(path)
        item_dir = join(ck.directory, str(step), "state")
    else:
        item_dir = _path(path)
    tree = _tree_metadata(item_dir)
    nested = isinstance(tree, dict) and "params" in tree
    _check_same_tree(tree["params"] if nested else tree, abstract_params, path)
    item = {"params": target} if nested else target
    out = ocp.PyTreeCheckpointer().restore(
        item_dir,
        args=ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=nested,
        ),
    )
    return out["params"] if nested else out


def _tree_metadata(item_dir: str):
    """The saved tree of an Orbax PyTree directory (shapes and dtypes, nothing read)."""
    meta = _ocp().PyTreeCheckpointer().metadata(item_dir)
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def storage_bytes_read() -> int:
    """Bytes tensorstore (Orbax's array reads) has read from storage in this process, all drivers."""
    import tensorstore as ts

    return sum(
        int(v.get("value", 0))
        for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
        if m["name"].endswith("/bytes_read")
        for v in m.get("values", [])
    )


def _check_same_tree(tree, abstract_params, path: str) -> None:
    import jax

    from olmo_ctl.core.errors import BadInput

    want = {
        jax.tree_util.keystr(k): tuple(v.shape)
        for k, v in jax.tree_util.tree_leaves_with_path(abstract_params)
    }
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise BadInput(
            f"`{path}` does not hold parameters of this recipe's model (differences: {diff})",
            "convert the checkpoint for the same model configuration",
        )
