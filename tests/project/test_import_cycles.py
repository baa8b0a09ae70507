"""No import circle between any two modules of `encode_server`, however long (docs/ARCHITECTURE.md).

`test_layout.py` checks the packages; a circle can also close inside one package (a front's module and its
routes importing each other), which that test cannot see. This one reads every module's imports with `ast`
and looks for a strongly connected component of more than one module.

Every import written in a module counts, those inside functions (and under `TYPE_CHECKING`) too: an import
moved into a function to dodge a circle at start-up still makes two modules that cannot be read, tested or
replaced one without the other, which is the circle this test is about. The implicit import of a package's
`__init__` by its submodules does not count (it is Python's mechanics, not a line anyone wrote).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import encode_server

pytestmark = pytest.mark.quick

PACKAGE = Path(encode_server.__file__).parent


def modules() -> dict[str, Path]:
    """Dotted module name -> its file (a package is its `__init__.py`)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache  # parsed once for this module's tests
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the modules of `encode_server` it imports. `from package import name` is an edge to the
    submodule `package.name` when there is one, else to the package; `import a.b.c` to the longest prefix
    that is a module."""
    known = modules()

    def module_of(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            written: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                written = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            elif isinstance(node, ast.Import):
                written = [alias.name for alias in node.names]
            for target in written:
                found = module_of(target) if target.startswith("encode_server") else None
                if found is not None and found != name:
                    graph[name].add(found)
    return {name: frozenset(targets) for name, targets in graph.items()}


def circles(graph: dict[str, frozenset[str]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_finder_sees_a_circle_of_three_and_a_chain_without_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_imports_inside_functions_and_from_packages():
    graph = import_graph()
    # `load_encoder` imports the model registry inside the function.
    assert "encode_server.models.registry" in graph["encode_server.runtime"]
    assert "encode_server.service" in graph["encode_server.runtime"]


def test_no_module_imports_itself_back_through_others():
    assert circles(import_graph()) == []
