"""Recipes: YAML files validated into typed, frozen objects.

A recipe file is a delta: it resolves over its `base:` recipe and the model file its `model:` names
(recipes/models/), then `--set key.sub=value` overrides apply to the merged mapping before
validation, so they are checked exactly like values from a file (load_layers; docs/recipes.md).
Unknown keys, wrong types, impossible values and a key set twice at one level are errors that name
the key and the file. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import EVAL_MIXES, MIXES
from olmo_ctl.core.text import closest

# Package data: `recipes/` at the top of the repository, `olmo_ctl/recipes` (a link to it) in a checkout,
# real files in an installed wheel.
RECIPES_DIR = Path(str(resources.files("olmo_ctl") / "recipes"))
MODELS_DIR = RECIPES_DIR / "models"  # model files: what `model: NAME` in a recipe names
# `--model NAME --stage N` -> the shipped recipe AI2's stage N of that model is (`--model` defaults to
# DEFAULT_MODEL, so `--stage N` alone is the OLMo 3 7B's).
MODEL_STAGE_RECIPES: dict[str, dict[int, str]] = {
    "olmo3-7b": {1: "olmo3-7b-stage1", 2: "olmo3-7b-stage2", 3: "olmo3-7b-stage3"},
    "olmo2-32b": {1: "olmo2-32b-stage1", 2: "olmo2-32b-stage2"},
    "olmo3-32b": {1: "olmo3-32b-stage1", 2: "olmo3-32b-stage2", 3: "olmo3-32b-stage3"},
}
DEFAULT_MODEL = "olmo3-7b"
STAGE_RECIPES = MODEL_STAGE_RECIPES[DEFAULT_MODEL]
# The most steps a run may have: the trainer's step counter and Adam's bias-correction count are int32
# (trainer/step.py, trainer/optim.py). OLMo 3 7B's stage 1 is 1,413,814 steps.
MAX_STEPS = 2**31 - 1
# Where a shipped stage after the first starts: (the stage it continues, how), as docs/recipes.md's
# `init` rows and each recipe file's header say. A new run of one from the recipe's random
# initialisation is not AI2's stage, so `plan`, `submit` and `resume-until-done` say it (`start_note`).
STAGE_STARTS: dict[str, tuple[str, str]] = {
    "olmo3-7b-stage2": ("olmo3-7b-stage1", "warm-adam"),
    "olmo3-7b-stage3": ("olmo3-7b-stage2", "warm-adam"),
    "olmo2-32b-stage2": ("olmo2-32b-stage1", "start-from"),
    "olmo3-32b-stage2": ("olmo3-32b-stage1", "start-from"),
    "olmo3-32b-stage3": ("olmo3-32b-stage2", "init-from"),
}


# The attention kernels a model may name (`auto`: chosen by the platform at trace time).
Attention = Literal["auto", "splash", "blocked", "banded", "reference", "cudnn"]


@dataclass(frozen=True)
class RopeScalingConfig:
    """YaRN RoPE scaling (OLMo-core `YaRNRoPEScalingConfig`, HF `rope_type: yarn`)."""

    kind: Literal["yarn"] = "yarn"
    factor: float = 8.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_context: int = 8192  # the context the base model was trained with (old_context_len)
    full_layers_only: bool = True  # OLMo-core `with_rope_scaling(full_attn_layers_only=True)`

    @property
    def attention_factor(self) -> float:
        """cos/sin (so q and k) are scaled by this: 0.1 ln(factor) + 1 (YaRN paper, section 3.4)."""
        import math

        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The network. Its values come from a model file (`recipes/models/<name>.yaml`), never from
    defaults here: a recipe that names no model is refused rather than trained as some default one.
    Only the two values that are off or chosen per platform have defaults."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int  # real tokens
    padded_vocab_size: int  # embedding rows used in training
    # The LM-head rows whose logits take part in the softmax: a converted Hugging Face model's own rows
    # (its config.json's vocab_size), the rows padding added being zeros it never trained. 0: every
    # padded row, as OLMo-core trains them (a recipe's model). Absent from run.yaml while 0.
    softmax_vocab_size: int = 0
    sliding_window: int  # a token sees itself plus window-1 before it (0: no sliding layers)
    full_attention_every: int  # layer i is full attention where (i+1) % full_attention_every == 0
    rope_theta: float
    rope_scaling: RopeScalingConfig | None = None  # stage 3: YaRN on the full-attention layers
    rms_norm_eps: float
    init_std: float
    param_dtype: Literal["float32", "bfloat16"]
    compute_dtype: Literal["float32", "bfloat16"]
    # Rematerialisation (activation checkpointing; OLMo-core's modes, docs/planning.md#activation-checkpointing):
    # none | full (recompute the whole block) | save_proj (keep attention/MLP projections) | mlp
    # (recompute the feed-forward only: OLMo-core's selected_modules ["blocks.*.feed_forward"]) | budget
    # (keep projections within `remat_budget` of what no rematerialisation keeps: OLMo-core's budget)
    remat: Literal["none", "full", "save_proj", "mlp", "budget"]
    remat_budget: float = 0.5  # remat: budget only; OLMo-core's activation_memory_budget
    # Attention implementation: auto picks splash on TPU, cudnn on GPU (blocked without cuDNN), banded
    # on CPU (olmo_ctl/trainer/attention.py; docs/attention-and-xla-flags.md). All compute the same numbers.
    attention: Attention = "auto"
    eos_token_id: int
    pad_token_id: int
    # The Hugging Face family the network converts to and from: olmo3 (`Olmo3ForCausalLM`: sliding
    # and full layers, per-layer-type RoPE) or olmo2 (`Olmo2ForCausalLM`: the same reordered-norm
    # block with QK-norm, every layer full attention, one RoPE). The block's arithmetic is the same.
    architecture: Literal["olmo3", "olmo2"] = "olmo3"

    def layer_is_full(self, i: int) -> bool:
        """Full attention where (i+1) % full_attention_every == 0, and always on the last layer
        (OLMo-core's `force_full_attention_on_last_layer`, which matters when n_layers is not a
        multiple of full_attention_every)."""
        return (i + 1) % self.full_attention_every == 0 or i == self.n_layers - 1

    def layer_rope_scaled(self, i: int) -> bool:
        """Whether layer i's RoPE uses `rope_scaling` (full-attention layers only, unless configured)."""
        rs = self.rope_scaling
        return rs is not None and (not rs.full_layers_only or self.layer_is_full(i))


