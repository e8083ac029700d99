"""The import graph of batchjob/ and kernels/: no cycles, kernels import nothing from batchjob,
the planner and the native scheduler import no torch.

Built from the source with ``ast`` (nothing is imported): every ``import`` counts, those inside
functions too (a lazy import is still an edge) and those under ``if TYPE_CHECKING:`` (a type
annotation that points up the data flow is a cycle of design, if not of runtime). ``kernels/``
is installed as ``batchjob.kernels`` (pyproject package-dir), so kernels/X is the module
batchjob.kernels.X. An edge goes to the module imported (``from p import m`` to the submodule
p.m when there is one, else to p), not to its parent packages.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = {"batchjob": ROOT / "batchjob", "batchjob.kernels": ROOT / "kernels"}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str  # a module of the tree, or the top-level name of an outside one
    line: int
    text: str  # the import as written, e.g. "from ..meta import X"
    lazy: bool = False  # inside a function: runs when called, not at import
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: a cycle edge, never run


def module_files() -> dict[str, Path]:
    mods = {}
    for prefix, folder in TREES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if prefix == "batchjob" and name.startswith("batchjob.kernels"):
                continue  # a stray batchjob/kernels would be shadowed by the remap
            mods[name] = f
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


Imports = list[tuple[ast.Import | ast.ImportFrom, bool, bool]]
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imports(tree: ast.AST) -> Imports:
    """Every import node at any depth, with whether it is inside a function and whether it is
    under ``if TYPE_CHECKING:`` (which never runs)."""
    found: Imports = []

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True, True)
            for child in node.orelse:
                visit(child, lazy, typing_only)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, lazy, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, lazy or isinstance(node, FUNCTIONS), typing_only)

    visit(tree, False, False)
    return found


def _canonical(name: str) -> str:
    return "batchjob." + name if name == "kernels" or name.startswith("kernels.") else name


@cache
def graph() -> tuple[dict[str, list[Edge]], frozenset[str]]:
    files = module_files()
    mods = frozenset(files)

    def target(name: str) -> str:
        """The deepest module of the tree that ``name`` names, else its top-level name."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return parts[0]

    edges: dict[str, list[Edge]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        out = edges.setdefault(mod, [])
        source = path.read_text()
        for node, lazy, typing_only in _imports(ast.parse(source, filename=str(path))):
            text = ast.get_source_segment(source, node) or ast.dump(node)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    dst = target(_canonical(alias.name))
                    out.append(Edge(mod, dst, node.lineno, text, lazy, typing_only))
                continue
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = _canonical(node.module or "")
            for alias in node.names:
                sub = f"{pkg}.{alias.name}"
                dst = sub if sub in mods else target(pkg)
                out.append(Edge(mod, dst, node.lineno, text, lazy, typing_only))
    return edges, mods


def find_cycles(edges: dict[str, list[Edge]], mods: frozenset[str]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component with more than one module."""
    succ = {m: sorted({e.dst for e in edges[m] if e.dst in mods and e.dst != m}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for m in sorted(mods):
        if m not in index:
            strong(m)

    cycles = []
    for comp in sccs:
        start = min(comp)
        # breadth-first from start back to start inside the component: a shortest cycle
        prev: dict[str, Edge] = {}
        queue = [start]
        while queue and start not in prev:
            v = queue.pop(0)
            for e in edges[v]:
                if e.dst in comp and e.dst not in prev:
                    prev[e.dst] = e
                    queue.append(e.dst)
        cycle, node = [], start
        while True:
            e = prev[node]
            cycle.append(e)
            node = e.src
            if node == start:
                break
        cycles.append(cycle[::-1])
    return cycles


def describe(cycle: list[Edge]) -> str:
    return "\n".join(f"  {e.src}:{e.line}  {e.text}  -> {e.dst}" for e in cycle)


def reachable(start: set[str]) -> dict[str, list[Edge]]:
    """Every module (tree or outside) that ``start`` can bring in, with the path to it.

    ``start``'s own imports all count, those in functions too (what the package itself may
    import); beyond it only import-time ones (a helper module's lazy import serves functions
    the package may never call). Importing a module runs its parent packages first, so those
    count as reached too."""
    edges, mods = graph()
    paths: dict[str, list[Edge]] = {m: [] for m in start}
    queue = sorted(start)
    while queue:
        v = queue.pop(0)
        if v not in mods:
            continue
        parents = [".".join(v.split(".")[:i]) for i in range(1, v.count(".") + 1)]
        steps = [Edge(v, p, 0, "(parent package)") for p in parents if p in mods]
        for e in steps + edges[v]:
            if e.typing_only or (e.lazy and v not in start):
                continue
            if e.dst not in paths:
                paths[e.dst] = [*paths[v], e]
                queue.append(e.dst)
    return paths


def test_graph_sees_the_whole_tree():
    edges, mods = graph()
    assert {"batchjob.cli", "batchjob.plan.build", "batchjob.kernels.meta"} <= mods
    assert "batchjob.kernels.triton.wrappers" in mods
    # a relative import in kernels resolves inside batchjob.kernels
    meta_users = {e.src for es in edges.values() for e in es if e.dst == "batchjob.kernels.meta"}
    assert "batchjob.kernels.reference" in meta_users
    # the torch check can fail: the torch attention path does reach torch
    assert "torch" in reachable({"batchjob.backends.native.attention.torch_path"})


def test_cycle_finder_reports_a_cycle():
    """The checker itself can fail: a made-up three-module circle is found and printed."""
    mods = frozenset({"a", "b", "c", "d"})
    edges = {
        "a": [Edge("a", "b", 1, "import b")],
        "b": [Edge("b", "c", 2, "import c"), Edge("b", "d", 3, "import d")],
        "c": [Edge("c", "a", 4, "import a")],
        "d": [],
    }
    (cycle,) = find_cycles(edges, mods)
    assert [e.src for e in cycle] == ["a", "b", "c"] and cycle[-1].dst == "a"
    assert "c:4  import a  -> a" in describe(cycle)


def test_no_import_cycles():
    edges, mods = graph()
    cycles = find_cycles(edges, mods)
    if cycles:
        pytest.fail("import cycles:\n" + "\n\n".join(describe(c) for c in cycles))


def test_kernels_import_nothing_from_batchjob():
    edges, _ = graph()
    bad = [
        e
        for src, es in edges.items()
        if src.startswith("batchjob.kernels")
        for e in es
        if (e.dst == "batchjob" or e.dst.startswith("batchjob."))
        and not (e.dst.startswith("batchjob.kernels") and e.text.lstrip().startswith("from ."))
    ]
    assert not bad, "kernels/ must import nothing from batchjob (relative imports only):\n" + (
        "\n".join(f"  {e.src}:{e.line}  {e.text}" for e in bad)
    )


@pytest.mark.parametrize("package", ["batchjob.plan", "batchjob.backends.native.scheduler"])
def test_torch_free(package):
    _, mods = graph()
    start = {m for m in mods if m == package or m.startswith(package + ".")}
    assert start
    paths = reachable(start)
    if "torch" in paths:
        chain = "\n".join(f"  {e.src}:{e.line}  {e.text}" for e in paths["torch"])
        pytest.fail(f"{package} reaches torch:\n{chain}")


def test_a_type_checking_import_closes_a_cycle():
    """An import under ``if TYPE_CHECKING:`` is an edge of the graph: a type that points back
    up the data flow is reported like any other cycle."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import X\nimport c\n"
    )
    found = [(n.names[0].name, lazy, typing) for n, lazy, typing in _imports(tree)]
    assert ("X", True, True) in found and ("c", False, False) in found


def test_package_top_is_small():
    """The top of batchjob/ holds entry points and shared vocabulary; the rest lives in the
    sub-package of its stage (config, inputs, tokenize, plan, backends, outputs, run, ...)."""
    top = sorted(p.name for p in (ROOT / "batchjob").glob("*.py"))
    assert len(top) <= 8, top
    for pkg in (ROOT / "batchjob").iterdir():
        if pkg.is_dir() and pkg.name != "__pycache__":
            init = pkg / "__init__.py"
            assert init.exists(), f"{pkg.name}/ is not a package"
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc) > 40, f"batchjob/{pkg.name}/__init__.py states no contract"
