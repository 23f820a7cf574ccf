"""The package's modules import one another without circles.

The graph is built from the source with ``ast``: every import statement counts, at module
level or inside a function. ``from pkg import sub`` is an edge to the submodule ``pkg.sub``,
and to ``pkg`` itself only when a name that is not a submodule is imported from it; a
package's ``__init__`` importing its own submodules (to re-export them) is no edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "python" / "ferrolm"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> its source (``.py``, or ``.pyi`` for a compiled module)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.setdefault(".".join(parts), path)
    return found


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules that one import statement ``node`` in ``module`` loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        if not is_package:
            anchor = anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    targets = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.add(sub if sub in modules else base)  # a name defined in base's own source
    return {t for t in targets if t in modules}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (see the module docstring)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.stem == "__init__"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for target in _imported(node, name, is_package, modules):
                own_submodule = is_package and target.startswith(name + ".")
                if target != name and not own_submodule:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a], or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE_ROOT, "ferrolm")
    assert len(graph) > 30 and sum(map(len, graph.values())) > 100  # the walk found the package
    assert "ferrolm.lm.functional" in graph["ferrolm.lm.model"]  # `from ferrolm.lm import functional`
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_synthetic_circle_is_found_and_named():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.d"}, "p.d": set()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    graph["p.c"] = {"p.d"}
    assert find_cycle(graph) is None
    assert find_cycle({"p.a": {"p.a"}}) == ["p.a", "p.a"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_edges_follow_submodules_not_their_package(tmp_path):
    _write(
        tmp_path,
        {
            "__init__.py": "from pkg.sub import x\nVERSION = 1\n",
            "_core.pyi": "def f() -> int: ...\n",
            "sub/__init__.py": "from . import x\n",
            "sub/x.py": "from pkg import _core\nfrom pkg.sub import y\n",
            "sub/y.py": "def later():\n    from .. import VERSION\n    import pkg.sub.x\n",
            "z.py": "import os\nfrom pkg.sub.y import later\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": set(),  # re-exporting its own submodule is no edge
        "pkg._core": set(),
        "pkg.sub": set(),
        "pkg.sub.x": {"pkg._core", "pkg.sub.y"},  # not the package pkg
        "pkg.sub.y": {"pkg", "pkg.sub.x"},  # VERSION is pkg's own; function-level imports count
        "pkg.z": {"pkg.sub.y"},
    }
    assert find_cycle(graph) == ["pkg.sub.x", "pkg.sub.y", "pkg.sub.x"]


def test_benches_use_no_private_names():
    """A bench imports what a user could: no underscore names from the package (the compiled
    core ``ferrolm._core``, a module, is the benches' to time)."""
    modules = module_names(PACKAGE_ROOT, "ferrolm")
    bad, seen = [], 0
    for path in sorted((PACKAGE_ROOT.parent.parent / "benches").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("ferrolm"):
                continue
            for alias in node.names:
                seen += 1
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in modules:
                    bad.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
    assert seen > 20
    assert not bad, "benches import private names: " + "; ".join(bad)