@dataclass(frozen=True)
class SkipStepConfig:
    enabled: bool = True
    window: int = 128
    min_history: int = 64
    sigma: float = 6.0


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    z_loss: float = 1e-5
    skip_step: SkipStepConfig = field(default_factory=SkipStepConfig)


@dataclass(frozen=True)
class SchedulePart:
    """One OLMo-core scheduler (see core/schedule.py for the formulas)."""

    kind: Literal["cosine", "half_cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    alpha: float = 0.1  # eta_min = alpha * peak
    t_max: int = 0  # the part's horizon in steps (0 = train.max_steps)
    last_step: int = 0  # the last step whose LR this part sets (0 on the final part: to the end)
    # The step its decay starts from, when not its warmup's end: a continuation that `olmo-ctl amend`
    # writes when it moves the horizon (core/schedule.py). Absent unless set.
    decay_from: float | None = None


@dataclass(frozen=True)
class ScheduleConfig:
    # cosine = CosWithWarmup, half_cosine = HalfCosWithWarmup, linear = LinearWithWarmup (OLMo-core);
    # stitched = `parts` one after the other (the other fields are then unused).
    kind: Literal["cosine", "half_cosine", "linear", "stitched"] = "cosine"
    warmup_steps: int = 2000
    alpha: float = 0.1  # final LR = alpha * peak; linear decays to 0 when alpha = 0
    t_max: int = 0  # horizon in steps (0 = train.max_steps)
    parts: tuple[SchedulePart, ...] = ()


@dataclass(frozen=True)
class DataConfig:
    # Token files (raw uint32). `mix` names a shipped file list (OLMo-core's data mixes, in their
    # order) under the base directory `root`; otherwise `train` lists paths where `{root}` is replaced
    # by `root` (globs allowed, each sorted).
    root: str = ""
    mix: str = ""
    train: tuple[str, ...] = ()
    eval: tuple[str, ...] = ()
    seed: int = 34521
    ngram_filter: bool = False
    prefetch_workers: int = 0
    prefetch_buffer: int = 2
    # OLMo-core's packed FSL dataset (stage 3; olmo_ctl/trainer/packed.py): documents packed into
    # instances with best-fit decreasing, per group of `source_group_size` files, attention masked
    # at document boundaries. `source_permutation_seed` shuffles the file list first (any dataset).
    packed: bool = False
    source_group_size: int = 1
    source_permutation_seed: int | None = None
    # The run's tokenizer, for evaluators that tokenize text (`eval.downstream`): a Hugging Face
    # tokenizer directory (with tokenizer.json) or a tokenizer.json, local or gs://, or builtin://bytes
    # (the smoke model's bytes). Evaluation only: not part of the fingerprint.
    tokenizer: str = ""


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 2000
    keep: int = 3  # committed checkpoints to keep (0 keeps all); with ephemeral ones: permanent ones
    async_save: bool = True
    # Tiered checkpoints (OLMo-core's `ephemeral_save_interval`, docs/trainer.md#tiered-checkpoints):
    # one every `ephemeral_interval` steps besides the permanent ones every `interval`, each deleted
    # once a later checkpoint has committed. 0: none. Not part of the fingerprint.
    ephemeral_interval: int = 0
    # Upload throttling (OLMo-core's `throttle_uploads`, docs/trainer.md#upload-throttling): at most
    # this many hosts write their shards at once, in rounds by process index. 0: every host at once.
    # Not part of the fingerprint.
    upload_hosts: int = 0


# `eval` keys in Recipe.fingerprint(): those of the first runs. Evaluation does not change what a run
# trains, so a key added to EvalConfig stays out of the fingerprint (docs/recipes.md#fingerprints).
FINGERPRINTED_EVAL_KEYS = ("interval", "batches", "batch_size")


@dataclass(frozen=True)
class LMEvalSet:
    """One labelled set of token files for `eval.lm` (`{root}` is `data.root`; globs allowed)."""

    label: str = ""
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class LMEvalConfig:
    """OLMo-core's LM evaluator (`LMEvaluatorCallbackConfig` over a `NumpyPaddedFSLDataset`): one
    instance per document, the whole set every `interval` steps, `eval/lm/<label>/CE loss` and `PPL`
    (trainer/lm_eval.py). Off unless `mix` names a shipped validation mix (under `data.root`) or
    `sets` lists labelled token files; not both."""

    mix: str = ""
    sets: tuple[LMEvalSet, ...] = ()
    interval: int = 10000  # AI2's (OLMo-3-1025-7B-pretrain-1.py: eval_interval=10_000)
    # 0: every instance. B > 0: only those OLMo-core's eval loader reads, its shuffle (seed 0, epoch 1)
    # cut to whole global eval batches of B instances (2 x its data-parallel ranks in AI2's scripts).
    whole_batches_of: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.mix or self.sets)


