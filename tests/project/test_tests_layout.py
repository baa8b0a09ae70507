"""The tests' own layout: test modules by subject in packages that say their job, support in `tests/support/`,
imports one way (the tools may import the test support; no test imports a tool or another test module, and nothing
outside tests/ imports a test module; tests/bench/ alone imports `benchmarks`, the subject it tests), and tiers
declared in the modules themselves."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT, TESTS

#: Folders of tests/ that hold data, not modules.
DATA_FOLDERS = {"data", "golden", "no_torchvision", "__pycache__"}
#: Top-level folders of the repository whose modules are tools, benchmarks or scripts (run, never imported by tests).
TOOL_ROOTS = {"tools", "benchmarks", "scripts"}
#: The test folder of each tool root whose modules are tested in-process, as a package is by its own folder.
TESTED_IN = {"benchmarks": TESTS / "bench"}


def modules(root: Path) -> list[Path]:
    return [path for path in root.rglob("*.py") if not DATA_FOLDERS & set(path.relative_to(ROOT).parts)]


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, at any depth (imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_no_test_imports_a_tool_or_a_script():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in modules(TESTS)
             for line, module in imported(path) if module.split(".")[0] in TOOL_ROOTS
             and not path.is_relative_to(TESTED_IN.get(module.split(".")[0], ROOT / "nowhere"))]
    assert wrong == [], "move what the test needs into tests/support/ (or the package), and let the tool import it"


def test_no_relative_imports_in_tests():
    """Absolute `tests.support...` imports read the same from every folder."""
    wrong = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in modules(TESTS)
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert wrong == []


def test_outside_tests_only_the_support_is_imported():
    outside = [path for root in (ROOT / name for name in [*TOOL_ROOTS, "encode_server"]) if root.is_dir()
               for path in modules(root)]
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in outside
             for line, module in imported(path)
             if module.split(".")[0] == "tests"
             and (path.is_relative_to(ROOT / "encode_server") or not module.startswith("tests.support"))]
    assert wrong == []


def test_no_module_imports_a_test_module():
    """What two test modules share belongs in tests/support/."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in modules(TESTS)
             for line, module in imported(path)
             if module.split(".")[0] == "tests" and any(part.startswith("test_") for part in module.split("."))]
    assert wrong == []


def test_test_modules_are_in_subject_packages_that_say_their_job():
    assert sorted(path.name for path in TESTS.glob("test_*.py")) == [], "put it in the folder of its subject"
    assert list((TESTS / "support").rglob("test_*.py")) == [], "tests/support/ holds what tests share, no tests"
    for folder in [TESTS, *(p for p in TESTS.rglob("*") if p.is_dir())]:
        if DATA_FOLDERS & set(folder.relative_to(ROOT).parts):
            continue
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(ROOT)} needs an __init__.py (test modules' names are per package)"
        if folder != TESTS:
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc) > 30, f"{init.relative_to(ROOT)} needs a docstring: what its modules test"


def marks(tree: ast.Module) -> set[str]:
    """`quick` / `slow` where the module marks itself or a test with them."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in ("quick", "slow")
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"}


def test_tiers_are_declared_by_the_modules_and_quick_ones_hold_nothing_slow():
    conftest = (TESTS / "conftest.py").read_text()
    assert "add_marker(pytest.mark.quick)" not in conftest, "a module joins the quick tier with its own pytestmark"
    quick = []
    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        declared = [node for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
        if declared and "quick" in marks(ast.Module(body=declared, type_ignores=[])):
            quick.append(path)
            assert "slow" not in marks(tree), f"{path.relative_to(ROOT)} is quick: move its slow test elsewhere"
    assert len(quick) >= 30, "the quick tier lost its modules"
