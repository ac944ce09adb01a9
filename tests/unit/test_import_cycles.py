"""No import loops among the project's modules: the import graph, read from the source with
`ast` (top-level and function-level imports alike; `if TYPE_CHECKING:` blocks excluded, they
never run), has no cycle. A loop closed by an import inside a function still couples the two
modules both ways; the fix is a module below both (autopar/saved_program.py, cost/bounds.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the package folders (pyproject's package-dir): autopar.passes lives in passes/, ...
PACKAGES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
            "autopar.cost": ROOT / "cost", "autopar.examples": ROOT / "examples"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = [x for x in file.relative_to(folder).with_suffix("").parts if x != "__init__"]
            out[".".join([pkg, *parts])] = file
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if not _is_type_checking(node):
            stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` of a submodule
    counts as the submodule; of anything else, as the package)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, file in mods.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("autopar")}
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.startswith("autopar"):
                deps |= {owner(f"{base}.{a.name}") if f"{base}.{a.name}" in mods
                         else owner(base) for a in node.names}
        graph[name] = deps - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # api.ParallelProgram.compile imports autopar.compile inside the method
    assert "autopar.compile" in graph["autopar.api"]
    # presentation sits above the plan type: report.py registers its renderers with plan.py,
    # which imports nothing of it (nor of the timeline)
    assert "autopar.plan" in graph["autopar.report"]
    assert not {"autopar.report", "autopar.timeline"} & graph["autopar.plan"]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import loops: " + "; ".join(" <-> ".join(c) for c in found)
