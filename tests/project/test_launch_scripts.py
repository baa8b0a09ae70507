"""scripts/serve.sh and scripts/test.sh install once, then just start: run for real (bash, sha256sum, the
scripts as shipped) in a copy of the repository's layout whose `.venv` is fake (its `python` records the pip
commands it is given instead of installing, its `encode-server` echoes), so no torch is installed here."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.helpers import ROOT

FAKE_PYTHON = """#!/usr/bin/env bash
# A venv's python that records its arguments; `-m pip` fails when FAKE_PIP_FAILS is set.
echo "$*" >> "$(dirname "$0")/../calls.log"
if [ "$1 $2" = "-m pip" ] && [ -n "${FAKE_PIP_FAILS:-}" ]; then echo "ERROR: no index" >&2; exit 1; fi
exit 0
"""
FAKE_SERVER = """#!/usr/bin/env bash
echo "encode-server $*"
"""
FAKE_SYSTEM_PYTHON = """#!/usr/bin/env bash
# python3 -m venv DIR: a fake venv.
[ "$1 $2" = "-m venv" ] || exit 9
here=$(dirname "$0")
mkdir -p "$3/bin" && cp "$here/venv-python" "$3/bin/python" && cp "$here/venv-server" "$3/bin/encode-server"
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The scripts and pyproject.toml as shipped, a python3 on PATH that makes fake venvs, and no .venv yet."""
    (tmp_path / "scripts").mkdir()
    for name in ("serve.sh", "test.sh", "venv.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_SYSTEM_PYTHON), ("venv-python", FAKE_PYTHON), ("venv-server", FAKE_SERVER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def run(repo: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in ("TORCH_INDEX_URL", "FAKE_PIP_FAILS")}
    environment["PATH"] = f"{repo / 'fakebin'}:{environment['PATH']}"
    return subprocess.run(["bash", str(repo / "scripts" / script), *args], env={**environment, **env},
                          capture_output=True, text=True, timeout=60)


def calls(repo: Path) -> list[str]:
    """The commands the fake venv's python ran since the last look."""
    log = repo / ".venv" / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


TORCH = "-m pip install --disable-pip-version-check torch==2.14.1 torchvision==0.29.1"


def test_the_first_start_installs_with_progress_then_starts_with_no_pip(repo):
    first = run(repo, "serve.sh", "--port", "30001")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "encode-server --port 30001\n"
    assert calls(repo) == [TORCH, "-m pip install --disable-pip-version-check -e ."]
    assert "installing torch 2.14.1 and torchvision 0.29.1" in first.stderr and "a few minutes" in first.stderr
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in first.stderr  # the CPU-only way, said up front
    stamp = (repo / ".venv" / "encode-server-setup.stamp").read_text()
    assert "torch=2.14.1\n" in stamp and "extras=\n" in stamp
    started = time.monotonic()
    again = run(repo, "serve.sh", "--version", PIP_NO_INDEX="1", FAKE_PIP_FAILS="1")  # offline: pip would fail
    assert again.returncode == 0, again.stderr
    assert again.stdout == "encode-server --version\n" and again.stderr == ""
    assert calls(repo) == []  # no pip at all
    assert time.monotonic() - started < 5


def test_a_changed_pyproject_reinstalls_the_package_only_and_keeps_the_extras(repo):
    assert run(repo, "test.sh", "-q").returncode == 0
    assert calls(repo) == [TORCH, "-m pip install --disable-pip-version-check -e .[test]", "-m pytest -q"]
    assert run(repo, "serve.sh").returncode == 0  # the test extra holds everything the server needs
    assert calls(repo) == []
    with open(repo / "pyproject.toml", "a") as pyproject:
        pyproject.write("\n# a new dependency, say\n")
    changed = run(repo, "serve.sh")
    assert changed.returncode == 0, changed.stderr
    assert calls(repo) == ["-m pip install --disable-pip-version-check -e .[test]"]  # torch's pins did not change
    assert run(repo, "test.sh").returncode == 0 and calls(repo) == ["-m pytest"]


def test_a_serve_venv_gets_the_test_extra_when_the_tests_run(repo):
    assert run(repo, "serve.sh").returncode == 0
    calls(repo)
    assert run(repo, "test.sh").returncode == 0
    assert calls(repo) == ["-m pip install --disable-pip-version-check -e .[test]", "-m pytest"]


def test_the_cpu_index_installs_torch_from_it_once(repo):
    cpu = "https://download.pytorch.org/whl/cpu"
    assert run(repo, "serve.sh").returncode == 0
    calls(repo)
    switched = run(repo, "serve.sh", TORCH_INDEX_URL=cpu)  # no request leaves: pip is fake
    assert switched.returncode == 0, switched.stderr
    assert calls(repo) == [f"-m pip install --disable-pip-version-check --index-url {cpu} torch==2.14.1 "
                           "torchvision==0.29.1", "-m pip install --disable-pip-version-check -e ."]
    assert run(repo, "serve.sh", TORCH_INDEX_URL=cpu).returncode == 0 and calls(repo) == []
    assert run(repo, "serve.sh").returncode == 0 and calls(repo) == []  # unset: whatever build is installed


def test_a_failed_install_says_what_to_do_and_leaves_no_stamp(repo):
    failed = run(repo, "serve.sh", FAKE_PIP_FAILS="1")
    assert failed.returncode == 1 and failed.stdout == ""  # the server did not start
    assert "ERROR: no index" in failed.stderr
    assert "encode-server set-up: failed" in failed.stderr and "PIP_INDEX_URL" in failed.stderr
    assert not (repo / ".venv" / "encode-server-setup.stamp").exists()
    assert run(repo, "serve.sh").returncode == 0
    assert calls(repo)[-2:] == [TORCH, "-m pip install --disable-pip-version-check -e ."]  # tried again in full


def test_a_python_without_venv_is_told_what_to_install(repo):
    (repo / "fakebin" / "python3").write_text("#!/usr/bin/env bash\necho 'ensurepip is not available' >&2; exit 1\n")
    failed = run(repo, "serve.sh")
    assert failed.returncode == 1 and failed.stdout == ""
    assert "could not create .venv" in failed.stderr and "apt-get install python3-venv" in failed.stderr


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh -q -p no:cacheprovider" in (ROOT / ".ci" / "run").read_text()
