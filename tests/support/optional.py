"""Optional libraries in tests: import one, or skip the module with one line that names the remedy.

`pytest.importorskip` skips only a module that is missing; Mooncake's wheel is installed by the test extra but
its binaries need the system's libibverbs1, and without it the import raises `ImportError`, which would fail
collection. This asks the server's own check (`ops.libraries.load_problem`), so the test and the server say
the same thing."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from encode_server.ops.libraries import LIBRARIES, load_problem


def import_or_skip(library: str, module: str | None = None) -> ModuleType:
    """Import `module` (default: the library's own module) or skip the calling test module, saying why."""
    problem = load_problem(library)
    if problem is not None:
        extra = LIBRARIES[library][1]
        remedy = f": pip install -e '.[{extra}]'" if problem == "not installed" else ""
        pytest.skip(f"{library} is {problem}{remedy}", allow_module_level=True)
    return importlib.import_module(module or LIBRARIES[library][0].split()[0])
