"""The preflight cache: compiled results as JSON, keyed by what can change them.

One file per (recipe fingerprint, device, remat, micro-batch, eval micro-batch, trainer version, XLA
flags) under `~/.cache/olmo-ctl/preflight/` ($OLMO_CTL_CACHE_DIR overrides the root); the trainer version is the
package version plus a hash of every trainer and preflight source, every module of ours the steps
import, and the jax / jaxlib / libtpu versions, so any change to the step or to the compilers recompiles. A cache that
cannot be read or written only costs a recompile.

Shipped results (`olmo_ctl/preflight/shipped.json`, package data): shipped recipes compiled for slices
of the catalog by `make preflight-shipped` (tools/preflight_shipped.py), keyed as above by everything
but the trainer version (`shipped_key`: the compiler versions in its place) and used only by the
trainer version that compiled them, which each records: an installed package answers from its own,
and a checkout whose trainer changed since compiles as before. tests/test_preflight.py compiles one
again and compares its figures.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

from olmo_ctl.core.devices import Device
from olmo_ctl.core.recipe import Recipe

# What a compiled result depends on: every source of the trainer package (the model, attention, the
# steps, sharding, the optimizer), the preflight package that builds the steps around them and reads
# their memory and FLOPs, every module of ours the compile imports (the recipe's model config and its
# methods, the LR schedule traced into the step, the eval micro-batch rule, the pods' XLA flags: found
# by following the imports of ENTRY_MODULE, inside functions too, so a new dependency is covered
# without being listed), and the versions of the compilers.
SOURCE_GLOBS = ("trainer/*.py", "preflight/*.py")
ENTRY_MODULE = "preflight/compile.py"
COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu")
CACHE_SCHEMA = 3  # 3: results carry the eval step's peak


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def trainer_version(package_root: Path | None = None) -> str:
    """`VERSION+HASH`: the package version and a hash of the sources and compiler versions above
    (`package_root`: the `olmo_ctl` directory to read, this installation's by default)."""
    from olmo_ctl import __version__

    root = package_root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in hashed_sources(root):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes() if p.exists() else b"")
    for name in COMPILER_PACKAGES:
        h.update(f"{name}=={_package_version(name)}".encode())
    return f"{__version__}+{h.hexdigest()[:12]}"


def hashed_sources(root: Path) -> list[Path]:
    """The files of the `olmo_ctl` directory `root` that the trainer version hashes, sorted."""
    seen: set[Path] = set()
    todo = [root / ENTRY_MODULE]
    while todo:
        p = todo.pop()
        if p not in seen and p.exists():
            seen.add(p)
            todo.extend(_imported_modules(p, root))
    return sorted(seen | {p for g in SOURCE_GLOBS for p in root.glob(g)})


def _imported_modules(path: Path, root: Path) -> list[Path]:
    """Our modules `path` imports (`from olmo_ctl.a import b`, `import olmo_ctl.a.b`), at any depth of
    the file (the heavy imports live inside functions)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "olmo_ctl":
            parts = node.module.split(".")[1:]
            names = [parts + [a.name] for a in node.names] + [parts]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "olmo_ctl"]
        else:
            continue
        out += [root.joinpath(*n).with_suffix(".py") for n in names if n]
    return [p for p in out if p.exists()]


SHIPPED_PATH = Path(__file__).with_name("shipped.json")


def compiler_versions() -> str:
    """`jax==X jaxlib==Y libtpu==Z`: what a compiled result depends on besides our sources."""
    return " ".join(f"{name}=={_package_version(name)}" for name in COMPILER_PACKAGES)


def cache_dir() -> Path:
    root = os.environ.get("OLMO_CTL_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "olmo-ctl"
    return base / "preflight"


def cache_key(
    recipe: Recipe,
    device: Device,
    per_device_batch: int,
    version: str,
    xla_flags: list[str] | tuple[str, ...] = (),
    slices: int = 1,
) -> str:
    blob = json.dumps(
        {
            "schema": CACHE_SCHEMA,
            "recipe": recipe.fingerprint(),
            "device": device.name,
            "remat": recipe.model.remat,
            "batch": per_device_batch,
            # The eval step's micro-batch: an `eval` key outside the fingerprint (Recipe.fingerprint).
            "eval_micro_batch": recipe.eval.micro_batch,
            "trainer": version,
            **({"xla_flags": list(xla_flags)} if xla_flags else {}),
            **({"slices": slices} if slices > 1 else {}),
            # Layouts outside the fingerprint (Recipe._hashed), keyed only when set.
            **({"seq_shards": recipe.train.seq_shards} if recipe.train.seq_shards else {}),
            **({"shard_group": recipe.train.shard_group} if recipe.train.shard_group else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def shipped_key(
    recipe: Recipe,
    device: Device,
    per_device_batch: int,
    xla_flags: list[str] | tuple[str, ...] = (),
    slices: int = 1,
    compilers: str | None = None,
) -> str:
    """The key of a shipped result: `cache_key` with the compiler versions in place of the trainer's, and
    `data.root` left out (where the data is read from is not in the compiled step: a run that reads its
    own copy of the mix, `--set data.root=gs://BUCKET`, answers from the same results)."""
    import dataclasses

    version = f"shipped {compilers or compiler_versions()}"
    anywhere = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, root=""))
    return cache_key(anywhere, device, per_device_batch, version, xla_flags, slices)


_SHIPPED_READ: dict[tuple[str, int, int], dict] = {}  # (path, mtime_ns, size) -> its results


def _shipped_results(path: Path | None = None) -> dict:
    """The shipped file's results by key ({} when it cannot be read), read once per version of the file."""
    path = path or SHIPPED_PATH
    try:
        st = path.stat()
        stamp = (str(path), st.st_mtime_ns, st.st_size)
        results = _SHIPPED_READ.get(stamp)
        if results is None:
            read = json.loads(path.read_text())["results"]
            results = read if isinstance(read, dict) else {}
            _SHIPPED_READ.clear()
            _SHIPPED_READ[stamp] = results
        return results
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def load_shipped(key: str, trainer: str | None = None, path: Path | None = None) -> dict | None:
    """The shipped result under `key`, compiled by trainer version `trainer` (None: by any), or None (no
    such result, another trainer's, or no readable file). A copy: the caller may change it."""
    hit = _shipped_results(path).get(key)
    if not isinstance(hit, dict) or (trainer is not None and hit.get("trainer_version") != trainer):
        return None
    return copy.deepcopy(hit)


def shipped_compile_s(
    recipe_name: str,
    *,
    n_layers: int | None = None,
    head_dim: int | None = None,
    remat: str | None = None,
    path: Path | None = None,
) -> float | None:
    """The longest compile among the shipped results of `recipe_name` (any slice; with `n_layers`,
    `head_dim`, `remat`, only those compiled so), for the expected duration of a compile that is not
    shipped; None when none is."""
    want = {"n_layers": n_layers, "head_dim": head_dim, "remat": remat}
    try:
        times = [
            float(r["compile_s"])
            for r in _shipped_results(path).values()
            if isinstance(r, dict)
            and r.get("recipe") == recipe_name
            and all(v is None or r.get(k) == v for k, v in want.items())
        ]
    except (ValueError, KeyError, TypeError):
        return None
    return max(times) if times else None


def _cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def load_cached(key: str) -> dict | None:
    try:
        return json.loads(_cache_path(key).read_text())
    except (OSError, ValueError):
        return None


def store_cached(key: str, result: dict) -> None:
    path = _cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written only costs a recompile
