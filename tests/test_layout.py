"""The package layout (docs/ARCHITECTURE.md): imports between `encode_server`'s packages go one way,
downwards along the flow, with no cycle; every package says its job."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import encode_server

PACKAGE = Path(encode_server.__file__).parent

#: Bottom to top. A module may import its own room and the rooms of lower layers only.
LAYERS = [
    {"models"},
    {"ops", "records"},
    {"media", "delivery", "scheduling", "transport"},
    {"parallel"},
    {"preprocessing"},
    {"engine", "cache", "admission", "responses"},
    {"service"},
    {"vllm_producer"},
    {"fronts"},
    {"http", "receiver"},
    {"__main__"},
    {"bench"},
]
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def room_of(module: str) -> str:
    """`encode_server.scheduling.policy` -> `scheduling`; `encode_server.service` -> `service`."""
    return module.split(".")[1]


def imports() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the modules where that import is written (anywhere in the file)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module == "encode_server":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith("encode_server.") and room_of(name) != room_of(module):
                    found.setdefault((room_of(module), room_of(name)), []).append(module)
    return found


def test_every_module_is_in_a_room_of_the_layout():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    rooms = packages | modules
    assert rooms == set(LEVEL), "add the new room to LAYERS here and to docs/ARCHITECTURE.md"


def test_imports_go_down_the_layers_only():
    upward = {edge: modules for edge, modules in imports().items() if LEVEL[edge[1]] > LEVEL[edge[0]]}
    assert upward == {}


def test_the_model_layer_imports_nothing_of_the_server():
    assert {edge: modules for edge, modules in imports().items() if edge[0] == "models"} == {}


def test_no_two_rooms_import_each_other():
    edges = set(imports())
    assert [(a, b) for a, b in itertools.combinations(sorted(LEVEL), 2) if (a, b) in edges and (b, a) in edges] == []


def test_every_package_says_its_job():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.parent.name}/__init__.py needs a docstring: its job and its imports"
