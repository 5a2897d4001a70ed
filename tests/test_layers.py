"""The package's layers: every import of our own modules (at the top of a file or inside a function)
points to the importer's own layer or a lower one, never up; and no module reaches itself again
through the modules it imports when it runs (no import cycle; an import under `if TYPE_CHECKING:`,
for annotations only, never runs).

    core < storage, ports < rundir, data < trainer < checkpoints < trainer.__main__ < backends
         < preflight < observe < supervise < sandbox < cli

(`evaluation`, pure functions that score generated text, shares core's layer and imports only core;
`rundir` and `data` share a layer, and so do `storage` and `ports` (a free TCP port: the lowest layer
that may do I/O); the package's `__init__` (its version) is with core, `__main__` with cli.) The
trainer's entry point (`python -m olmo_ctl.trainer`) is a layer of its own above `checkpoints`: it
runs the training loop, or an eval job (`--eval SPEC`, `checkpoints/evaluate.py`), and nothing
imports it. A module of a layer may import its own layer or any lower one; `observe` and
`supervise` reach the trainer only through `checkpoints`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "olmo_ctl"
LAYERS = [
    ("core", "__init__", "evaluation"),
    ("storage", "ports"),
    ("rundir", "data"),
    "trainer",
    "checkpoints",
    "trainer.__main__",
    "backends",
    "preflight",
    "observe",
    "supervise",
    "sandbox",
    ("cli", "__main__"),
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in ((layer,) if isinstance(layer, str) else layer)}
ENTRY_POINTS = {"olmo_ctl.trainer.__main__": "trainer.__main__"}  # a module that is a layer of its own


def layer_of(module: str) -> str:
    """`olmo_ctl.backends.gke` -> `backends`; the package itself (`olmo_ctl`) -> `__init__`."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, its relative dots resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(source: str, me: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import of an olmo_ctl module in `source` (module `me`), wherever it stands."""
    package = me if is_package else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            if mod == "olmo_ctl":  # `from olmo_ctl import storage` names a module; `__version__` does not
                out += [
                    (
                        node.lineno,
                        f"olmo_ctl.{a.name}"
                        if (PACKAGE / f"{a.name}.py").exists() or (PACKAGE / a.name).is_dir()
                        else "olmo_ctl",
                    )
                    for a in node.names
                ]
            else:
                out.append((node.lineno, mod))
    return [(ln, m) for ln, m in out if m == "olmo_ctl" or m.startswith("olmo_ctl.")]


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = layer_of(module_name(path))
        assert me in RANK, f"{path}: layer `{me}` is not in the table"
        for line, mod in imports_of(path):
            other = layer_of(mod)
            assert other in RANK, f"{path}:{line}: `{mod}` is in no layer"
            if RANK[other] > RANK[me]:
                bad.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {mod} ({other} is above {me})"
                )
    return bad


def test_no_import_points_up_a_layer():
    assert violations() == []


def test_observe_and_supervise_reach_the_trainer_only_through_checkpoints():
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {mod}"
        for package in ("observe", "supervise")
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, mod in imports_of(path)
        if layer_of(mod) in ("trainer", "trainer.__main__")
    ]
    assert bad == []


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`: the test of a block only type checkers run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (its `else:` runs, so it is kept)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return out


def modules_imported(source: str, me: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The olmo_ctl modules (of `modules`) that `source` (module `me`) imports when it runs, wherever
    the import stands: `from olmo_ctl.trainer import data` imports `olmo_ctl.trainer.data`, `from
    olmo_ctl.trainer.data import BatchLoader` imports it too; a name that is no module of ours
    counts as its nearest enclosing one. An import under `if TYPE_CHECKING:` is for annotations
    only (never run), so it makes no cycle."""
    package = me if is_package else me.rpartition(".")[0]
    names: list[str] = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            names += [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("olmo_ctl") and name != me:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {
        m: modules_imported(p.read_text(), m, set(paths), p.name == "__init__.py") for m, p in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another in a ring (Tarjan's strongly connected
    components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while not ring or ring[-1] != v:
                ring.append(stack.pop())
            if len(ring) > 1:
                out.append(sorted(ring))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_function_level_import():
    modules = {"olmo_ctl.a", "olmo_ctl.b", "olmo_ctl.pkg", "olmo_ctl.pkg.c"}
    a = modules_imported("from olmo_ctl.b import x\n", "olmo_ctl.a", modules)
    b = modules_imported("def f():\n    from olmo_ctl.pkg import c\n", "olmo_ctl.b", modules)
    c = modules_imported("def g():\n    from .. import a\n", "olmo_ctl.pkg.c", modules)
    assert (a, b, c) == ({"olmo_ctl.b"}, {"olmo_ctl.pkg.c"}, {"olmo_ctl.a"})
    assert cycles({"olmo_ctl.a": a, "olmo_ctl.b": b, "olmo_ctl.pkg.c": c, "olmo_ctl.pkg": set()}) == [
        ["olmo_ctl.a", "olmo_ctl.b", "olmo_ctl.pkg.c"]
    ]


def test_the_cycle_finder_leaves_out_an_import_for_type_checkers_only():
    modules = {"olmo_ctl.a", "olmo_ctl.b", "olmo_ctl.c"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n"
        "    from olmo_ctl.b import B\n"
        "else:\n"
        "    from olmo_ctl.c import C\n"
        "if typing.TYPE_CHECKING:\n"
        "    import olmo_ctl.b\n"
        "def f():\n"
        "    if TYPE_CHECKING:\n"
        "        from olmo_ctl import b\n"
    )
    a = modules_imported(source, "olmo_ctl.a", modules)
    b = modules_imported("from olmo_ctl.a import x\n", "olmo_ctl.b", modules)
    assert (a, b) == ({"olmo_ctl.c"}, {"olmo_ctl.a"})
    assert cycles({"olmo_ctl.a": a, "olmo_ctl.b": b, "olmo_ctl.c": set()}) == []


def test_the_walk_sees_every_kind_of_import():
    source = (
        "from olmo_ctl import storage, __version__\n"
        "def f():\n"
        "    from olmo_ctl.cli import app\n"
        "    import olmo_ctl.supervise.attempts\n"
        "    from ..observe import monitor\n"
        "    from . import names\n"
    )
    found = imports_in(source, "olmo_ctl.core.x")
    assert found == [
        (1, "olmo_ctl.storage"),
        (1, "olmo_ctl"),
        (3, "olmo_ctl.cli"),
        (4, "olmo_ctl.supervise.attempts"),
        (5, "olmo_ctl.observe"),
        (6, "olmo_ctl.core"),
    ]
    ups = [m for _, m in found if RANK[layer_of(m)] > RANK["core"]]
    assert ups == ["olmo_ctl.storage", "olmo_ctl.cli", "olmo_ctl.supervise.attempts", "olmo_ctl.observe"]
