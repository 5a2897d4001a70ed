"""Every code name that README.md and docs/*.md mention exists in the code they describe.

Checked, from inline code spans (`...`) in prose:
- repository paths: a span whose first part is a top-level entry of this repository
  (`tests/test_wheel.py`, `olmo_ctl/sandbox/crds/`, `recipes/smoke.yaml`) exists; a `.py` file or a
  directory named inside the package (`trainer/data.py`, `supervise/`) exists under olmo_ctl/; a bare
  `name.py` is a file of the repository or a standard-library module;
- dotted names: `olmo_ctl.x.y[.attr]`, the same without `olmo_ctl.` when it starts with a subpackage
  or module of the package (`backends.base.Attempt`), a module of the package by its own name
  (`batching.Plan`), a class of the package and its member (`RunDir.append`, `Backend.wait_gone`), a
  lower-case variable named after a class (`world.settle()` for `World`), and recipe keys
  (`train.max_steps`: a field of the recipe's `train` section). A call's arguments are not checked.
And from ```python code blocks: every `from olmo_ctl... import name` exists, and a method called on a
variable bound to one of the package's classes (`backend = GKEBackend(...)`, `with KubeServer() as
srv`) is a member of that class.

Names are resolved from the source (ast), so nothing is imported. Spans that name other projects
(`src/olmo_core/...`, `jax.distributed`), run-directory files (`run.yaml`) or event tags
(`train/PPL`) match none of these shapes' roots and are left alone.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import typing
from functools import cache
from pathlib import Path

import pytest

from olmo_ctl.core.recipe import Recipe

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "olmo_ctl"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1\s*$", re.S | re.M)
PY_BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:/[A-Za-z_]\w*)*)(\(.*\))?")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
# A dotted span ending like a file name is a file (`run.yaml`, `config.json`), not an attribute.
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "txt", "go", "j2", "npy", "csv", "tsv"}


def _ignored_names() -> set[str]:
    """Top-level names .gitignore leaves out of the repository (a local `runs/` is not documented code)."""
    names = set()
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "*" not in line:
            names.add(line.strip("/"))
    return names


TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - _ignored_names()
SUBPACKAGES = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
TOP_MODULES = SUBPACKAGES | {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
RECIPE_SECTIONS = {k: v for k, v in typing.get_type_hints(Recipe).items() if dataclasses.is_dataclass(v)}


# ----------------------------------------------------------------------------- the package's names


@dataclasses.dataclass
class ClassInfo:
    members: set[str]
    bases: list[str]


@dataclasses.dataclass
class ModuleInfo:
    names: set[str]
    imports: dict[str, str]  # local name -> "module.name" or "module" it was imported from
    classes: dict[str, ClassInfo]


def _module_file(dotted: str) -> Path | None:
    p = ROOT / Path(*dotted.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    if p.with_suffix(".py").exists():
        return p.with_suffix(".py")
    return None


def _top_statements(body: list[ast.stmt]):
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for part in (
                node.body,
                node.orelse,
                getattr(node, "finalbody", []),
                *(h.body for h in getattr(node, "handlers", [])),
            ):
                yield from _top_statements(part)


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    return []


def _class_info(node: ast.ClassDef) -> ClassInfo:
    members = set()
    for stmt in _top_statements(node.body):
        members.update(_targets(stmt))
    for sub in ast.walk(node):  # instance attributes: self.x = ... in any method
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "self"
            and isinstance(sub.ctx, ast.Store)
        ):
            members.add(sub.attr)
    # `Backend[dict]` is class Backend; `Generic[T]` stays as written (a base with no members).
    bases = [
        b.value if isinstance(b, ast.Subscript) and not ast.unparse(b).startswith("Generic[") else b
        for b in node.bases
    ]
    return ClassInfo(
        members, [b.id if isinstance(b, ast.Name) else ast.unparse(b).rsplit(".", 1)[-1] for b in bases]
    )


@cache
def module_info(dotted: str) -> ModuleInfo | None:
    path = _module_file(dotted)
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    info = ModuleInfo(set(), {}, {})
    package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    for node in _top_statements(tree.body):
        info.names.update(_targets(node))
        if isinstance(node, ast.ClassDef):
            info.classes[node.name] = _class_info(node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for a in node.names:
                info.names.add(a.asname or a.name)
                info.imports[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                info.names.add(local)
                info.imports[local] = a.name if a.asname else local
    return info


@cache
def all_modules() -> tuple[str, ...]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(parts))
    return tuple(out)


@cache
def classes_named() -> dict[str, list[ClassInfo]]:
    out: dict[str, list[ClassInfo]] = {}
    for m in all_modules():
        info = module_info(m)
        for name, c in (info.classes if info else {}).items():
            out.setdefault(name, []).append(c)
    return out


def class_has(cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether some class of the package named `cls` (or a base of it defined here) has member `attr`.
    A base from outside the package (Enum, Exception, ...) may have it too: then it is not refuted."""
    if cls in seen:
        return False
    for c in classes_named().get(cls, []):
        if attr in c.members:
            return True
        for b in c.bases:
            if _MEMBERLESS_BASE.match(b):  # abc.ABC, Generic[T], object: nothing a doc would name
                continue
            if b not in classes_named() or class_has(b, attr, seen | {cls}):
                return True
    return False


