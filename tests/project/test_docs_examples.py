"""The docs' commands work as printed, in the environment the set-up makes (`source .venv/bin/activate`).

- The README's curl example and the receiver example of docs/DEPLOYMENT.md ("Routers and prefill nodes")
  are taken from the docs by their `<!-- example: NAME -->` markers and run as they are against a real
  server on loopback (only its port substituted for 30000); their output matches what the docs show.
- Every other command the docs print (`encode-server`, `encode-bench`, `python -m ...`, `python` or `bash` with a
  script under `scripts/`, `tools/` or `benchmarks/`) names a program that exists, and every flag it passes is one
  that program accepts (its `--help`). Commands of other projects (SGLang, pip, docker, kubectl, curl) are left out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache

import pytest

from tests.support.helpers import ROOT, InProcessServer, run_python_module

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
DOCUMENTED_PORT = "127.0.0.1:30000"


def example(path, name: str) -> str:
    """The code fence right after `<!-- example: name -->` in a doc."""
    text = path.read_text()
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w*\n(.*?)\n```", text, flags=re.S)
    assert match, f"{path.name} has no example {name!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def server():
    """A server as a user starts it: the defaults (the embedding cache on, which the helper turns off)."""
    with InProcessServer(env={"ENCODER_CACHE_BYTES": "auto"}) as process:
        yield process


def test_readme_curl_example_answers_as_the_readme_shows(server):
    script = example(ROOT / "README.md", "encode-an-image")
    assert DOCUMENTED_PORT in script
    done = subprocess.run(["bash", "-c", script.replace(DOCUMENTED_PORT, f"127.0.0.1:{server.port}")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    shown = re.search(r"```json\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    documented = json.loads(shown)
    assert set(answer) == set(documented)
    for key in ("req_id", "part_idx", "num_parts", "modality", "embedding_shape", "dtype", "items"):
        assert answer[key] == documented[key], key
    assert set(answer["timings_ms"]) == set(documented["timings_ms"])


def test_deployment_receiver_example_runs_as_printed(server, tmp_path):
    code = example(ROOT / "docs" / "DEPLOYMENT.md", "receiver")
    assert f'"http://{DOCUMENTED_PORT}"' in code
    script = tmp_path / "prefill_demo.py"
    script.write_text(code.replace(DOCUMENTED_PORT, f"127.0.0.1:{server.port}"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = re.search(r"With the built-in model it prints\n\n```text\n(.*?)\n```",
                      (ROOT / "docs" / "DEPLOYMENT.md").read_text(), flags=re.S).group(1)
    assert done.stdout.strip() == shown


# --- every other documented command ----------------------------------------------------------------

#: The programs of this project a documented command may start with.
OURS = ("encode-server", "encode-bench", "python", "bash")
#: The folders of this project's runnable scripts.
SCRIPT_FOLDERS = ("scripts/", "tools/", "benchmarks/")
#: Modules run with `python -m` that belong to other projects.
FOREIGN_MODULES = ("sglang.", "vllm.")


def documented_commands() -> list[tuple[str, list[str]]]:
    """(doc name, argv) of every command of this project printed in a shell fence or an inline code span."""
    found = []
    for path in DOCS:
        text = path.read_text()
        candidates, prose, fence = [], [], None
        for line in text.splitlines():
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
            elif fence is None:
                prose.append(line)
            elif fence in ("", "bash", "sh"):
                candidates.append(line)
        candidates = "\n".join(candidates).replace("\\\n", " ").splitlines()
        candidates += re.findall(r"`([^`]+)`", "\n".join(prose))
        for line in candidates:
            try:
                argv = shlex.split(" ".join(line.split()), comments=True)
            except ValueError:
                continue
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
                argv = argv[1:]
            if not argv or argv[0] not in OURS or len(argv) < 2 and argv[0] != "encode-server":
                continue
            if argv[0] == "python" and argv[1] == "-m" and (len(argv) < 3 or argv[2].startswith(FOREIGN_MODULES)):
                continue
            if argv[0] == "python" and not (argv[1] == "-m" or argv[1].startswith(SCRIPT_FOLDERS)):
                continue  # `python prefill_demo.py`: the receiver example, run above
            if argv[0] == "bash" and not argv[1].startswith(SCRIPT_FOLDERS):
                continue
            if "..." in argv:  # `python -m encode_server.bench ...`: "the same program", not a command line
                argv = argv[: argv.index("...")]
            found.append((path.name, argv))
    return found


def program_of(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command that prints the program's --help, the flags the documented command passes it)."""
    flags = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]
    if argv[0] == "encode-server":
        return [sys.executable, "-m", "encode_server"], flags
    if argv[0] == "encode-bench":
        return [sys.executable, "-m", "encode_server.bench"], flags
    if argv[0] == "bash":
        script = ROOT / argv[1]
        assert script.exists(), argv
        # scripts/serve.sh hands its arguments to encode-server; scripts/test.sh to pytest (not checked here)
        return ([sys.executable, "-m", "encode_server"], flags) if argv[1] == "scripts/serve.sh" else ([], [])
    if argv[1] == "-m":
        subcommand = [argv[3]] if len(argv) > 3 and not argv[3].startswith("-") else []
        return [sys.executable, "-m", argv[2], *subcommand], flags
    assert (ROOT / argv[1]).exists(), argv
    return [sys.executable, argv[1]], flags


def test_every_documented_program_exists():
    import importlib.util

    for doc, argv in COMMANDS:
        if argv[0] in ("python", "bash") and not argv[1] == "-m":
            assert (ROOT / argv[1]).is_file(), f"{doc}: `{' '.join(argv)}`: no such script"
        elif argv[0] == "python":
            assert importlib.util.find_spec(argv[2]) is not None, f"{doc}: `{' '.join(argv)}`: no such module"


@cache
def help_text(program: tuple[str, ...]) -> str:
    if program[1] == "-m":  # the module's entry point, forked from the test zygote (its working folder is ROOT)
        done = run_python_module(program[2], *program[3:], "--help", timeout=120)
    elif program[0] == sys.executable and program[1].endswith(".py"):  # a script: forked from the zygote too
        done = run_python_module(program[1], *program[2:], "--help", env={"PYTHONPATH": str(ROOT)}, timeout=120)
    else:
        done = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{' '.join(program[1:])} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


COMMANDS = documented_commands()
#: The programs documented with flags (a script documented without any is only checked to exist: some of
#: them have no --help and would start their work).
PROGRAMS = sorted({tuple(program_of(argv)[0]) for _, argv in COMMANDS if program_of(argv)[1]})


def test_the_docs_print_commands_of_this_project():
    names = {" ".join(program[1:]) for program in PROGRAMS}
    assert {"-m encode_server", "-m encode_server.bench", "scripts/demo_prefill.py"} <= names, names


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda program: " ".join(program[1:]))
def test_each_documented_command_passes_flags_its_program_accepts(program):
    accepted = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text(program)))
    for doc, argv in COMMANDS:
        command, flags = program_of(argv)
        if tuple(command) == program:
            unknown = [flag for flag in flags if flag not in accepted]
            assert not unknown, f"{doc}: `{' '.join(argv)}` passes {unknown}, which {' '.join(program[1:])} lacks"
