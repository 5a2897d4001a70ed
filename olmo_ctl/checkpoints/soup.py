"""`surgery soup`: the weighted mean of the parameters of N checkpoints of one model, tensor by tensor.

Sources, local or gs://, mixed freely: committed training checkpoints (`<run>/checkpoints/<N>`; only
the `params` subtree of their `state` item is read, never the Adam moments) and parameter directories
written by `convert hf-to-orbax` (`{"params": ...}` + olmo_model.json), such as AI2's soup
ingredients converted from their Hugging Face revisions.

The mean is OLMo-core's (`src/scripts/merge_core_checkpoints.py`, `merge_checkpoints`): a float32
accumulator starts at zero and each source, in the order given, adds its weight times its tensor,
`acc += float32(w_i) * float32(x_i)` (a float32 product rounded, then a float32 sum rounded), with
`w_i = 1/N` unless weights are given. OLMo-core's `torch.add_(x, alpha=w)` may fuse the multiply-add
on CPUs with FMA (one rounding instead of two), so its result can differ from this one in the last
bit of an element; the order and precision are the same. The mean is stored in the sources' dtype
(float32 when they differ).

Memory: one parameter at a time, and within it one block at a time, where a block is aligned to the
stored chunks of every source and of the output (along each axis, the least common multiple of their
chunk sizes, capped at the axis): every stored chunk is decoded once and every output chunk written
whole. Peak memory is a few blocks, never the model (docs/benchmarks.md, `benchmarks/soup_memory.py`).

Output OUT: the `convert hf-to-orbax` layout (an Orbax PyTree of `{"params": ...}` written by Orbax's
own handler, with the converter's 64 MiB chunks; olmo_model.json with the model config), plus
soup.json, the manifest. `eval`, `convert orbax-to-hf`, `--init-from` and `verify` (as a reference
checkpoint) read it. Everything is checked before any tensor is read: a refusal writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from olmo_ctl.checkpoints.convert import (
    META_FILE,
    StreamedArray,
    blocks,
    chunk_shape,
    model_from_meta,
    open_param,
    orbax_path,
    read_meta,
    read_param_leaves,
    return_freed_blocks,
    write_meta,
    write_streamed,
)
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import ModelConfig
from olmo_ctl.storage import is_gcs, join, store_for

MANIFEST = "soup.json"
WEIGHT_SUM_TOLERANCE = 1e-6

# ModelConfig fields that say how a model is trained or run, not what its tensors mean: sources may
# differ in them (a converted directory is named after its Hugging Face directory, say).
RUNTIME_FIELDS = frozenset(
    {
        "name",
        "init_std",
        "param_dtype",
        "compute_dtype",
        "remat",
        "remat_budget",
        "attention",
        "softmax_vocab_size",
    }
)
ACCUMULATION = "float32: acc = 0; acc += float32(w_i) * float32(x_i) for each source i in order"


# ----------------------------------------------------------------------------- weights (pure)


def parse_weights(text: str) -> list[float]:
    """`0.5,0.25,0.25` -> [0.5, 0.25, 0.25]; anything else is bad input."""
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        raise BadInput(
            f"--weights {text!r} is not a comma-separated list of numbers", "e.g. --weights 0.5,0.25,0.25"
        ) from None
    return weights


def soup_weights(n: int, weights: list[float] | None = None) -> list[float]:
    """The weight of each of `n` sources: 1/n each by default; given weights must be one per source,
    positive and finite, and sum to 1 within WEIGHT_SUM_TOLERANCE (they are used as given, never
    rescaled)."""
    if n < 1:
        raise BadInput("soup needs at least one checkpoint", "pass the checkpoints to average")
    if weights is None:
        return [1 / n] * n
    if len(weights) != n:
        raise BadInput(
            f"--weights has {len(weights)} weights for {n} checkpoints", "give one weight per checkpoint"
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise BadInput(f"--weights {weights} are not all positive", "every weight must be > 0")
    total = math.fsum(weights)
    if abs(total - 1) > WEIGHT_SUM_TOLERANCE:
        raise BadInput(f"--weights sum to {total:.9g}, not 1", "give weights that sum to 1")
    return list(weights)


def add_weighted(acc: np.ndarray | None, x: np.ndarray, weight: float) -> np.ndarray:
    """One step of ACCUMULATION: `acc + float32(weight) * float32(x)` in float32, in place (`acc` None:
    the zero accumulator). `x` is the caller's to overwrite (a block just read): a float32 `x` is
    multiplied in place, so no third block-sized array is made."""
    x32 = x if x.dtype == np.float32 and x.flags.writeable else x.astype(np.float32)
    if acc is None:
        acc = np.zeros(x32.shape, np.float32)
    np.multiply(x32, np.float32(weight), out=x32)
    acc += x32
    return acc


# ----------------------------------------------------------------------------- sources


@dataclass
class Source:
    """One checkpoint to average: where its parameters are stored and what model they are."""

    path: str
    kind: str  # "training" | "converted"
    step: int | None  # completed steps of a training checkpoint
    item_dir: str  # the Orbax PyTree directory holding `params`
    params: dict  # the saved `params` tree: Orbax ArrayMetadata leaves (name, shape, dtype, chunks)
    leaves: dict[str, Any]  # keystr of a leaf's path under params -> its ArrayMetadata
    model: ModelConfig | None  # None: not recorded (a trainer run started without run.yaml)
    meta: dict  # olmo_model.json of a converted directory; {} for a training checkpoint
    use_zarr3: bool
    use_ocdbt: bool

    def describe(self, weight: float) -> dict:
        return {"path": self.path, "kind": self.kind, "step": self.step, "weight": weight}


def open_source(path: str, recipe: str | None = None) -> Source:
    """A Source from its path: a converted directory (olmo_model.json) or a committed step directory."""
    store = store_for(path)
    if store.exists(join(path, META_FILE)):
        meta = read_meta(path)
        hint = "convert the model again with `olmo-ctl convert hf-to-orbax`"
        params, leaves, zarr3, ocdbt = read_param_leaves(orbax_path(path), path, hint)
        try:
            model = model_from_meta(meta)
        except (KeyError, TypeError) as e:
            raise BadInput(f"`{join(path, META_FILE)}` is not a model description ({e})", hint) from None
        return Source(path, "converted", None, orbax_path(path), params, leaves, model, meta, zarr3, ocdbt)
    if not path.rstrip("/").rpartition("/")[2].isdigit():
        what = "is not a checkpoint" if _exists(path) else "does not exist"
        raise BadInput(
            f"`{path}` {what}: no {META_FILE} and not a step directory",
            "pass <run-dir>/checkpoints/<N> or a directory written by `olmo-ctl convert hf-to-orbax`",
        )
    from olmo_ctl.trainer.checkpoint import open_step

    ck, step = open_step(path)  # BadInput unless a committed step
    item_dir = join(ck.directory, str(step), "state")
    ck.close()
    params, leaves, zarr3, ocdbt = read_param_leaves(
        item_dir, path, "pass a checkpoint written by the trainer"
    )
    run_model = _run_model(path, recipe)
    return Source(path, "training", step, item_dir, params, leaves, run_model, {}, zarr3, ocdbt)


def _exists(path: str) -> bool:
    if is_gcs(path):
        files, dirs = store_for(path).list(path.rstrip("/") + "/")
        return bool(files or dirs)
    return os.path.exists(path)


def _run_model(step_dir: str, recipe: str | None) -> ModelConfig | None:
    """The model of a training checkpoint: its run's run.yaml, else `--recipe`, else unknown."""
    from olmo_ctl.rundir import RunDir

    run = step_dir.rstrip("/").rsplit("/", 2)[0]
    if store_for(run).exists(join(run, "run.yaml")):
        return RunDir(run).recipe().model
    if recipe is not None:
        from olmo_ctl.core.recipe import load_recipe

        return load_recipe(recipe).model
    return None


