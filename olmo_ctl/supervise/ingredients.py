"""A stage run as ingredients, supervised as one (docs/ingredients.md).

AI2 finished OLMo 2 32B's mid-training with several anneals of one stage-1 checkpoint on different
data orders and mixes ("ingredients"), averaged into the final model (OLMo-core
src/scripts/official/OLMo2/README.md; the OLMo 3 32B release did the same with two). A recipe whose
`ingredients:` lists them is run here as:

  <run-root>/NAME/ingredients.yaml   the run of ingredients: its recipe (with the list), its start,
                                     its device, and the run name of each ingredient
  <run-root>/NAME/journal.jsonl      what happened to it as a whole (`ingredient_done`, `souped`)
  <run-root>/NAME/lease.json         which supervisor drives the whole (`RunDir`'s lease, held for the
                                     whole flow: a second supervisor of it exits 2 naming the first)
  <run-root>/NAME/soup/              the soup of the ingredients' final checkpoints (`surgery soup`'s
                                     output, with soup.json)
  <run-root>/NAME-i1/ ... NAME-iN/   each ingredient: an ordinary run (run.yaml, attempts, checkpoints),
                                     which `monitor`, `logs`, `stop` and `resume-until-done` also take alone

`resume-until-done NAME` supervises the ingredients one after another, or `--concurrent N` at a time
(each exactly as one run is supervised, its own attempts, retries and lease), skipping those whose final
step is committed, and souping them last. Everything it decides is read back from storage, so a second `resume-until-done`
after a Ctrl-C or a SIGKILL goes on where the first stopped and redoes nothing committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol, TypeVar

from olmo_ctl import storage
from olmo_ctl.core.errors import EXIT_INTERRUPTED, BadInput, Interrupted, OlmoCtlError
from olmo_ctl.core.names import MAX_RUN_NAME, validate_run_name
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.rundir import Composite, Lease, LeaseLost, RunDir, ingredient_run

DEFAULT_LEASE_TTL_S = 300.0  # as a run's supervisor's: max(300 s, 6 x --poll)


def check_new(run_root: str, name: str, recipe: Recipe) -> None:
    """A new run of ingredients: its name, and every ingredient's, free (bad input, nothing written)."""
    validate_run_name(name)
    longest = ingredient_run(name, len(recipe.ingredients) - 1)
    if len(longest) > MAX_RUN_NAME:
        raise BadInput(
            f"run name `{name}` is too long for its ingredients' runs (`{longest}`: {len(longest)} characters,"
            f" at most {MAX_RUN_NAME})",
            "choose a shorter run name",
        )
    if RunDir.of(run_root, name).exists():
        raise BadInput(
            f"`{name}` is already a run of one recipe, not of ingredients",
            "choose another run name for the ingredients",
        )
    for k in range(len(recipe.ingredients)):
        rd = RunDir.of(run_root, ingredient_run(name, k))
        if rd.exists():
            raise BadInput(
                f"run `{rd.name}` already exists and is not one of `{name}`'s ingredients",
                "choose another run name, or move that run aside",
            )


def seed_start(rundir: RunDir, start_from: str, log: Callable[[str], None]) -> None:
    """Checkpoint 0 of an ingredient that has none: the start's parameters and Adam moments
    (`surgery warm-adam`), so every ingredient anneals from the same state."""
    if rundir.committed_steps():
        return
    from olmo_ctl.checkpoints.surgery import warm_adam

    res = warm_adam(start_from, rundir.path)
    log(f"{rundir.name}: starts from {start_from} (step {res['source_step']}, Adam moments kept)")


