"""`olmo-ctl eval`: one checkpoint's LM and downstream evaluation, in this process, on host CPU devices.

The evaluators are the trainer's own (`lm_eval.LMEvaluator`, `downstream.DownstreamEvaluator`), on a
mesh of the devices asked for, so a checkpoint scores here what its run logged in the loop. Three kinds
of checkpoint: a run's step directory `<run-dir>/checkpoints/<N>` (its recipe from run.yaml, or
`--recipe`, gives the defaults: `eval.downstream.tasks`, `eval.lm`, `data.tokenizer`,
`train.seq_len`), an Orbax directory with olmo_model.json (`convert hf-to-orbax`), and a Hugging Face
Olmo3ForCausalLM directory, converted in memory by `convert`'s code (its tokenizer.json is the default
tokenizer). Everything that can be refused is refused in `prepare`, before any parameter is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import LMEvalConfig, ModelConfig, Recipe, load_recipe, tokenizer_spec
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER
from olmo_ctl.storage import is_gcs, join, store_for

DEFAULT_SEQ_LEN = 2048  # without a recipe (capped by config.json's max_position_embeddings)
ROWS = 8  # instances per forward pass: up to this, a multiple of the devices
LOGITS_BYTES = 2 * 2**30  # ... and their fp32 logits at most this, unless one row per device is more
CHECKPOINT_HINT = (
    "pass <run-dir>/checkpoints/<N>, an Orbax directory with olmo_model.json (`olmo-ctl convert"
    " hf-to-orbax`) or a Hugging Face OLMo 2 or OLMo 3 directory (config.json)"
)


@dataclass(frozen=True)
class Checkpoint:
    """What CHECKPOINT is, read without its parameters."""

    given: str  # as the user wrote it (the report's `checkpoint`)
    path: str  # local paths absolute
    kind: Literal["run", "orbax", "hf"]
    step: int | None  # a run's step; None for the other kinds
    model: ModelConfig
    recipe: Recipe | None  # a run's recipe (kind "run")
    recipe_name: str | None  # --recipe, for a run's step directory without run.yaml
    max_positions: int | None  # config.json's max_position_embeddings (kinds "orbax", "hf")


def open_checkpoint(path: str, recipe: str | None = None) -> Checkpoint:
    """The checkpoint at `path` (local or gs://); a BadInput when it is none of the three kinds."""
    from olmo_ctl.checkpoints.convert import META_FILE, model_config_from_hf, read_hf_config, read_meta

    given = path
    if not is_gcs(path):
        if not os.path.isdir(path):
            raise BadInput(f"checkpoint `{path}` does not exist", CHECKPOINT_HINT)
        path = os.path.abspath(path)  # its run directory is two levels up, also from `checkpoints/40`
    path = path.rstrip("/")
    store = store_for(path)
    if store.exists(join(path, META_FILE)):
        from olmo_ctl.checkpoints.convert import model_from_meta

        _no_recipe(recipe, given)
        meta = read_meta(path)
        hf = meta.get("hf_config") or {}
        trained = _soup_recipe(path)
        return Checkpoint(given, path, "orbax", None, model_from_meta(meta), trained, None, _positions(hf))
    if store.exists(join(path, "config.json")):
        _no_recipe(recipe, given)
        hf = read_hf_config(path)
        name = os.path.basename(path) or "olmo3-hf"
        cfg = model_config_from_hf(hf, name=name)
        return Checkpoint(given, path, "hf", None, cfg, None, None, _positions(hf))
    head, _, step = path.rpartition("/")
    run_dir, _, parent = head.rpartition("/")
    if not (step.isdigit() and parent == "checkpoints"):
        raise BadInput(
            f"`{given}` is not a checkpoint: no olmo_model.json, no config.json, not a step directory",
            CHECKPOINT_HINT,
        )
    if recipe is not None:
        r = load_recipe(recipe)
    else:
        from olmo_ctl.rundir import RunDir

        rd = RunDir(run_dir)
        if not rd.exists():
            raise BadInput(
                f"`{given}`: its run has no run.yaml (`{join(run_dir, 'run.yaml')}`)",
                "pass --recipe with the run's recipe",
            )
        r = rd.recipe()
    from olmo_ctl.rundir import RunDir

    committed = RunDir(run_dir).committed_steps()  # the run directory's rule: the step holds its marker
    if int(step) not in committed:
        raise BadInput(f"`{given}` is not a committed checkpoint", f"committed steps: {committed}")
    return Checkpoint(given, path, "run", int(step), r.model, r, recipe, None)


def _soup_recipe(path: str) -> Recipe | None:
    """A soup of training checkpoints (soup.json with the recipe they were trained with): that recipe,
    for eval's defaults (sequence length, tokenizer, held-out sets, tasks); else None."""
    from olmo_ctl.checkpoints.soup import MANIFEST, read_manifest
    from olmo_ctl.rundir import run_recipe

    doc = read_manifest(path)
    if doc is None or not isinstance(doc.get("recipe"), dict):
        return None
    return run_recipe(doc, join(path, MANIFEST))


def _no_recipe(recipe: str | None, path: str) -> None:
    if recipe is not None:
        raise BadInput(
            f"--recipe is for a run's step directory without run.yaml; `{path}` carries its model",
            "leave --recipe out",
        )


def _positions(hf: dict) -> int | None:
    n = hf.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 1 else None


@dataclass
class EvalJob:
    """An evaluation ready to run: the recipe the evaluators read (the checkpoint's model, the
    sequence length, the tokenizer, the eval layout on the devices), the built tasks, the LM data."""

    checkpoint: Checkpoint
    recipe: Recipe
    devices: int
    tasks: list  # downstream.TaskSet, each cut to `limit` documents
    lm_data: Any  # lm_eval.LMEvalData, or None
    limit: int = 0
    held_out: bool = False  # the run's in-loop held-out loss too (nothing else chosen: `held_out_batches`)


def rows_per_pass(devices: int, seq_len: int, padded_vocab: int) -> int:
    """Instances per forward pass: a multiple of the devices, up to `ROWS` (rounded up to the
    devices) while their fp32 logits stay within `LOGITS_BYTES`; one per device at least."""
    per_row = seq_len * padded_vocab * 4
    return devices * max(1, min(-(-ROWS // devices), LOGITS_BYTES // (per_row * devices)))


def eval_recipe(
    ckpt: Checkpoint,
    *,
    tasks: tuple[str, ...] | None,
    lm: LMEvalConfig | None,
    tokenizer: str | None,
    seq_len: int | None,
    data_root: str | None,
    devices: int,
) -> Recipe:
    """The recipe the evaluators read. Unset choices come from the run's recipe (a run's checkpoint)
    or are off (no tasks, no LM sets; the tokenizer is a Hugging Face directory's own). The eval
    layout: `rows_per_pass` instances per forward pass, one pass per step, no sequence sharding; the
    train batch is set to it (the plan must split something)."""

    run = ckpt.recipe
    base = run or load_recipe("smoke")  # the layout's other defaults; the model is the checkpoint's
    if seq_len is None:
        seq_len = run.train.seq_len if run else min(DEFAULT_SEQ_LEN, ckpt.max_positions or DEFAULT_SEQ_LEN)
    if seq_len < 2:
        raise BadInput(f"--seq-len {seq_len}: a sequence needs at least 2 tokens", "e.g. --seq-len 2048")
    if tokenizer is None:
        tokenizer = tokenizer_spec(run) if run else (ckpt.path if ckpt.kind == "hf" else "")
    if data_root is None:
        data_root = run.data.root if run else ""
    rows = rows_per_pass(devices, seq_len, ckpt.model.padded_vocab_size)
    t, e = base.train, base.eval
    return dataclasses.replace(
        base,
        model=ckpt.model,
        train=dataclasses.replace(
            t, seq_len=seq_len, global_batch=rows, seq_shards=1, max_per_device_batch=0, mesh="fsdp"
        ),
        data=dataclasses.replace(base.data, root=data_root, tokenizer=tokenizer),
        eval=dataclasses.replace(
            e,
            batch_size=rows,
            micro_batch=rows,
            lm=(run.eval.lm if run else LMEvalConfig()) if lm is None else lm,
            downstream=dataclasses.replace(
                e.downstream, tasks=(run.eval.downstream.tasks if run else ()) if tasks is None else tasks
            ),
        ),
    )


def _checked(
    ckpt: Checkpoint,
    *,
    tasks: tuple[str, ...] | None = None,
    lm: LMEvalConfig | None = None,
    tokenizer: str | None = None,
    seq_len: int | None = None,
    data_root: str | None = None,
    devices: int = 1,
    limit: int = 0,
    known_labels: bool = True,
) -> tuple[Recipe, list]:
    """The recipe the evaluators read and the LM sets' files (none without eval.lm), after every
    refusal that needs neither the parameters nor a built task, in the order a user fixes them: something to evaluate, the task labels (not when
    `known_labels` is False: ai2-olmo-eval is not installed here), the tokenizer, the LM files."""
    from olmo_ctl.trainer import downstream as D
    from olmo_ctl.trainer.lm_eval import resolve_sets

    if limit < 0:
        raise BadInput(f"--limit {limit} is negative", "0 evaluates every document")
    r = eval_recipe(
        ckpt, tasks=tasks, lm=lm, tokenizer=tokenizer, seq_len=seq_len, data_root=data_root, devices=devices
    )
    labels, lm_cfg = r.eval.downstream.tasks, r.eval.lm
    sets: list = []
    defaults = tasks is None and lm is None
    if not labels and not lm_cfg.enabled and not (defaults and held_out_batches(ckpt)):
        where = "its run's recipe has" if ckpt.recipe else "a checkpoint without a recipe has"
        raise BadInput(
            f"nothing to evaluate: no downstream tasks and no LM sets ({where} none)",
            what_to_evaluate(ckpt.recipe),
        )
    if known_labels:
        D.check_tasks(labels)
    if labels:
        if not r.data.tokenizer:
            raise BadInput(
                "the downstream tasks need the model's tokenizer, and this checkpoint names none",
                "--tokenizer PATH (a Hugging Face tokenizer directory or tokenizer.json, local or gs://)",
            )
        try:
            D.tokenizer_path(r.data.tokenizer)
        except BadInput as err:
            raise BadInput(
                err.message,
                "--tokenizer is a Hugging Face tokenizer directory (with tokenizer.json) or a"
                f" tokenizer.json, local or gs://, or {D.BYTES_TOKENIZER} for byte-level models",
            ) from None
    if lm_cfg.enabled:
        if lm_cfg.mix and not r.data.root:
            raise BadInput(
                f"--lm {lm_cfg.mix} reads its files under a data root, and none is set",
                "--data-root DIR (the directory holding `eval-data/perplexity/...`, local or gs://)",
            )
        sets = resolve_sets(r)  # a missing file is named now
    return r, sets


# Tasks a byte-level tokenizer builds at the smoke model's 128-token sequence (AI2's `olmo3` set does
# not: its `_fast` choices are not one token each, and some continuations are longer than 128 bytes).
BYTE_LEVEL_TASKS = ("copycolors_10way", "arc_easy_test_bpb_5shot")


def what_to_evaluate(recipe: Recipe | None) -> str:
    """What to ask for when a checkpoint has nothing to evaluate by default, for its model: the held-out
    files of its recipe's `data.eval` as an LM set, and tasks its tokenizer can build (for a byte-level
    model such as the smoke recipe's, the byte-level ones, not AI2's `olmo3` set)."""
    lm = "--lm MIX|LABEL=PATH,..."
    if recipe is not None and recipe.data.eval:
        sets = ",".join(f"held_out={p}" for p in recipe.data.eval)
        lm = f"--lm '{sets}' (its recipe's held-out data, data.eval)"
    tasks = "--tasks LABEL,... (e.g. --tasks olmo3)"
    if recipe is not None and tokenizer_spec(recipe) == BYTES_TOKENIZER:
        tasks = f"--tasks {','.join(BYTE_LEVEL_TASKS)} --limit 20 (tasks its byte-level tokenizer builds)"
    return f"{lm}, or {tasks}"


def check_tasks(labels, tokenizer: str) -> None:
    """The refusals of downstream tasks that need no checkpoint: a label ai2-olmo-eval does not know,
    a tokenizer (`data.tokenizer`'s spec) that does not load."""
    from olmo_ctl.trainer import downstream as D

    D.check_tasks(labels)
    D.tokenizer_path(tokenizer)


def check(ckpt: Checkpoint, **options) -> Recipe:
    """`_checked`'s recipe: what an eval job checks before it is submitted (the keyword arguments
    of `prepare`, and `known_labels`)."""
    return _checked(ckpt, **options)[0]


def prepare(
    ckpt: Checkpoint,
    *,
    tasks: tuple[str, ...] | None = None,
    lm: LMEvalConfig | None = None,
    tokenizer: str | None = None,
    seq_len: int | None = None,
    data_root: str | None = None,
    devices: int = 1,
    limit: int = 0,
) -> EvalJob:
    """`check`, then the tasks built with the tokenizer (each cut to `limit` documents) and the LM
    sets' documents read: everything but the parameters."""
    from olmo_ctl.trainer import downstream as D
    from olmo_ctl.trainer.lm_eval import LMEvalData

    r, sets = _checked(
        ckpt,
        tasks=tasks,
        lm=lm,
        tokenizer=tokenizer,
        seq_len=seq_len,
        data_root=data_root,
        devices=devices,
        limit=limit,
    )
    built = []
    if r.eval.downstream.tasks:
        tok = D.load_tokenizer(r.data.tokenizer, r.model)
        for label in r.eval.downstream.tasks:
            ts = D.build_task_set(label, tok, r.train.seq_len)
            built.append(ts.first_documents(limit) if limit else ts)
    data = None
    if r.eval.lm.enabled:
        m = r.model
        data = LMEvalData(sets, r.train.seq_len, m.eos_token_id, m.pad_token_id, m.vocab_size)
    held_out = tasks is None and lm is None and not built and data is None
    return EvalJob(ckpt, r, devices, built, data, limit, held_out=held_out)


def held_out_batches(ckpt: Checkpoint) -> int:
    """How many held-out batches the run of `ckpt` evaluates in its loop (`eval/lm_loss`: `eval.batches`
    of `data.eval`, trainer/evaluator.HeldOutLoss); 0 for a checkpoint without a run's recipe or a
    recipe without them. A run's checkpoint whose recipe evaluates nothing else, with no --tasks or
    --lm given, gets that loss, the number `monitor` shows as `eval lm_loss`."""
    r = ckpt.recipe
    return r.eval.batches if ckpt.kind == "run" and r is not None and r.data.eval else 0


def _held_out_loss(ckpt: Checkpoint, params, mesh, devs) -> dict:
    """`{lm_loss, batches, instances}`: the run's own held-out evaluation (its recipe's eval batches,
    layout and eval step, trainer/evaluator.HeldOutLoss) of `params`, on `devs`."""
    import jax

    from olmo_ctl.core.batching import make_plan
    from olmo_ctl.core.devices import cpu_device
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.evaluator import HeldOutLoss

    r = ckpt.recipe
    assert r is not None
    plan = make_plan(r, cpu_device(len(devs)))
    if plan.seq_shards != sharding.seq_shards(mesh):
        mesh = sharding.make_mesh(devs, seq_shards=plan.seq_shards, activate=False)
        params = jax.device_put(params, sharding.param_shardings(params, mesh))
    me = jax.process_index()
    s = EvalSetup(r, plan, mesh, me, jax.process_count(), sum(d.process_index == me for d in devs))
    evaluator = HeldOutLoss.for_recipe(s)
    assert evaluator is not None
    loss = evaluator.run(params).metrics["eval/lm_loss"]
    bs = r.eval.batch_size or r.train.global_batch
    return {"lm_loss": loss, "batches": r.eval.batches, "instances": r.eval.batches * bs}


# ---------------------------------------------------------------- an eval job (`eval --backend gke`)

RESULT_FILE = "result.json"  # in the job's output directory: {"spec", "devices", "report"}


@dataclass(frozen=True)
class EvalSpec:
    """What one eval job evaluates: `olmo-ctl eval`'s choices (None: the checkpoint's defaults), sent
    to the trainer as JSON on its command line (`--eval SPEC`) and kept beside the result."""

    checkpoint: str
    recipe: str | None = None
    tasks: tuple[str, ...] | None = None
    lm: LMEvalConfig | None = None
    tokenizer: str | None = None
    seq_len: int | None = None
    data_root: str | None = None
    limit: int = 0
    precision: str | None = None  # the matmuls' dtype (None: the checkpoint's own)
    per_instance: bool = False  # each LM document's CE sum and tokens too (`verify`'s σ)
    # A KL job instead of an evaluation: {"reference": [path, precision], "run": [path, precision],
    # "tokens": N}, over held-out rows of `checkpoint`'s run (the run side's recipe)
    kl: dict | None = None

    def to_dict(self) -> dict:
        lm = None
        if self.lm is not None:
            lm = {
                "mix": self.lm.mix,
                "sets": [{"label": x.label, "files": list(x.files)} for x in self.lm.sets],
            }
        return {
            "checkpoint": self.checkpoint,
            "recipe": self.recipe,
            "tasks": None if self.tasks is None else list(self.tasks),
            "lm": lm,
            "tokenizer": self.tokenizer,
            "seq_len": self.seq_len,
            "data_root": self.data_root,
            "limit": self.limit,
            # the later fields only when set: an earlier spec's dict (and its kept result) is unchanged
            **({"precision": self.precision} if self.precision is not None else {}),
            **({"per_instance": True} if self.per_instance else {}),
            **({"kl": self.kl} if self.kl is not None else {}),
        }

    def to_json(self) -> str:

        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> EvalSpec:
        """The spec of `to_json`; a BadInput naming what is malformed."""

        from olmo_ctl.core.recipe import LMEvalSet

        try:
            d = json.loads(text)
            lm = d.get("lm")
            return EvalSpec(
                checkpoint=str(d["checkpoint"]),
                recipe=d.get("recipe"),
                tasks=None if d.get("tasks") is None else tuple(str(t) for t in d["tasks"]),
                lm=None
                if lm is None
                else LMEvalConfig(
                    mix=str(lm.get("mix") or ""),
                    sets=tuple(
                        LMEvalSet(str(x["label"]), tuple(map(str, x["files"]))) for x in lm.get("sets") or ()
                    ),
                ),
                tokenizer=d.get("tokenizer"),
                seq_len=None if d.get("seq_len") is None else int(d["seq_len"]),
                data_root=d.get("data_root"),
                limit=int(d.get("limit") or 0),
                precision=None if d.get("precision") is None else str(d["precision"]),
                per_instance=bool(d.get("per_instance", False)),
                kl=_kl_of(d.get("kl")),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise BadInput(
                f"--eval: not an eval spec ({type(e).__name__}: {e})",
                "olmo-ctl eval --backend gke writes it; see docs/CONTRACTS.md",
            ) from None

    def options(self) -> dict:
        """The keyword arguments of `check` and `prepare` (the precision and the KL apart)."""
        return {
            "tasks": self.tasks,
            "lm": self.lm,
            "tokenizer": self.tokenizer,
            "seq_len": self.seq_len,
            "data_root": self.data_root,
            "limit": self.limit,
        }


def _kl_of(kl) -> dict | None:
    """A spec's `kl`, checked: two [path, precision] sides and a token count."""
    if kl is None:
        return None
    sides = [kl["reference"], kl["run"]]
    if not all(isinstance(x, list) and len(x) == 2 for x in sides):
        raise ValueError("kl.reference and kl.run are [path, precision]")
    return {
        "reference": [str(x) for x in sides[0]],
        "run": [str(x) for x in sides[1]],
        "tokens": int(kl["tokens"]),
    }


def run_job(spec: EvalSpec, out_dir: str, devices, sent: dict | None = None, log=None) -> dict:
    """An eval job's work, on `devices` (every chip of the slice: one process per host, each reading
    only its own devices' shards): the spec's evaluation, or its KL, written by process 0 to
    `<out_dir>/result.json` as `{spec, devices, report}` (`spec`: `sent`, the spec as it came, else
    this one's dict); returns that."""
    import jax

    devs = list(devices)
    ckpt = open_checkpoint(spec.checkpoint, spec.recipe)
    if spec.kl is not None:
        report = run_kl(spec, ckpt, devs, log=log)
    else:
        job = prepare(_in_precision(ckpt, spec.precision), devices=len(devs), **spec.options())
        report = run(job, devs, per_instance=spec.per_instance, log=log)
    d0 = devs[0]
    record = {
        "spec": spec.to_dict() if sent is None else sent,
        "devices": {"platform": d0.platform, "kind": str(d0.device_kind), "count": len(devs)},
        "report": report,
    }
    if jax.process_index() == 0:
        store_for(out_dir).write_bytes(
            join(out_dir, RESULT_FILE), (json.dumps(record, indent=1) + "\n").encode()
        )
    return record


def _in_precision(ckpt: Checkpoint, precision: str | None) -> Checkpoint:
    """The checkpoint with its matmuls in `precision` (None: its own)."""
    if precision is None:
        return ckpt
    model = dataclasses.replace(ckpt.model, compute_dtype=precision)  # type: ignore[arg-type]
    return dataclasses.replace(ckpt, model=model)


def run_kl(spec: EvalSpec, ckpt: Checkpoint, devices, log=None) -> dict:
    """`{kl, tokens}`: the mean token KL(reference || run) of `spec.kl` over held-out rows of
    `ckpt`'s run (its recipe's `eval.lm` as the spec sets it, else `data.eval`), both sides sharded
    over `devices` (the JAX devices, or a count of this process's host CPU devices; checkpoints/kl.py)."""
    from olmo_ctl.checkpoints import kl as K

    if isinstance(devices, int):
        from olmo_ctl.trainer.quiet import cpu_devices

        devices = cpu_devices(devices)

    assert spec.kl is not None
    r = kl_recipe(spec, ckpt, len(list(devices)))
    (ref_path, ref_dtype), (run_path, run_dtype) = spec.kl["reference"], spec.kl["run"]
    ref = _in_precision(open_checkpoint(ref_path, _recipe_for(ref_path, spec)), ref_dtype)
    run_ck = _in_precision(open_checkpoint(run_path, _recipe_for(run_path, spec)), run_dtype)
    import jax

    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.checkpoint import storage_bytes_read

    devs = list(devices)
    mesh = sharding.make_mesh(devs, activate=False)
    with jax.set_mesh(mesh):
        read0 = storage_bytes_read()
        ref_params, run_params = load_sharded(ref, mesh), load_sharded(run_ck, mesh)
        mib = (storage_bytes_read() - read0) / 2**20
        per_pass = rows_per_pass(len(devs), r.train.seq_len, ref.model.padded_vocab_size)
        value, n = K.sharded_token_kl(
            ref_params, ref.model, run_params, run_ck.model, r, int(spec.kl["tokens"]), mesh, per_pass
        )
    if log is not None:
        log(
            f"KL over {n} held-out tokens on {len(devs)} devices ({mib:.2f} MiB of checkpoints read by this host)"
        )
    return {"kl": value, "tokens": n}


def kl_recipe(spec: EvalSpec, ckpt: Checkpoint, devices: int) -> Recipe:
    """The recipe a KL spec's held-out rows come from: the run side's (`ckpt`), its `eval.lm` as the
    spec sets it, else its `data.eval`; no tasks."""
    return eval_recipe(
        ckpt,
        tasks=(),
        lm=spec.lm,
        tokenizer=spec.tokenizer,
        seq_len=spec.seq_len,
        data_root=spec.data_root,
        devices=devices,
    )


def _recipe_for(path: str, spec: EvalSpec) -> str | None:
    """`spec.recipe` for a run's step directory without run.yaml (the spec's checkpoint's rule)."""
    from olmo_ctl.rundir import RunDir

    parent, _, _ = path.rstrip("/").rpartition("/")
    run_dir, _, leaf = parent.rpartition("/")
    return spec.recipe if leaf == "checkpoints" and not RunDir(run_dir).exists() else None


def load_sharded(ckpt: Checkpoint, mesh):
    """The checkpoint's parameters as jax arrays over `mesh`, sharded as the trainer shards them, read
    straight into their shards: each host reads only the parts its own devices hold (an Orbax partial
    restore of `params` for a run's checkpoint or a converted one, as `--init-from` reads them; the
    memory-mapped rows each shard covers for a Hugging Face directory), never a whole copy, so a model
    larger than one host's memory evaluates on a slice that holds it."""
    import jax
    import numpy as np

    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.model import param_shapes

    dtype = np.dtype(jax.numpy.dtype(ckpt.model.param_dtype))
    abstract = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, dtype),
        param_shapes(ckpt.model),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    shardings = sharding.param_shardings(abstract, mesh)
    if ckpt.kind == "hf":
        from olmo_ctl.checkpoints import convert

        with convert.local_copy(ckpt.path) as d:
            return convert.hf_params_sharded(d, ckpt.model, shardings)
    from olmo_ctl.trainer.checkpoint import load_init_params

    return load_init_params(ckpt.path, abstract, shardings, run_step=ckpt.kind == "run")


@dataclass
class EvalSetup:
    """What the evaluators read of a set-up (the trainer's `_Setup` fields they use): one process."""

    recipe: Recipe
    plan: Any
    mesh: Any
    proc: int = 0
    n_proc: int = 1
    local_devices: int = 1


def _per_instance_sums(job: EvalJob, s: EvalSetup, params):
    """The LM evaluator's pass with every evaluated document its own label: (per-label CE sums,
    per-label tokens, {label: {ce: [...], tokens: [...]}}), the documents in the evaluator's order."""
    import copy

    import numpy as np

    from olmo_ctl.trainer.lm_eval import LMEvaluator, evaluated_instances, first_per_label

    data = job.lm_data
    inst = evaluated_instances(len(data), s.recipe.eval.lm.whole_batches_of)
    if job.limit > 0:
        inst = first_per_label(inst, data.label_index, job.limit)
    one = copy.copy(data)  # the same documents, numbered 0.. in the evaluator's order, one label each
    one.file_index, one.starts, one.ends = data.file_index[inst], data.starts[inst], data.ends[inst]
    one.label_index = np.arange(len(inst), dtype=np.int32)
    one.labels = [str(i) for i in range(len(inst))]
    one._cache = {}
    r = s.recipe
    whole = dataclasses.replace(
        r, eval=dataclasses.replace(r.eval, lm=dataclasses.replace(r.eval.lm, whole_batches_of=0))
    )
    ce_i, w_i = LMEvaluator(one, dataclasses.replace(s, recipe=whole)).sums(params)
    owner = data.label_index[inst]
    n = len(data.labels)
    ce = np.bincount(owner, weights=ce_i, minlength=n).astype(np.float64)
    w = np.bincount(owner, weights=w_i, minlength=n).astype(np.float64)
    per = {
        label: {"ce": [float(x) for x in ce_i[owner == k]], "tokens": [int(x) for x in w_i[owner == k]]}
        for k, label in enumerate(data.labels)
    }
    return ce, w, per


def _plain(x: float) -> float | None:
    return None if math.isnan(x) else x


def run(job: EvalJob, devices=None, per_instance: bool = False, log=None) -> dict:
    """The report: `{checkpoint, step, lm: {label: {ce_loss, ppl, tokens}}, downstream: {task:
    {metric: value, ..., stderr}}}` (NaN, e.g. the standard error of one document, as None).
    `devices`: the JAX devices (default: the first `job.devices` host CPU devices). `per_instance`:
    each LM label also gets `instances: {ce, tokens}`, the CE sum and tokens of each of its documents
    (what `verify` takes the held-out loss's σ from); the label's sums are theirs."""
    import jax

    from olmo_ctl.core.batching import make_plan
    from olmo_ctl.core.contracts import lm_eval_tags
    from olmo_ctl.core.devices import cpu_device
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.checkpoint import storage_bytes_read
    from olmo_ctl.trainer.downstream import DownstreamEvaluator
    from olmo_ctl.trainer.lm_eval import LMEvaluator, per_label_metrics
    from olmo_ctl.trainer.quiet import cpu_devices

    devs = list(devices) if devices is not None else cpu_devices(job.devices)
    r = job.recipe
    plan = make_plan(r, cpu_device(len(devs)))
    mesh = sharding.make_mesh(devs, seq_shards=plan.seq_shards, activate=False)
    s = EvalSetup(
        r,
        plan,
        mesh,
        proc=jax.process_index(),
        n_proc=jax.process_count(),
        local_devices=sum(d.process_index == jax.process_index() for d in devs),
    )
    report: dict = {
        "checkpoint": job.checkpoint.given,
        "step": job.checkpoint.step,
        "lm": {},
        "downstream": {},
    }
    with jax.set_mesh(mesh):
        read0 = storage_bytes_read()
        params = load_sharded(job.checkpoint, mesh)
        if log is not None and job.checkpoint.kind != "hf":  # tensorstore's counters: Orbax reads
            mib = (storage_bytes_read() - read0) / 2**20
            log(
                f"eval: read {job.checkpoint.given} over {len(devs)} devices ({mib:.2f} MiB read by this host)"
            )
        if job.lm_data is not None:
            per = None
            if per_instance:
                ce, w, per = _per_instance_sums(job, s, params)
            else:
                ce, w = LMEvaluator(job.lm_data, s, job.limit).sums(params)
            values = per_label_metrics(job.lm_data.labels, ce, w)
            for label, tokens in zip(job.lm_data.labels, w, strict=True):
                ce_tag, ppl_tag = lm_eval_tags(label)
                report["lm"][label] = {
                    "ce_loss": _plain(values[ce_tag]),
                    "ppl": _plain(values[ppl_tag]),
                    "tokens": int(tokens),
                    **({"instances": per[label]} if per is not None else {}),
                }
        if job.held_out:
            report["held_out"] = _held_out_loss(job.checkpoint, params, mesh, devs)
        if job.tasks:
            results = DownstreamEvaluator(job.tasks, s).evaluate(params)
            report["downstream"] = {
                task: {k: _plain(v) for k, v in metrics.items()} for task, metrics in results.items()
            }
    return report
