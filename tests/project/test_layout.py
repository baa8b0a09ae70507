"""The package layout (docs/ARCHITECTURE.md): imports between `encode_server`'s packages go one way,
downwards along the flow, with no cycle; the shared pipeline imports no protocol front, and no front another;
every package says its job. The top-level `processors` package is the bottom room: the model layer imports it,
and it imports nothing of `encode_server`."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import encode_server
import processors

pytestmark = pytest.mark.quick

PACKAGE = Path(encode_server.__file__).parent
PROCESSORS = Path(processors.__file__).parent

#: The protocol fronts: each package under `encode_server/fronts/` is a room of its own.
FRONTS = {"fronts.native", "fronts.sglang", "fronts.vllm"}
#: Bottom to top. A module may import its own room and the rooms of lower layers only.
LAYERS = [
    {"processors"},  # the top-level package beside `encode_server`: media -> a tower's inputs
    {"models"},
    {"ops", "records"},
    {"media", "delivery", "scheduling", "transport"},
    {"parallel"},
    {"preprocessing"},
    {"engine", "cache", "admission", "responses"},
    {"service"},
    {"assembly"},  # builds the service's parts; the runtime uses it
    {"fronts"},  # what every front shares: the `Front` shape, reading bodies
    FRONTS,
    {"runtime"},
    {"http", "receiver"},
    {"__main__"},
    {"bench"},
]
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}
#: The shared pipeline: every room below the fronts, which serves all of them and names none.
PIPELINE = {room for room, level in LEVEL.items() if level < LEVEL["fronts"]}


def room_of(module: str) -> str:
    """`encode_server.scheduling.policy` -> `scheduling`; `encode_server.service` -> `service`;
    `encode_server.fronts.vllm.producer` -> `fronts.vllm`; `encode_server.fronts.base` -> `fronts`; anything of the
    top-level `processors` package -> `processors`."""
    parts = module.split(".")
    if parts[0] == "processors":
        return "processors"
    if parts[1] == "fronts" and len(parts) > 2 and (PACKAGE / "fronts" / parts[2]).is_dir():
        return f"fronts.{parts[2]}"
    return parts[1]


def imports() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the modules where that import is written (anywhere in the file)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in [*PACKAGE.rglob("*.py"), *PROCESSORS.rglob("*.py")]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts  # both packages sit in the repository root
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
                ours = name.startswith("encode_server.") or name == "processors" or name.startswith("processors.")
                if ours and room_of(name) != room_of(module):
                    found.setdefault((room_of(module), room_of(name)), []).append(module)
    return found


def test_every_module_is_in_a_room_of_the_layout():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    fronts = {f"fronts.{path.parent.name}" for path in (PACKAGE / "fronts").glob("*/__init__.py")}
    rooms = packages | modules | fronts | {"processors"}
    assert rooms == set(LEVEL), "add the new room to LAYERS here and to docs/ARCHITECTURE.md"


def test_imports_go_down_the_layers_only():
    upward = {edge: modules for edge, modules in imports().items() if LEVEL[edge[1]] > LEVEL[edge[0]]}
    assert upward == {}


def test_the_model_layer_imports_nothing_of_the_server_but_processors():
    assert {edge: modules for edge, modules in imports().items() if edge[0] == "models" and edge[1] != "processors"} \
        == {}


def test_processors_import_nothing_of_the_server():
    """`processors` is a package of its own: no import of `encode_server` anywhere in it (at the top or inside a
    function), and no module name of it in a string handed to an importer."""
    assert {edge: modules for edge, modules in imports().items() if edge[0] == "processors"} == {}
    for path in PROCESSORS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        named = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and
                 isinstance(node.value, str) and node.value.startswith("encode_server")]
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names] + \
            [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in imported if name.split(".")[0] == "encode_server"], path
        assert not named, (path, named)


def test_no_two_rooms_import_each_other():
    edges = set(imports())
    assert [(a, b) for a, b in itertools.combinations(sorted(LEVEL), 2) if (a, b) in edges and (b, a) in edges] == []


def test_the_shared_pipeline_imports_no_front():
    assert {edge: modules for edge, modules in imports().items()
            if edge[0] in PIPELINE and edge[1].startswith("fronts")} == {}


def test_no_front_imports_another():
    assert {edge: modules for edge, modules in imports().items() if edge[0] in FRONTS and edge[1] in FRONTS} == {}


def test_every_package_says_its_job():
    for init in [*PACKAGE.glob("*/__init__.py"), *PACKAGE.glob("fronts/*/__init__.py"), *PROCESSORS.glob("__init__.py"),
                 *PROCESSORS.glob("*/__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        where = init.parent.relative_to(PACKAGE.parent)
        assert doc and len(doc) > 40, f"{where}/__init__.py needs a docstring: its job and its imports"


def test_the_architecture_page_lists_these_layers():
    """docs/ARCHITECTURE.md's `layers` block is this test's LAYERS, bottom to top, one layer a line."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    assert [set(line.split()) for line in block.splitlines() if line.strip()] == LAYERS


#: The benchmarks reach the server as its users do (its HTTP and ZMQ protocols, `bench`'s launcher and load
#: generators), never through a front's modules; the exceptions, each with its reason.
BENCHMARKS_INTO_FRONTS = {
    "benchmarks/transport.py": "times the vLLM front's NIXL producer itself against the bare library",
}


def test_the_benchmarks_import_no_front():
    root = PACKAGE.parent
    found = {}
    for path in (root / "benchmarks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            if any(name.startswith("encode_server.fronts") for name in names):
                found[str(path.relative_to(root))] = BENCHMARKS_INTO_FRONTS.get(str(path.relative_to(root)))
    assert found == BENCHMARKS_INTO_FRONTS