@dataclass(frozen=True)
class DownstreamConfig:
    """OLMo-core's downstream evaluator (`DownstreamEvaluatorCallbackConfig`): ai2-olmo-eval's tasks,
    built with `data.tokenizer`, scored by the model every `interval` steps (trainer/downstream.py).
    `eval.downstream: [labels]` is short for `{tasks: [labels]}`."""

    tasks: tuple[str, ...] = ()
    interval: int = 10000  # AI2's (OLMo-3-1025-7B-pretrain-1.py: eval_interval=10_000)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss every `interval` steps (on `data.eval`): evaluation, not training. `lm`: the
    per-label LM evaluator, apart from it."""

    interval: int = 1000
    batches: int = 8
    batch_size: int = 0  # 0 = the training global batch
    # Instances per forward pass of the eval step, over the whole slice; 0 = the train step's micro-batch
    # (`core.batching.eval_micro_batch`). Bounds the eval step's logits: micro-batch / data-parallel
    # rows x seq_len x padded_vocab_size fp32 values per device.
    micro_batch: int = 0
    lm: LMEvalConfig = field(default_factory=LMEvalConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)


@dataclass(frozen=True)
class LoggingConfig:
    metrics_every: int = 10  # fetch on-device metrics to the host every N steps
    upload_every_s: float = 60.0  # event-file segment upload to gs://


@dataclass(frozen=True)
class RuntimeConfig:
    """How the trainer guards a run (docs/multi-host.md); not part of the fingerprint."""

    peer_timeout_s: int = 60  # a host that misses heartbeats this long is lost: the others exit 3
    init_timeout_s: int = 300  # joining the slice's hosts; past it exit 3 (restart)
    watchdog_factor: float = 10.0  # a step longer than this x the median step time is a hang: exit 3
    watchdog_min_s: float = 300.0  # ... and never shorter than this
    # One storage operation (GCS through google-cloud-storage, gcsfs or tensorstore), its retries
    # included, gives up after about this long: exit 3 instead of a silent wait (docs/multi-host.md).
    storage_timeout_s: float = 120.0


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 8192
    global_batch: int = 512
    max_steps: int = 1413814  # final step: checkpoint `max_steps` ends the run
    seed: int = 34521  # parameter init and other RNG
    max_per_device_batch: int = 0  # recipe cap on the micro-batch per device (0 = from the memory estimate)
    mesh: Literal["fsdp", "hybrid"] = "fsdp"
    data_parallel: int = 1  # replicas along the data axis when mesh = hybrid
    # Devices each sequence is split over (context parallelism, docs/planning.md); 0 = the plan
    # chooses (1 unless the slice has more devices than instances or one instance does not fit).
    seq_shards: int = 0
    # Hybrid sharding by group size (OLMo-core's HSDP `shard_degree`, docs/planning.md): parameters
    # and optimizer state are sharded over groups of this many devices, replicated across the groups
    # of a slice and across slices; the plan derives the replicas from the slice. 0 = one group per
    # slice (plain FSDP, or `mesh: hybrid` with its fixed `data_parallel`). A layout, not what the
    # run trains: not in the fingerprint.
    shard_group: int = 0


@dataclass(frozen=True)
class Ingredient:
    """One run of a stage that is several runs averaged ("model souping", OLMo 2 32B's mid-training):
    the stage recipe with these `--set` overrides (its data seed, mix, token budget...), from the same
    start (docs/ingredients.md)."""

    name: str = ""  # a label for monitor and runs (default: i<K>)
    set: tuple[str, ...] = ()  # key.sub=value, applied to the stage recipe as --set applies them


# Keys an ingredient may change: what it reads and for how long, never the network or the batch
# (the soup averages tensors of one model, trained with the same step shape).
INGREDIENT_KEYS = ("data.", "train.max_steps", "train.seed", "schedule.", "optimizer.lr", "eval.", "logging.")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    stage: int = 0  # 1, 2, 3, or 0 for other runs
    description: str = ""
    model: ModelConfig  # from a model file (`model: NAME`), see load_layers
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # XLA/libtpu flags (`--name=value`) merged over the generation profile's for this run's slices
    # (docs/attention-and-xla-flags.md). Performance only: not part of the fingerprint, so an attempt
    # may change them.
    xla_flags: tuple[str, ...] = ()
    # Several runs of this recipe, averaged when all are done (docs/ingredients.md); empty: one run.
    ingredients: tuple[Ingredient, ...] = ()
    source: str = field(default="", compare=False)  # file it came from (not part of the recipe)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        if not d["ingredients"]:  # absent unless declared: run.yaml files stay as they were
            d.pop("ingredients")
        if not d["model"].get("softmax_vocab_size"):  # likewise: absent unless set
            d["model"].pop("softmax_vocab_size", None)
        for part in d["schedule"]["parts"]:  # likewise
            if part.get("decay_from") is None:
                part.pop("decay_from", None)
        return _plain(d)

    def ingredient_recipe(self, k: int) -> Recipe:
        """The recipe ingredient k (0-based) trains: this one with its overrides, without ingredients."""
        ing = self.ingredients[k]
        raw = self.to_dict()
        raw.pop("ingredients")
        src = f"{self.source or self.name} ingredient {k + 1}"
        return recipe_from_dict(raw, src, ing.set, blame=f"{src}: set")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Stable hash of the resolved recipe (its content, not where it came from). run.yaml records
        it; a later attempt with another one is refused unless only evaluation differs
        (`training_fingerprint`, rundir.check_matches; docs/recipes.md#fingerprints)."""
        return _digest(self._hashed())

    def training_fingerprint(self) -> str:
        """The hash of what the run trains: `fingerprint()`'s content less evaluation (`eval`,
        `data.eval`). Recipes that differ only in how the run is evaluated share it."""
        d = self._hashed()
        d.pop("eval", None)
        d["data"].pop("eval", None)
        return _digest(d)

    def _hashed(self) -> dict:
        d = self.to_dict()
        d.pop("xla_flags", None)
        d.pop("runtime", None)  # how the run is guarded, not what it trains
        d["data"].pop("tokenizer", None)  # read by evaluators only
        d["train"].pop("seq_shards", None)  # a layout, like the slice: not what the run trains
        d["train"].pop("shard_group", None)  # likewise
        d["checkpoint"].pop("ephemeral_interval", None)  # how often it is saved, not what is trained
        d["checkpoint"].pop("upload_hosts", None)  # how it is written, likewise
        if d["model"].get("architecture") == "olmo3":  # absent unless set: older runs keep their fingerprint
            d["model"].pop("architecture")
        if d["model"].get("remat") != "budget":  # read only by the budget mode
            d["model"].pop("remat_budget", None)
        for k, default in (("packed", False), ("source_group_size", 1), ("source_permutation_seed", None)):
            if d["data"].get(k) == default:  # absent unless set: older runs keep their fingerprint
                d["data"].pop(k, None)
        # Evaluation is not what a run trains: only the keys the first run.yaml files hashed stay, so
        # their fingerprints hold; a key added to `eval` later is never hashed.
        d["eval"] = {k: v for k, v in d["eval"].items() if k in FINGERPRINTED_EVAL_KEYS}
        return d


def tokenizer_spec(recipe: Recipe) -> str:
    """`data.tokenizer` with `{root}` replaced by `data.root`: what the evaluators that tokenize text load."""
    return recipe.data.tokenizer.replace("{root}", recipe.data.root.rstrip("/"))


def _digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------- loading and validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple,):
        return "list"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (lists -> tuples, ints -> floats)."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp is DownstreamConfig and isinstance(value, list | tuple):
            value = {"tasks": list(value)}  # `eval.downstream: [labels]`
        if not isinstance(value, dict):
            raise BadInput(f"{src}: `{key}` must be a mapping, got {type(value).__name__}")
        return _build(tp, value, key, src)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise BadInput(f"{src}: `{key}` must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, src)
            except BadInput:
                continue
        raise BadInput(f"{src}: `{key}` has the wrong type ({value!r})")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise BadInput(f"{src}: `{key}` must be a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]", src) for i, v in enumerate(value))
        if len(value) != len(args):
            raise BadInput(f"{src}: `{key}` must have {len(args)} items, got {len(value)}")
        return tuple(
            _coerce(v, a, f"{key}[{i}]", src) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise BadInput(f"{src}: `{key}` must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"{src}: `{key}` must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadInput(f"{src}: `{key}` must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise BadInput(f"{src}: `{key}` must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build(cls: type, raw: dict, prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    _check_keys(cls, raw, prefix, src)
    kwargs = {}
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        kwargs[k] = _coerce(v, hints[k], key, src)
    missing = [
        f.name
        for f in fields(cls)
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        key = f"{prefix}.{missing[0]}" if prefix else missing[0]
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        if cls is Recipe and missing[0] == "model":
            raise BadInput(
                f"{src}: the recipe has no model",
                f"name a model file with `model: NAME` (shipped: {', '.join(shipped_models())}) "
                "or a recipe with `base: NAME`",
            )
        raise BadInput(
            f"{src}: `{key}` is missing{more}",
            "a model's values come from a model file: `model: NAME` (recipes/models/)"
            if prefix == "model"
            else None,
        )
    return cls(**kwargs)


def _check_keys(cls: type, raw: dict, prefix: str, src: str, extra: tuple[str, ...] = ()) -> None:
    """Only the names `cls` has (and `extra`), in every nested section; types are checked later."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls) if f.name != "source"}
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k in extra:
            continue
        if k not in names:
            close = closest(str(k), names)
            meant = f"did you mean `{prefix + '.' if prefix else ''}{close}`? " if close else ""
            raise BadInput(
                f"{src}: unknown key `{key}`", f"{meant}known keys here: {', '.join(sorted(names))}"
            )
        section = _section_type(hints[k])
        if section is not None and isinstance(v, dict):
            _check_keys(section, v, key, src, ("from",) if section is ModelConfig and not prefix else ())


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), else None."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return next(
            (a for a in typing.get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)), None
        )
    return None


def _parse_value(text: str) -> Any:
    """A `--set` value is read as YAML (numbers, booleans, lists) so `1e-4`, `true`, `[a, b]` work."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, str):
        # YAML reads 3e-4 (no dot) as a string; accept it as a number.
        try:
            return float(v) if any(c in v for c in "eE.") else v
        except ValueError:
            return v
    return v


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...], src: str) -> dict:
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides or ():
        if "=" not in item:
            raise BadInput(f"--set `{item}` is not key.sub=value", "for example --set train.max_steps=100")
        key, _, text = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise BadInput(f"--set `{item}` has an empty key", "for example --set train.max_steps=100")
        node = raw
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise BadInput(f"{src}: --set `{key}`: `{p}` is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(text)
    return raw


def validate(r: Recipe, src: str) -> None:
    """Impossible values; each message names the key and the file."""
    m, t, o, s = r.model, r.train, r.optimizer, r.schedule

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise BadInput(f"{src}: `{key}` {why}")

    need(r.stage in (0, 1, 2, 3), "stage", f"must be 0, 1, 2 or 3, got {r.stage}")
    need(len(r.ingredients) != 1, "ingredients", "lists one: a stage of ingredients needs two or more")
    labels = [ing.name for ing in r.ingredients if ing.name]
    need(len(labels) == len(set(labels)), "ingredients", "names one twice: each name once")
    for i, ing in enumerate(r.ingredients):
        for item in ing.set:
            key = item.partition("=")[0].strip()
            need(
                "=" in item
                and any(key == p or (p.endswith(".") and key.startswith(p)) for p in INGREDIENT_KEYS),
                f"ingredients[{i}].set",
                f"`{item}` is not key=value of what an ingredient may change ({', '.join(INGREDIENT_KEYS)}):"
                " the soup averages one model trained with one batch",
            )
    for k in (
        "n_layers",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "mlp_hidden",
        "vocab_size",
        "padded_vocab_size",
        "full_attention_every",
    ):
        need(getattr(m, k) > 0, f"model.{k}", f"must be positive, got {getattr(m, k)}")
    if m.full_attention_every == 1:  # every layer full: no window to size
        need(m.sliding_window >= 0, "model.sliding_window", f"must be >= 0, got {m.sliding_window}")
    else:
        need(
            m.sliding_window > 0,
            "model.sliding_window",
            f"must be positive when some layers slide (full_attention_every {m.full_attention_every}),"
            f" got {m.sliding_window}",
        )
    need(
        m.architecture in ("olmo3", "olmo2"),
        "model.architecture",
        f"must be olmo3 or olmo2, got {m.architecture!r}",
    )
    if m.architecture == "olmo2":
        need(
            m.full_attention_every == 1,
            "model.full_attention_every",
            f"must be 1 for an olmo2 model (every layer full attention), got {m.full_attention_every}",
        )
        need(m.rope_scaling is None, "model.rope_scaling", "is not part of an olmo2 model (one plain RoPE)")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"must divide model.n_heads ({m.n_heads})")
    need(
        m.padded_vocab_size >= m.vocab_size,
        "model.padded_vocab_size",
        f"must be >= model.vocab_size ({m.vocab_size})",
    )
    need(
        m.softmax_vocab_size == 0 or m.vocab_size <= m.softmax_vocab_size <= m.padded_vocab_size,
        "model.softmax_vocab_size",
        f"must be 0 (every padded row) or from model.vocab_size ({m.vocab_size}) to model.padded_vocab_size",
    )
    need(m.rope_theta > 0, "model.rope_theta", "must be positive")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        need(rs.factor >= 1, "model.rope_scaling.factor", f"must be >= 1, got {rs.factor}")
        need(
            rs.beta_fast > 0 and rs.beta_slow > 0,
            "model.rope_scaling.beta_fast",
            "and beta_slow must be positive",
        )
        need(rs.original_context > 0, "model.rope_scaling.original_context", "must be positive")
    need(m.rms_norm_eps > 0, "model.rms_norm_eps", "must be positive")
    need(m.init_std > 0, "model.init_std", "must be positive")
    need(0 < m.remat_budget <= 1, "model.remat_budget", f"must be in (0, 1], got {m.remat_budget}")
    need(
        0 <= m.eos_token_id < m.vocab_size, "model.eos_token_id", "must be a token id below model.vocab_size"
    )
    need(
        0 <= m.pad_token_id < m.vocab_size, "model.pad_token_id", "must be a token id below model.vocab_size"
    )
    need(t.seq_len > 1, "train.seq_len", f"must be > 1, got {t.seq_len}")
    need(
        m.full_attention_every == 1 or m.sliding_window <= t.seq_len,
        "model.sliding_window",
        f"({m.sliding_window}) must not exceed train.seq_len ({t.seq_len})",
    )
    need(t.global_batch > 0, "train.global_batch", f"must be positive, got {t.global_batch}")
    need(t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    need(
        t.max_steps <= MAX_STEPS,
        "train.max_steps",
        f"must be at most {MAX_STEPS:,} (the trainer counts steps in int32), got {t.max_steps:,}",
    )
    need(t.max_per_device_batch >= 0, "train.max_per_device_batch", "must be >= 0")
    need(t.data_parallel >= 1, "train.data_parallel", "must be >= 1")
    need(t.seq_shards >= 0, "train.seq_shards", "must be >= 0 (0: the plan chooses)")
    if t.seq_shards > 1:
        need(
            t.seq_len % t.seq_shards == 0,
            "train.seq_shards",
            f"({t.seq_shards}) must divide train.seq_len ({t.seq_len})",
        )
        need(
            m.n_heads % t.seq_shards == 0 and m.n_kv_heads % t.seq_shards == 0,
            "train.seq_shards",
            f"({t.seq_shards}) must divide model.n_heads and n_kv_heads ({m.n_heads}, {m.n_kv_heads}): "
            "attention runs each sequence's heads split over its shards",
        )
    d = r.data
    need(d.source_group_size >= 1, "data.source_group_size", "must be >= 1")
    if d.packed:
        need(
            t.seq_len & (t.seq_len - 1) == 0,
            "train.seq_len",
            f"must be a power of two for data.packed (OLMo-core's packer), got {t.seq_len}",
        )
    need(
        t.shard_group >= 0, "train.shard_group", f"must be >= 0 (0: one group per slice), got {t.shard_group}"
    )
    need(
        not (t.shard_group and t.mesh == "hybrid"),
        "train.shard_group",
        "and train.mesh hybrid both set the replicas: choose one (shard_group follows the slice's size)",
    )
    if t.mesh == "hybrid":
        need(
            t.global_batch % t.data_parallel == 0,
            "train.global_batch",
            f"({t.global_batch}) must be a multiple of train.data_parallel ({t.data_parallel})",
        )
    need(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
    need(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "must be in [0, 1)")
    need(o.eps > 0, "optimizer.eps", "must be positive")
    need(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    need(o.grad_clip > 0, "optimizer.grad_clip", "must be positive")
    need(o.z_loss >= 0, "optimizer.z_loss", "must be >= 0")
    ss = o.skip_step
    need(ss.window >= 2, "optimizer.skip_step.window", "must be >= 2")
    need(
        2 <= ss.min_history <= ss.window,
        "optimizer.skip_step.min_history",
        "must be between 2 and optimizer.skip_step.window",
    )
    need(ss.sigma > 0, "optimizer.skip_step.sigma", "must be positive")
    _validate_schedule(s, t.max_steps, need)
    need(r.checkpoint.interval > 0, "checkpoint.interval", "must be positive")
    need(r.checkpoint.keep >= 0, "checkpoint.keep", "must be >= 0")
    c = r.checkpoint
    need(
        c.ephemeral_interval >= 0,
        "checkpoint.ephemeral_interval",
        "must be >= 0 (0: no ephemeral checkpoints)",
    )
    need(
        c.ephemeral_interval < c.interval,
        "checkpoint.ephemeral_interval",
        f"({c.ephemeral_interval}) must be shorter than checkpoint.interval ({c.interval}), or 0",
    )
    need(c.upload_hosts >= 0, "checkpoint.upload_hosts", "must be >= 0 (0: every host writes at once)")
    need(r.eval.interval > 0, "eval.interval", "must be positive")
    need(r.eval.batches >= 0, "eval.batches", "must be >= 0")
    need(r.eval.batch_size >= 0, "eval.batch_size", "must be >= 0")
    need(r.eval.micro_batch >= 0, "eval.micro_batch", "must be >= 0 (0: the train step's micro-batch)")
    _validate_lm_eval(r.eval.lm, need)
    ds = r.eval.downstream
    need(ds.interval > 0, "eval.downstream.interval", f"must be positive, got {ds.interval}")
    need(
        len(set(ds.tasks)) == len(ds.tasks),
        "eval.downstream.tasks",
        "names a task twice: each task once",
    )
    need(
        not ds.tasks or bool(r.data.tokenizer),
        "data.tokenizer",
        "must name the run's tokenizer when eval.downstream lists tasks (a Hugging Face tokenizer"
        " directory or tokenizer.json, local or gs://; builtin://bytes for byte-level models)",
    )
    need(r.logging.metrics_every > 0, "logging.metrics_every", "must be positive")
    need(r.runtime.peer_timeout_s > 0, "runtime.peer_timeout_s", "must be positive")
    need(r.runtime.init_timeout_s > 0, "runtime.init_timeout_s", "must be positive")
    need(r.runtime.watchdog_factor > 1, "runtime.watchdog_factor", "must be > 1")
    need(r.runtime.watchdog_min_s > 0, "runtime.watchdog_min_s", "must be positive")
    need(r.runtime.storage_timeout_s >= 4, "runtime.storage_timeout_s", "must be at least 4 (seconds)")
    need(r.data.prefetch_workers >= 0, "data.prefetch_workers", "must be >= 0")
    if r.data.mix:
        need(
            r.data.mix in MIXES, "data.mix", f"must be one of {', '.join(sorted(MIXES))}, got {r.data.mix!r}"
        )
        need(
            not r.data.train,
            "data.train",
            "must be empty when data.mix names the training files (--set data.train=[])",
        )
    else:
        need(
            len(r.data.train) > 0, "data.train", "must list at least one token file or glob (or set data.mix)"
        )


def _validate_lm_eval(lm: LMEvalConfig, need) -> None:
    need(lm.interval > 0, "eval.lm.interval", f"must be positive, got {lm.interval}")
    need(lm.whole_batches_of >= 0, "eval.lm.whole_batches_of", "must be >= 0 (0: every instance)")
    if lm.mix:
        need(
            lm.mix in EVAL_MIXES,
            "eval.lm.mix",
            f"must be one of {', '.join(sorted(EVAL_MIXES))} (a validation mix), got {lm.mix!r}",
        )
        need(not lm.sets, "eval.lm.sets", "must be empty when eval.lm.mix is set (--set eval.lm.sets=[])")
    seen: set[str] = set()
    for i, s in enumerate(lm.sets):
        key = f"eval.lm.sets[{i}]"
        need(bool(s.label), f"{key}.label", "must name the set (its tags are eval/lm/<label>/...)")
        need("/" not in s.label, f"{key}.label", f"must not hold `/` (a tag level), got {s.label!r}")
        need(s.label not in seen, f"{key}.label", f"{s.label!r} is given twice: one set per label")
        need(len(s.files) > 0, f"{key}.files", f"must list at least one token file for label {s.label!r}")
        seen.add(s.label)


def _validate_schedule(s: ScheduleConfig, max_steps: int, need) -> None:
    items: list[tuple[str, SchedulePart | ScheduleConfig]]
    if s.kind == "stitched":
        need(
            len(s.parts) >= 1, "schedule.parts", "must list at least one part when schedule.kind is stitched"
        )
        items = [(f"schedule.parts[{i}]", p) for i, p in enumerate(s.parts)]
    else:
        need(not s.parts, "schedule.parts", "is only for schedule.kind: stitched (--set schedule.parts=[])")
        items = [("schedule", s)]
    prev_last = 0
    for i, (key, p) in enumerate(items):
        t_max = p.t_max or max_steps
        need(p.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        need(p.t_max >= 0, f"{key}.t_max", "must be >= 0 (0 = train.max_steps)")
        need(
            p.warmup_steps < t_max,
            f"{key}.warmup_steps",
            f"({p.warmup_steps}) must be below the horizon ({key}.t_max or train.max_steps: {t_max})",
        )
        need(0 <= p.alpha <= 1, f"{key}.alpha", "must be in [0, 1]")
        if s.kind != "stitched":
            continue
        assert isinstance(p, SchedulePart)  # stitched: the items are the parts
        if p.decay_from is not None:
            need(
                p.kind != "half_cosine" and p.warmup_steps == 0 and p.decay_from < t_max,
                f"{key}.decay_from",
                f"({p.decay_from}) needs kind cosine or linear, no warmup and a horizon after it ({t_max})",
            )
        if i < len(items) - 1:
            need(
                p.last_step > prev_last,
                f"{key}.last_step",
                f"must be a step after the previous part's last step ({prev_last})",
            )
            prev_last = p.last_step
        else:
            need(p.last_step == 0, f"{key}.last_step", "must be 0 on the last part (it runs to the end)")


def shipped_recipes() -> list[str]:
    """The recipes `--recipe NAME` finds (recipes/*.yaml; model files live apart, in recipes/models/)."""
    return sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))


def shipped_models() -> list[str]:
    """The model files `model: NAME` finds (recipes/models/*.yaml)."""
    return sorted(x.stem for x in MODELS_DIR.glob("*.yaml"))


def stage_recipe(model: str | None, stage: int) -> str:
    """The shipped recipe of `--model MODEL --stage STAGE` (MODEL None: DEFAULT_MODEL)."""
    name = DEFAULT_MODEL if model is None else model
    stages = MODEL_STAGE_RECIPES.get(name)
    if stages is None:
        raise BadInput(
            f"--model {name} has no shipped stage recipes",
            f"models with stages: {', '.join(MODEL_STAGE_RECIPES)}; or pass --recipe FILE|NAME",
        )
    if stage not in stages:
        if model is None:
            raise BadInput(f"--stage {stage} is not a stage", "OLMo 3 stages here are 1, 2 and 3")
        have = ", ".join(str(s) for s in stages)
        raise BadInput(f"--model {name} has no stage {stage}", f"its stages are {have}")
    return stages[stage]


def resolve_recipe_path(
    recipe: str | None = None, stage: int | None = None, model: str | None = None
) -> Path:
    """`[--model NAME] --stage N` or `--recipe FILE|NAME` -> a file path. Exactly one of `--stage`
    and `--recipe` must be given; `--model` only picks whose stage `--stage` names."""
    if recipe is not None and stage is not None:
        raise BadInput("--stage and --recipe are exclusive", "give one of them")
    if model is not None and stage is None:
        raise BadInput(
            f"--model {model} needs --stage: it picks whose stage recipe --stage names",
            "pass --model NAME --stage N, or --recipe FILE|NAME alone",
        )
    if stage is not None:
        return RECIPES_DIR / f"{stage_recipe(model, stage)}.yaml"
    if recipe is None:
        raise BadInput("no recipe given", "pass --stage 1|2|3 or --recipe FILE|NAME")
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in recipe:
        if not p.exists():
            raise BadInput(
                f"recipe file `{recipe}` does not exist", "pass a YAML file or a name from recipes/"
            )
        return p
    named = RECIPES_DIR / f"{recipe}.yaml"
    if not named.exists():
        raise BadInput(f"`{recipe}` is not a recipe", f"known recipes: {', '.join(shipped_recipes())}")
    return named


class _KeyTwice(Exception):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: start-up time


class _Loader(_BaseLoader):
    """Safe YAML that refuses a key written twice in one mapping (plain PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable):
                    if key in seen:
                        raise _KeyTwice(key, seen[key], key_node.start_mark.line + 1)
                    seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_raw(path: Path, what: str = "recipe") -> dict:
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"{what} `{src}` is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})",
            "pass a recipe YAML file (UTF-8), e.g. recipes/smoke.yaml, or a name such as smoke",
        ) from None
    except OSError as e:
        raise BadInput(f"cannot read {what} `{src}`: {e.strerror}") from None
    if "\x00" in text:
        raise BadInput(
            f"{what} `{src}` is a binary file, not YAML",
            "pass a recipe YAML file (UTF-8), e.g. recipes/smoke.yaml, or a name such as smoke",
        )
    try:
        raw = yaml.load(text, Loader=_Loader)
    except _KeyTwice as e:
        raise BadInput(
            f"{src}: `{e.key}` is set twice in one mapping (lines {e.first_line} and {e.line})",
            "keep one of them",
        ) from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "syntax error"
        raise BadInput(f"{src}: not valid YAML ({first})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{src}: a {what} is a YAML mapping")
    return raw


# ---------------------------------------------------------------- layers: base -> model -> file -> --set


def _reference(ref: Any, key: str, src: str, where: Path | None) -> Path:
    """The file a `base:` (a recipe) or `model:` (a model file) names: a bare name is a shipped one
    (recipes/NAME.yaml, recipes/models/NAME.yaml); a path (with `/` or `.yaml`) is relative to the
    file that names it."""
    shipped, kind = (shipped_recipes(), "recipe") if key == "base" else (shipped_models(), "model")
    if not isinstance(ref, str) or not ref:
        raise BadInput(
            f"{src}: `{key}` must name a {kind} or a file, got {ref!r}", f"shipped: {', '.join(shipped)}"
        )
    if not (ref.endswith((".yaml", ".yml")) or "/" in ref):
        p = (RECIPES_DIR if key == "base" else MODELS_DIR) / f"{ref}.yaml"
        if not p.exists():
            raise BadInput(
                f"{src}: `{key}: {ref}` is not a shipped {kind}",
                f"shipped: {', '.join(shipped)}; or give a file path",
            )
        return p
    p = Path(ref)
    if not p.is_absolute():
        if where is None:
            raise BadInput(
                f"{src}: `{key}: {ref}` is a relative path, but `{src}` is not a local file",
                f"give an absolute path or a shipped name ({', '.join(shipped)})",
            )
        p = where / p
    if not p.is_file():
        raise BadInput(
            f"{src}: `{key}: {ref}`: `{p}` does not exist", f"a path is relative to `{src}`'s directory"
        )
    return p


def _merge(low: dict, high: dict) -> dict:
    """`high` over `low`: sections merge key by key, every other value (lists too) is replaced."""
    out = dict(low)
    for k, v in high.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_twice(model: dict, own: dict, prefix: str, src: str, model_src: str) -> None:
    """A recipe and the model file it names are one statement: a key both set to different values
    is refused (MaxText's rule for a model config and its overrides)."""
    for k, v in own.items():
        if k not in model:
            continue
        key = f"{prefix}.{k}"
        if isinstance(v, dict) and isinstance(model[k], dict):
            _set_twice(model[k], v, key, src, model_src)
        elif v != model[k]:
            raise BadInput(
                f"{src}: `{key}` is set twice: {v!r} here and {model[k]!r} in its model `{model_src}`",
                f"drop it here, name another model file, or pass --set {key}=... (the command line wins)",
            )


def load_layers(raw: dict, src: str, where: Path | None, _chain: tuple[str, ...] = ()) -> dict:
    """One recipe file's mapping resolved through its layers, lowest first: its `base:` recipe
    (itself resolved), then the model file its `model:` names, then the file's own keys. Returns a
    plain recipe mapping: no `base:`, `model:` a mapping. `where`: the directory relative paths are
    taken from (None: the mapping is not a local file)."""
    if "name" not in raw:
        raise BadInput(f"{src}: missing key `name`")
    _check_keys(Recipe, raw, "", src, ("base",))
    own = dict(raw)
    merged: dict = {}
    if "base" in own:
        path = _reference(own.pop("base"), "base", src, where)
        key = str(path.resolve())
        if key in _chain or key == str(Path(src).resolve()):
            raise BadInput(f"{src}: `base:` leads back to `{path}`", "a recipe cannot be its own base")
        merged = load_layers(load_raw(path), str(path), path.parent, (*_chain, str(Path(src).resolve())))
    model = own.pop("model", None)
    if isinstance(model, str):
        model = {"from": model}
    if model is not None and not isinstance(model, dict):
        raise BadInput(
            f"{src}: `model` must be a model name, a file or a mapping, got {model!r}",
            f"shipped models: {', '.join(shipped_models())}",
        )
    if model is not None:
        model = dict(model)
        if "from" in model:
            path = _reference(model.pop("from"), "model", src, where)
            named = load_raw(path, "model file")
            _check_keys(ModelConfig, named, "model", str(path))
            _set_twice(named, model, "model", src, str(path))
            merged = _merge(merged, {"model": named})
        own["model"] = model
    return _merge(merged, own)


def recipe_from_dict(
    raw: dict,
    src: str = "<recipe>",
    overrides: list[str] | tuple[str, ...] = (),
    where: Path | None = None,
    blame: str = "--set",
) -> Recipe:
    """A Recipe from a mapping: its layers (load_layers), then `--set` overrides, validated. An error
    about a value a `--set` gave names that `--set`, not the file."""
    raw = apply_overrides(load_layers(raw, src, where), overrides, src)
    try:
        r = _build(Recipe, raw, "", src)
        r = dataclasses.replace(r, source=src)
        validate(r, src)
        _check_remat_budget_set(r, overrides)
    except BadInput as e:
        raise _blame_override(e, src, overrides, blame) from None
    for k in range(len(r.ingredients)):  # each ingredient's recipe is checked as any recipe is
        r.ingredient_recipe(k)
    return r


def _override_keys(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(dotted key, the --set item) of each override, the last of a key winning, in order."""
    seen: dict[str, str] = {}
    for item in overrides or ():
        key = ".".join(p for p in item.partition("=")[0].strip().split(".") if p)
        seen.pop(key, None)
        seen[key] = item
    return list(seen.items())


def _blame_override(
    e: BadInput, src: str, overrides: list[str] | tuple[str, ...], blame: str = "--set"
) -> BadInput:
    """`e` (a message `SRC: ...`) said of the `--set` whose key it names, when one does: the value
    came from the command line, not from the recipe file."""
    if not overrides or not e.message.startswith(f"{src}: "):
        return e
    rest = e.message[len(src) + 2 :]
    names = re.findall(r"`([\w.\[\]]+)`|\b([a-z_]+\.[a-z_.]+)\b", rest)
    mentioned = [a or b for a, b in names]
    for m in mentioned:
        for key, item in reversed(_override_keys(overrides)):
            if m == key or m.startswith(key + ".") or key.startswith(m + "."):
                return BadInput(f"{blame} {item}: {rest}", e.hint)
    return e


def _check_remat_budget_set(r: Recipe, overrides: list[str] | tuple[str, ...]) -> None:
    """`--set model.remat_budget=` with another remat mode would change nothing: refused, not ignored."""
    if r.model.remat != "budget" and any(k == "model.remat_budget" for k, _ in _override_keys(overrides)):
        raise BadInput(
            f"--set model.remat_budget has no effect with model.remat={r.model.remat}",
            "add --set model.remat=budget, or drop model.remat_budget",
        )


def load_recipe(
    recipe: str | None = None,
    stage: int | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    model: str | None = None,
) -> Recipe:
    path = resolve_recipe_path(recipe, stage, model)
    return recipe_from_dict(load_raw(path), str(path), overrides, path.parent)


def start_note(recipe: Recipe) -> str | None:
    """What a shipped stage starts from, for the person about to run it (STAGE_STARTS); None for a
    recipe that starts from its own initialisation."""
    if recipe.name not in STAGE_STARTS:
        return None
    before, how = STAGE_STARTS[recipe.name]
    prev = load_recipe(before)
    step, n, p = prev.train.max_steps, recipe.stage, prev.stage
    ckpt = f"STAGE{p}_RUN_DIR/checkpoints/{step}"
    where = f"stage {n} starts from a stage-{p} checkpoint ({before}'s final step, {step:,})"
    if how == "warm-adam":
        return (
            f"{where} with warm-Adam surgery: `olmo-ctl surgery warm-adam {ckpt} RUN_DIR` writes the new "
            "run's checkpoint 0 (parameters and Adam moments, step 0), which the run then starts from; "
            "without it the run trains from random weights (docs/recipes.md)"
        )
    if how == "start-from":
        return (
            f"{where}: `olmo-ctl resume-until-done RUN ... --start-from {ckpt}` starts each ingredient from "
            "it with warm-Adam surgery (docs/ingredients.md)"
        )
    return (
        f"stage {n} starts from the soup of a stage-{p} run of ingredients (STAGE{p}_RUN_DIR/soup: its "
        "parameters, fresh Adam moments) with the trainer's --init-from (docs/recipes.md)"
    )


def load_model(model: str) -> ModelConfig:
    """A model file by name (recipes/models/NAME.yaml) or path."""
    path = _reference(model, "model", "<model>", Path.cwd())
    return _build(ModelConfig, load_raw(path, "model file"), "model", str(path))
