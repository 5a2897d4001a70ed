"""The package's layers: every import of our own modules (at the top of a file or inside a function)
points to the importer's own layer or a lower one, never up.

    core < storage, ports < rundir, data < trainer < backends < preflight < observe < supervise < sandbox < cli

(`rundir` and `data` share a layer, and so do `storage` and `ports` (a free TCP port: the lowest layer
that may do I/O); the package's `__init__` (its version) is with core, `__main__` with cli.) A module of a layer may import its own layer or any lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "olmo_ctl"
LAYERS = [
    ("core", "__init__"),
    ("storage", "ports"),
    ("rundir", "data"),
    "trainer",
    "backends",
    "preflight",
    "observe",
    "supervise",
    "sandbox",
    ("cli", "__main__"),
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in ((layer,) if isinstance(layer, str) else layer)}


def layer_of(module: str) -> str:
    """`olmo_ctl.backends.gke` -> `backends`; the package itself (`olmo_ctl`) -> `__init__`."""
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


def imports_in(source: str, me: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import of an olmo_ctl module in `source` (module `me`), wherever it stands."""
    package = me if is_package else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
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