# ----------------------------------------------------------------------------- one model (pure)


def _shapes(src: Source) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in src.leaves.items()}


def _model_fields(cfg: ModelConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_FIELDS}


def check_one_model(sources: list[Source]) -> ModelConfig:
    """The model every source holds; a BadInput naming the first difference (parameter names and
    shapes, then the recorded model configs, then each config against its tensors)."""
    import jax

    from olmo_ctl.trainer.model import param_shapes

    first = sources[0]
    hint = "soup only checkpoints of one model"
    want = _shapes(first)
    for src in sources[1:]:
        got = _shapes(src)
        if got.keys() != want.keys():
            diff = sorted(set(got) ^ set(want))[:3]
            raise BadInput(f"`{src.path}` holds other parameters than `{first.path}` ({diff})", hint)
        for k, shape in want.items():
            if got[k] != shape:
                raise BadInput(
                    f"`{src.path}` holds a different model than `{first.path}`: params{k} is "
                    f"{got[k]}, not {shape}",
                    hint,
                )
    known = [s for s in sources if s.model is not None]
    if not known:
        raise BadInput(
            f"the model of `{first.path}` is not recorded (no run.yaml in its run directory)",
            "pass --recipe with the recipe it was trained with",
        )
    ref = known[0]
    assert ref.model is not None
    for src in known[1:]:
        assert src.model is not None
        a, b = _model_fields(ref.model), _model_fields(src.model)
        for k in a:
            if a[k] != b.get(k):
                raise BadInput(
                    f"`{src.path}` holds a different model than `{ref.path}`: {k} {b.get(k)} ≠ {a[k]}", hint
                )
    for src in known:
        assert src.model is not None
        expect = {
            jax.tree_util.keystr(k): tuple(v)
            for k, v in jax.tree_util.tree_flatten_with_path(
                param_shapes(src.model), is_leaf=lambda x: isinstance(x, tuple)
            )[0]
        }
        if expect != _shapes(src):
            mismatch = sorted(set(expect.items()) ^ set(_shapes(src).items()))[:2]
            raise BadInput(
                f"`{src.path}` holds tensors its model config does not describe ({mismatch})",
                "pass the recipe the checkpoint was trained with",
            )
    return ref.model