class FlowLease:
    """The lease of a run of ingredients (NAME/lease.json: `RunDir.acquire_lease` on its directory, as a
    run's supervisor holds its run's), held for the whole flow: a second supervisor of the same run of
    ingredients gets `LeaseHeld` (exit 2, naming this one) before it writes anything. A thread renews it
    every `ttl_s / 5` while the ingredients' own supervisors (each holding its run's lease) run; what the
    flow writes in NAME/ is written only while the lease is still its own (LeaseLost, exit 3, else)."""

    def __init__(self, rd: RunDir, ttl_s: float, log: Callable[[str], None]):
        self.rd, self.ttl_s, self.log = rd, ttl_s, log
        self.lease: Lease | None = None
        self.lost: LeaseLost | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FlowLease:
        self.lease = self.rd.acquire_lease(ttl_s=self.ttl_s, say=self.log)
        self._thread = threading.Thread(target=self._renew, name=f"{self.rd.name}-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        every = max(0.5, min(60.0, self.ttl_s / 5))
        while not self._done.wait(every):
            try:
                self.check()
            except LeaseLost as e:
                self.lost = e
                return
            except (OlmoCtlError, OSError):
                continue  # storage unreachable for a while: the next beat tries again

    def check(self) -> None:
        """Renew the lease now; LeaseLost when another supervisor took the run of ingredients over."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            assert self.lease is not None
            self.rd.heartbeat(self.lease)

    def append(self, event: str, **kw) -> None:
        """A journal line in NAME/journal.jsonl, written while the lease is ours."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            self.rd.append(event, fence=self.lease, **kw)

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
        with self._lock:
            if self.lost is None and self.lease is not None:
                self.rd.release_lease(self.lease)


def soup_of(
    composite: Composite, log: Callable[[str], None], append: Callable[..., None] | None = None
) -> dict:
    """The soup of every ingredient's final checkpoint in NAME/soup (once: a whole one is kept).
    `append`: how NAME/journal.jsonl is written (the flow's lease's `append`; default: unfenced)."""
    done = composite.souped()
    if done is not None:
        return done
    sources = []
    for rd in composite.runs():
        final = int(rd.recipe().train.max_steps)
        sources.append(rd.p("checkpoints", str(final)))
    store = storage.store_for(composite.soup_path)
    files, _ = store.list(composite.soup_path, recursive=True)
    for f in files:  # a soup cut short (no soup.json yet) is written again from the start
        store.delete(f.path)
    if not storage.is_gcs(composite.soup_path):
        import shutil

        shutil.rmtree(composite.soup_path, ignore_errors=True)
    from olmo_ctl.checkpoints.soup import soup

    log(f"souping {len(sources)} ingredients into {composite.soup_path}")
    res = soup(sources, composite.soup_path)
    (append or composite.dir.append)(
        "souped", reason=f"mean of {len(sources)} ingredients", out=composite.soup_path
    )
    return composite.souped() or res


class SuperviseOne(Protocol):
    def __call__(
        self,
        run: str,
        recipe: Recipe | None,
        device: str | None,
        slices: int | None,
        log: Callable[[str], None],
        cancel: threading.Event | None = None,
    ) -> int: ...


def supervise(
    composite: Composite,
    recipe: Recipe | None,
    *,
    device: str | None,
    slices: int | None,
    start_from: str | None,
    supervise_one: SuperviseOne,
    log: Callable[[str], None],
    concurrent: int | None = None,
    hint: str | None = None,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> int:
    """Every ingredient to its final step, one after another (or `concurrent` at a time), then the
    soup: 0 when the soup is written; else the exit code of the ingredient's supervision that ended
    early (130 for Ctrl-C or `olmo-ctl stop`, 4 gave up, ...), with the ingredients not started left
    as they are.

    `recipe`: a new run's (with its ingredients), or None to go on with the run of ingredients that
    exists; `supervise_one(run, recipe or None, device, slices, log, cancel)` supervises one ingredient
    as `resume-until-done` supervises one run (a new ingredient on the device the run of ingredients was
    created with; one that exists on its own) and, run beside others, ends as on Ctrl-C once `cancel`
    is set. `concurrent`: how many at once (None: what the run of ingredients was created with, else 1).
    `hint`: the command that continues the whole, for the line a Ctrl-C leaves. The whole is driven
    under the run of ingredients' lease (`FlowLease`, expiring `lease_ttl_s` after its last renewal),
    taken once the arguments are checked and before anything is written: a second supervisor of it
    exits 2 (`LeaseHeld`) naming this one."""
    if concurrent is not None and concurrent < 1:
        raise BadInput(f"--concurrent {concurrent} must be at least 1")
    asked = (recipe, device, slices, start_from)
    try:
        _recipe, _start, _device, _slices, new = _resolve(composite, *asked)  # bad input: nothing written
    except BadInput:
        if not composite.exists():
            raise
        # Created meanwhile by another supervisor (its ingredients are then "taken"): go on as with an
        # existing one, whose lease says who drives it.
        _recipe, _start, _device, _slices, new = _resolve(composite, *asked)
    with FlowLease(composite.dir, lease_ttl_s, log) as lease:
        if new and composite.exists():  # created meanwhile by a supervisor that has ended since
            composite._spec = None
            _recipe, _start, _device, _slices, new = _resolve(composite, *asked)
        if new:
            composite.create(_recipe, _start, _device, _slices, concurrent=concurrent)
            log(
                f"run of ingredients `{composite.name}`: {len(_recipe.ingredients)} runs "
                + ", ".join(ingredient_run(composite.name, k) for k in range(len(_recipe.ingredients)))
                + f", then their soup in {composite.soup_path}"
            )
        return _flow(
            composite, _recipe, _device, _slices, _start, supervise_one, log, concurrent, hint, lease
        )


def _resolve(
    composite: Composite,
    recipe: Recipe | None,
    device: str | None,
    slices: int | None,
    start_from: str | None,
) -> tuple[Recipe, str | None, str | None, int | None, bool]:
    """(recipe, start, device, slices, new) of the run of ingredients: an existing one's own (what the
    command line gives must agree), or a new one's from the command line, checked; writes nothing."""
    if composite.exists():
        have = composite.recipe()
        if recipe is not None and recipe.fingerprint() != have.fingerprint():
            raise BadInput(
                f"run `{composite.name}` is a run of ingredients of another recipe ({have.name})",
                f"continue it with `olmo-ctl resume-until-done {composite.name}`, or choose another run name",
            )
        spec = composite.spec()
        start_from = spec.get("start_from") if start_from is None else start_from
        if device is None:
            device, slices = spec.get("device"), spec.get("slices")
        if start_from != spec.get("start_from"):
            raise BadInput(
                f"--start-from {start_from}: run `{composite.name}` started its ingredients from"
                f" {spec.get('start_from')}",
                "drop --start-from to go on",
            )
        return have, start_from, device, slices, False
    if recipe is None:
        raise BadInput(f"run `{composite.name}` does not exist", "pass --recipe/--stage and --device")
    if device is None:
        raise BadInput(f"a new run of ingredients needs --device (run `{composite.name}`)")
    check_new(composite.run_root, composite.name, recipe)
    if start_from is not None:
        from olmo_ctl.checkpoints.surgery import check_committed

        check_committed(start_from)  # a committed training checkpoint, or bad input now
    return recipe, start_from, device, slices, True


def _flow(
    composite: Composite,
    recipe: Recipe,
    device: str | None,
    slices: int | None,
    start_from: str | None,
    supervise_one: SuperviseOne,
    log: Callable[[str], None],
    concurrent: int | None,
    hint: str | None,
    lease: FlowLease,
) -> int:
    """`supervise` once the run of ingredients exists and its lease is held."""
    if composite.dir.pending_stop() is not None:  # this supervisor was started to go on
        composite.dir.clear_stop()
    width = concurrent if concurrent is not None else int(composite.spec().get("concurrent") or 1)
    todo = []
    for k, rd in enumerate(composite.runs()):
        if rd.exists() and rd.committed_step() >= int(rd.recipe().train.max_steps):
            continue
        todo.append(k)
    n = len(recipe.ingredients)

    def start(k: int) -> tuple[str, Recipe | None, str | None, int | None]:
        lease.check()  # still ours before an ingredient is seeded or started
        rd = composite.runs()[k]
        new = not rd.exists()
        if start_from is not None:
            seed_start(rd, start_from, log)
        log(f"ingredient {k + 1} of {n}: {rd.name}")
        sub = recipe.ingredient_recipe(k) if new else None
        return rd.name, sub, device if new else None, slices if new else None

    def stopped_between(before: str) -> int:
        composite.dir.clear_stop()
        lease.append("stopped", reason="stopped on request (olmo-ctl stop)")
        log(f"run of ingredients `{composite.name}` stopped before {before}")
        return EXIT_INTERRUPTED

    if width <= 1 or len(todo) <= 1:
        for k in todo:
            rd = composite.runs()[k]
            if composite.dir.pending_stop() is not None:  # `olmo-ctl stop NAME` between two ingredients
                return stopped_between(rd.name)
            rc = supervise_one(*start(k), log)
            if rc != 0:
                if composite.dir.pending_stop() is not None:
                    composite.dir.clear_stop()
                    lease.append("stopped", reason=f"stopped on request (olmo-ctl stop) in {rd.name}")
                return rc
            lease.append("ingredient_done", reason=rd.name, committed_step=rd.committed_step())
    else:
        rc = _side_by_side(composite, todo, width, start, supervise_one, log, stopped_between, hint, lease)
        if rc != 0:
            return rc
    lease.check()
    res = soup_of(composite, log, lease.append)
    log(
        f"run of ingredients `{composite.name}` is done: soup of {len(res.get('sources', []))} in {composite.soup_path}"
    )
    return 0


def _side_by_side(
    composite: Composite,
    todo: list[int],
    width: int,
    start: Callable[[int], tuple[str, Recipe | None, str | None, int | None]],
    supervise_one: SuperviseOne,
    log: Callable[[str], None],
    stopped_between: Callable[[str], int],
    hint: str | None,
    lease: FlowLease,
) -> int:
    """`width` ingredients supervised at once, each in its own thread as one run is supervised; the
    next one starts when one finishes. An ingredient that ends otherwise (gave up, a user error, a
    stop) starts no further one; those running go on to their own end, and its exit code is the
    whole's. Ctrl-C (or SIGTERM) detaches every one as a Ctrl-C detaches one run: what each leaves
    running is said, then one `interrupted:` line for the whole."""
    runs = composite.runs()
    cancel = threading.Event()
    queue = list(todo)
    running: dict[Future, int] = {}
    first_failure: int | None = None
    interrupted: list[str] = []

    def one(k: int, args: tuple[str, Recipe | None, str | None, int | None]) -> int:
        run, sub, dev, n = args
        try:
            return supervise_one(run, sub, dev, n, log, cancel)
        except Interrupted as e:
            interrupted.append(f"{runs[k].name}: {e.one_line()}")
            return EXIT_INTERRUPTED
        except OlmoCtlError as e:
            log(f"{runs[k].name}: error: {e.one_line()}")
            return e.exit_code

    pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix=f"{composite.name}-ingredient")
    try:
        while queue or running:
            while queue and len(running) < width and first_failure is None and not cancel.is_set():
                if composite.dir.pending_stop() is not None:
                    first_failure = EXIT_INTERRUPTED
                    if not running:
                        return stopped_between(runs[queue[0]].name)
                    break
                k = queue.pop(0)
                running[pool.submit(one, k, start(k))] = k
            if not running:
                break
            done, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
            for f in done:
                k = running.pop(f)
                rc = f.result()
                if rc == 0:
                    lease.append(
                        "ingredient_done", reason=runs[k].name, committed_step=runs[k].committed_step()
                    )
                    continue
                if (
                    rc != EXIT_INTERRUPTED
                    and (running or queue)
                    and first_failure in (None, EXIT_INTERRUPTED)
                ):
                    going = ", ".join(runs[j].name for j in sorted(running.values()))
                    log(
                        f"{runs[k].name} ended with exit {rc}: no further ingredient starts"
                        + (f"; {going} go on to their end" if going else "")
                    )
                if first_failure is None or (first_failure == EXIT_INTERRUPTED and rc != EXIT_INTERRUPTED):
                    first_failure = rc  # a failure says more than a stop
    except KeyboardInterrupt:
        cancel.set()  # each supervisor ends as on Ctrl-C at its next pause
        wait(list(running))
        for line in interrupted:
            log(line)
        raise Interrupted(
            f"detached from {len(interrupted)} ingredient(s) of `{composite.name}` (what each left running"
            f" is above); reattach with: {hint or f'olmo-ctl resume-until-done {composite.name}'}"
        ) from None
    except BaseException:
        cancel.set()  # the scheduler itself failed: no supervisor is left behind, each detaches
        raise
    finally:
        pool.shutdown(wait=True)
    for line in interrupted:
        log(line)
    if first_failure is not None:
        if composite.dir.pending_stop() is not None:
            composite.dir.clear_stop()
            lease.append("stopped", reason="stopped on request (olmo-ctl stop)")
        return first_failure
    return 0


T = TypeVar("T")


def stop(composite: Composite, stop_one: Callable[[RunDir], T]) -> list[T]:
    """`olmo-ctl stop NAME` of a run of ingredients: its supervisor ends before the next ingredient
    (stop.json in NAME/), and every ingredient that has a live attempt or supervisor is stopped as one
    run is (`stop_one`); the results, in order. A run whose soup is written is complete: nothing."""
    if composite.souped() is not None:
        return []
    composite.dir.request_stop("stopped on request (olmo-ctl stop)")
    return [stop_one(rd) for rd in composite.runs() if rd.exists()]