_MEMBERLESS_BASE = re.compile(r"^(ABC|object|Generic\[.*\])$")


def resolve(dotted: str) -> str | None:
    """None when `olmo_ctl.x.y.z` names something that exists, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        mod = ".".join(parts[:i])
        info = module_info(mod)
        if info is not None:
            break
    else:
        return f"no module {dotted}"
    rest = parts[i:]
    if not rest:
        return None
    name = rest[0]
    if name not in info.names:
        return f"{mod} has no `{name}`"
    if name in info.imports:  # re-exported: resolve where it comes from, when that is ours
        origin = info.imports[name]
        if origin.startswith("olmo_ctl") and origin != dotted:
            return resolve(".".join([origin, *rest[1:]]))
        return None
    if len(rest) > 1 and name in info.classes and not class_has(name, rest[1]):
        return f"{mod}.{name} has no member `{rest[1]}`"
    return None


@cache
def modules_by_stem() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in all_modules():
        out.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    return out


@cache
def class_by_variable() -> dict[str, str]:
    """`world` -> `World`, `kube_server` -> `KubeServer`: lower-case names for the package's classes."""
    out = {}
    for cls in classes_named():
        var = re.sub(r"(?<!^)(?=[A-Z])", "_", cls).lower()
        out.setdefault(var, cls)
        out.setdefault(cls.lower(), cls)
    return out


# ----------------------------------------------------------------------------- the rules


def check_path(span: str) -> str | None:
    if not PATH.fullmatch(span) or span.startswith(("/", "./", "../")) or "//" in span:
        return None
    first, _, rest = span.partition("/")
    if not rest and "/" not in span:  # a bare file name
        stem, dot, suffix = span.rpartition(".")
        if dot and suffix == "py" and stem.isidentifier():
            if stem in sys.stdlib_module_names or any(ROOT.glob(f"**/{span}")):
                return None
            return f"no file `{span}` in the repository (nor a standard-library module)"
        return None
    if first in TOP:
        return None if (ROOT / span).exists() else f"`{span}` does not exist in the repository"
    if first in SUBPACKAGES and (span.endswith((".py", "/")) or not rest):
        return None if (PKG / span).exists() else f"`{span}` does not exist under olmo_ctl/"
    return None


def check_dotted(span: str) -> str | None:
    m = DOTTED.fullmatch(span)
    if not m:
        return None
    name, call = m.group(1), m.group(2)
    if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None
    head, *alts = name.split("/")  # `RunDir.acquire_lease/heartbeat/release_lease`
    base = head.rpartition(".")[0]
    names = [head] + [f"{base}.{a}" for a in alts]
    for n in names:
        why = _check_one(n, call is not None)
        if why:
            return why
    return None


def _check_one(name: str, called: bool) -> str | None:
    """None when some reading of `name` finds it (or none applies); else why the first reading fails."""
    first, rest = name.split(".", 1)
    if first == "olmo_ctl":
        return resolve(name)
    attr = rest.split(".")[0]
    readings = []
    if first in RECIPE_SECTIONS and not called:
        fields = {f.name for f in dataclasses.fields(RECIPE_SECTIONS[first])}
        readings.append(None if attr in fields else f"the recipe's `{first}` section has no key `{attr}`")
    if first in TOP_MODULES:
        readings.append(resolve(f"olmo_ctl.{name}"))
    stems = modules_by_stem().get(first, [])
    if len(stems) == 1 and first not in TOP_MODULES:
        readings.append(resolve(f"{stems[0]}.{rest}"))
    if first in classes_named():
        readings.append(None if class_has(first, attr) else f"class {first} has no member `{attr}`")
    cls = class_by_variable().get(first)
    if cls is not None:
        readings.append(None if class_has(cls, attr) else f"`{first}` ({cls}) has no member `{attr}`")
    if not readings or None in readings:
        return None
    return readings[0]