def output_dtype(sources: list[Source], name: str) -> np.dtype:
    dtypes = {np.dtype(s.leaves[name].dtype) for s in sources}
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)


def block_shape(shape: tuple[int, ...], chunks: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Along each axis, the least common multiple of every chunk size (capped at the axis): a grid of
    such blocks cuts no stored chunk of any source nor of the output."""
    return tuple(min(dim, math.lcm(*(c[i] for c in chunks))) for i, dim in enumerate(shape))


# ----------------------------------------------------------------------------- writing


class _MeanLeaf(StreamedArray):
    """An output parameter not yet computed: what Orbax is handed in its place. It is computed and
    written block by block when Orbax serializes it."""

    def __init__(self, name: str, parts: list[tuple[Source, float]], shape: tuple[int, ...], dtype):
        super().__init__(shape, dtype)
        self.name = name  # keystr under params
        self.parts = parts

    async def write_into(self, out, context) -> None:
        sources = [
            await open_param(src.item_dir, src.leaves[self.name], src.use_zarr3, src.use_ocdbt, context)
            for src, _ in self.parts
        ]
        chunks = [chunk_shape(self.shape, t.chunk_layout.read_chunk.shape) for t in sources]
        chunks.append(chunk_shape(self.shape, out.chunk_layout.write_chunk.shape))
        for index in blocks(self.shape, block_shape(self.shape, chunks)):
            acc = None
            for t, (_, weight) in zip(sources, self.parts, strict=True):
                acc = add_weighted(acc, await t[index].read(), weight)  # one source's block at a time
            assert acc is not None
            block = acc.astype(self.dtype, copy=False)
            await out[index].write(block, can_reference_source_data_indefinitely=True)  # no copy


def _check_destination(out: str) -> None:
    store = store_for(out)
    if is_gcs(out):
        if store.list(out.rstrip("/") + "/", recursive=True)[0]:
            raise BadInput(f"`{out}` already holds files", "soup into a new path (soup never overwrites)")
        return
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise BadInput(
            f"`{out}` already exists and is not empty", "soup into a new path (soup never overwrites)"
        )


def soup(
    checkpoints: list[str], out: str, weights: list[float] | None = None, recipe: str | None = None
) -> dict:
    """Write the weighted mean of the parameters of `checkpoints` to OUT; returns the manifest. On the
    CPU, quietly, whatever the caller's environment says (`trainer.quiet.cpu_only_while`: a supervisor
    that soups a run of ingredients starts JAX here, and libtpu's start-up would log errors on a
    machine without a TPU); the environment is restored after."""
    from olmo_ctl.trainer.quiet import cpu_only_while

    with cpu_only_while():
        return _soup(checkpoints, out, weights, recipe)


def _soup(checkpoints: list[str], out: str, weights: list[float] | None, recipe: str | None) -> dict:
    from olmo_ctl.checkpoints.surgery import quiet_orbax

    quiet_orbax()
    return_freed_blocks()
    ws = soup_weights(len(checkpoints), weights)
    _check_destination(out)
    sources = [open_source(p, recipe) for p in checkpoints]
    model = check_one_model(sources)

    first = sources[0]
    flat = {
        name: _MeanLeaf(
            name, list(zip(sources, ws, strict=True)), tuple(leaf.shape), output_dtype(sources, name)
        )
        for name, leaf in first.leaves.items()
    }
    dtypes = sorted({str(leaf.dtype) for leaf in flat.values()})
    dtype = dtypes[0] if len(dtypes) == 1 else ",".join(dtypes)
    if dtype in ("float32", "bfloat16"):
        model = dataclasses.replace(model, param_dtype=dtype)  # type: ignore[arg-type]
    import jax

    params = jax.tree_util.tree_map_with_path(lambda k, _: flat[jax.tree_util.keystr(k)], first.params)
    write_streamed(orbax_path(out), {"params": params})

    converted = next((s for s in sources if s.kind == "converted"), None)
    write_meta(
        out,
        model,
        converted.meta.get("hf_config", {}) if converted else {},
        converted.meta.get("hf_dtype") if converted else None,
    )
    store = store_for(out)
    manifest = {
        "kind": "soup",
        "out": orbax_path(out),
        "model": model.name,
        "dtype": dtype,
        "accumulation": ACCUMULATION,
        "sources": [s.describe(w) for s, w in zip(sources, ws, strict=True)],
        "tensors": len(flat),
        "parameters": sum(leaf.size for leaf in flat.values()),
        "bytes": sum(leaf.size * leaf.dtype.itemsize for leaf in flat.values()),
    }
    trained = _run_recipe(sources)
    if trained is not None:  # what `eval` of the soup defaults to: the sequence length, tokenizer, sets
        manifest["recipe"] = trained
    store.write_text(join(out, MANIFEST), json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(path: str) -> dict | None:
    """The manifest (soup.json) of the soup directory `path`, or None for anything else."""
    p = join(path.rstrip("/"), MANIFEST)
    store = store_for(p)
    if not store.exists(p):
        return None
    try:
        doc = json.loads(store.read_bytes(p).decode())
    except (ValueError, UnicodeDecodeError, NotADirectoryError, IsADirectoryError):
        return None
    return doc if isinstance(doc, dict) and doc.get("kind") == "soup" else None


def _run_recipe(sources: list[Source]) -> dict | None:
    """The recipe (run.yaml's) of the first source that is a run's training checkpoint, or None."""
    from olmo_ctl.rundir import RunDir

    for s in sources:
        if s.kind != "training":
            continue
        run = s.path.rstrip("/").rsplit("/", 2)[0]
        if store_for(run).exists(join(run, "run.yaml")):
            return RunDir(run).recipe().to_dict()
    return None
