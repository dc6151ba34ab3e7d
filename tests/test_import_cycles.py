"""No import cycle in trials/launch: the package's import graph, read from the source (ast), with
every import a module makes (at its top or inside a function), but none under `if TYPE_CHECKING:`.

Relative imports resolve against the importing module's package; `from PKG import NAME` is an edge
to PKG.NAME where that is a module, else to PKG (its `__init__`). A module's own parent packages,
which Python imports before it, are not edges: every submodule would otherwise form a cycle with
a package `__init__` that re-exports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nccltune"
LAUNCH = "nccltune.trials.launch"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package as its own name)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under `node`, skipping the body of `if TYPE_CHECKING:` (its `else` counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child)


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for stmt in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            out.update(alias.name for alias in stmt.names)
            continue
        if stmt.level:
            base_parts = package.split(".")
            base_parts = base_parts[:len(base_parts) - (stmt.level - 1)]
            base = ".".join(base_parts + ([stmt.module] if stmt.module else []))
        else:
            base = stmt.module or ""
        for alias in stmt.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph(modules: dict[str, Path] | None = None, roots: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """The import graph of `modules`; with `roots`, of what they reach only (a cycle through a root
    lies within it), parsing no other file."""
    modules = module_names() if modules is None else modules
    todo = [m for m in modules if not roots or any(m == r or m.startswith(f"{r}.") for r in roots)]
    graph: dict[str, set[str]] = {}
    while todo:
        name = todo.pop()
        if name not in graph:
            graph[name] = imported(name, modules[name], modules)
            todo.extend(graph[name] - graph.keys())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reads_relative_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                                      "def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("from .sub import A\n")
    graph = import_graph(module_names(pkg))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.a"}, "pkg.sub.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.sub"}}
    assert cycles(graph) == [["pkg.c", "pkg.sub", "pkg.sub.a", "pkg.sub.b"]]
    assert import_graph(module_names(pkg), roots=("pkg.sub.b",)).keys() == graph.keys() - {"pkg"}


def test_no_import_cycle_in_trials_launch() -> None:
    graph = import_graph(roots=(LAUNCH,))
    assert [c for c in cycles(graph) if any(m == LAUNCH or m.startswith(f"{LAUNCH}.") for m in c)] == []
    assert f"{LAUNCH}.base" in graph  # the graph holds the launch package's modules


def test_no_import_cycle_in_the_package() -> None:
    """Every module of nccltune, imports inside functions counted: a cycle there is one too, only
    hidden until the function runs."""
    graph = import_graph()
    assert cycles(graph) == []
    assert len(graph) > 150  # the whole package was read
