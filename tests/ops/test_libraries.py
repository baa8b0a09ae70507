"""The optional libraries' check: a library that is missing, one that is installed but does not load (a system
library it needs is absent, as Mooncake's binaries need libibverbs1), and one that loads."""

import sys

import pytest

from encode_server.ops import libraries

pytestmark = pytest.mark.quick


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """Register a library `fakelib` whose module the test writes under tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(libraries.LIBRARIES, "fakelib", ("fakelib_mod.engine", "fakelib", "fakelib-wheel"))

    def write(engine_source: str) -> None:
        package = tmp_path / "fakelib_mod"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / "engine.py").write_text(engine_source)
        for name in ("fakelib_mod", "fakelib_mod.engine"):
            sys.modules.pop(name, None)

    yield write
    for name in ("fakelib_mod", "fakelib_mod.engine"):
        sys.modules.pop(name, None)


def test_a_missing_library_names_the_wheel_and_the_extra(monkeypatch):
    monkeypatch.setitem(libraries.LIBRARIES, "absent", ("no_such_module_anywhere.sub", "absent", "absent-wheel"))
    assert libraries.load_problem("absent") == "not installed"
    message = libraries.missing_message("absent", "--flag")
    assert message.startswith("--flag needs the absent library, which is not installed")
    assert "pip install absent-wheel" in message and "pip install -e '.[absent]'" in message


def test_a_library_whose_system_dependency_is_absent_names_the_apt_package(fake_library):
    fake_library('raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")\n')
    problem = libraries.load_problem("fakelib")
    assert problem is not None and problem.startswith("installed but does not load (libibverbs.so.1")
    assert "apt-get install libibverbs1" in problem
    assert not libraries.installed("fakelib")
    message = libraries.missing_message("fakelib", "--cache-store")
    assert "apt-get install libibverbs1" in message and "pip install" not in message
    with pytest.raises(libraries.MissingLibrary, match="libibverbs1"):
        libraries.require("fakelib", "--cache-store")


def test_a_library_that_loads_is_installed(fake_library):
    fake_library("VALUE = 1\n")
    assert libraries.load_problem("fakelib") is None
    assert libraries.installed("fakelib")
    libraries.require("fakelib", "--flag")