def check_python_block(code: str) -> list[str]:
    """Imports from the package exist; methods called on variables bound to its classes exist."""
    problems = []
    tree = ast.parse(code)
    bound: dict[str, str] = {}  # variable -> class name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("olmo_ctl"):
            for a in node.names:
                why = resolve(f"{node.module}.{a.name}")
                if why:
                    problems.append(f"from {node.module} import {a.name}: {why}")
        pairs = []
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs.append((node.targets[0], node.value))
        if isinstance(node, ast.With):
            pairs.extend((item.optional_vars, item.context_expr) for item in node.items if item.optional_vars)
        for target, value in pairs:
            if (
                isinstance(target, ast.Name)
                and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id in classes_named()
            ):
                bound[target.id] = value.func.id
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            cls = bound[node.value.id]
            if not class_has(cls, node.attr):
                problems.append(f"`{node.value.id}.{node.attr}`: {cls} has no member `{node.attr}`")
    return problems


# ----------------------------------------------------------------------------- the docs


def spans_in(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span outside fenced blocks."""
    text = path.read_text()
    prose = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for n, line in enumerate(prose.splitlines(), 1):
        out.extend((n, m.group(1).strip()) for m in SPAN.finditer(line))
    return out


def problems_in(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    out = []
    for n, span in spans_in(path):
        why = (
            check_path(span)
            if "/" in span and "." not in span.split("/")[0] or span.endswith(".py")
            else None
        )
        why = why or check_dotted(span)
        if why:
            out.append(f"{rel}:{n}: `{span}`: {why}")
    text = path.read_text()
    for m in PY_BLOCK.finditer(text):
        line = text[: m.start()].count("\n") + 1
        out.extend(f"{rel}:{line}: python block: {why}" for why in check_python_block(m.group(1)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_names_exist(doc):
    problems = problems_in(doc)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the rules themselves


@pytest.mark.parametrize(
    "span",
    [
        "olmo_ctl/core/recipe.py",
        "tests/test_wheel.py",
        "olmo_ctl/sandbox/crds/",
        "trainer/data.py",
        "supervise/",
        "calendar.py",
        "kueue.py",
    ],
)
def test_existing_paths_pass(span):
    assert check_path(span) is None


@pytest.mark.parametrize(
    "span",
    [
        "olmo_ctl/core/recipes.py",
        "tests/test_nothing.py",
        "trainer/dataset.py",
        "backends/nothing/",
        "no_such_module.py",
    ],
)
def test_missing_paths_are_caught(span):
    assert check_path(span)


@pytest.mark.parametrize(
    "span",
    [
        "olmo_ctl.core.recipe",
        "olmo_ctl.storage.reset_clients()",
        "backends.base.Backend",
        "batching.Plan",
        "RunDir.append",
        "RunDir.acquire_lease/heartbeat/release_lease",
        "Backend.send",
        "train.max_steps",
        "model.forward(..., segment_ids=...)",
        "olmo_ctl.sandbox.kube_server.KubeServer",
        "world.settle()",
        # not ours, or not code: left alone
        "jax.distributed.initialize()",
        "run.yaml",
        "kueue.x-k8s.io",
        "src/olmo_core/optim/scheduler.py",
        "DataMix.build",
        "np.argsort(-lengths)",
    ],
)
def test_existing_names_pass(span):
    assert check_dotted(span) is None


@pytest.mark.parametrize(
    "span",
    [
        "olmo_ctl.core.recipes",
        "olmo_ctl.storage.reset_client()",
        "backends.base.Backnd",
        "batching.Plans",
        "RunDir.append_line",
        "RunDir.acquire_lease/heartbeat/drop_lease",
        "Backend.submit",
        "train.max_step",
        "world.settle_all()",
    ],
)
def test_missing_names_are_caught(span):
    assert check_dotted(span)


def test_python_blocks_are_checked():
    ok = (
        "from olmo_ctl.backends.gke import GKEBackend\nfrom olmo_ctl.sandbox.kube_server import KubeServer\n"
        "with KubeServer() as srv:\n    backend = GKEBackend(namespace='default', host=srv.url)\n"
        "    handle = backend.send(None)\n    srv.cluster.admit(handle.name)\n"
    )
    assert check_python_block(ok) == []
    bad = ok.replace("backend.send", "backend.submit").replace("import KubeServer", "import KubeServer, nope")
    assert check_python_block(bad) == [
        "from olmo_ctl.sandbox.kube_server import nope: olmo_ctl.sandbox.kube_server has no `nope`",
        "`backend.submit`: GKEBackend has no member `submit`",
    ]
