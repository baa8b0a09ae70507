"""The machine a benchmark ran on, printed beside its figures so that figures from different machines are never
compared unawares: the CPU model, the cores this process may run on, and the torch version.

The CPU model comes from `/proc/cpuinfo`'s first "model name" line, else `lscpu`'s "Model name" line, else
`platform.processor()`; "unknown" when none says. Imports nothing heavy unless asked: torch's version is read
from the installed package's metadata, not by importing torch.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path


def field(text: str, name: str) -> str | None:
    """The value of the first `name: value` line of `text` (case-insensitive name, blanks around both trimmed)."""
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip().lower() == name.lower() and value.strip():
            return value.strip()
    return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: /proc/cpuinfo, else lscpu, else the platform's processor string."""
    try:
        found = field(cpuinfo.read_text(errors="replace"), "model name")
    except OSError:
        found = None
    if found is None:
        try:
            found = field(subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout,
                          "Model name")
        except (OSError, subprocess.SubprocessError):
            found = None
    return found or platform.processor() or "unknown"


def visible_cores() -> int:
    """The cores this process may run on (its affinity mask, which `taskset` and cgroups narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> tuple[dict, str]:
    """(the facts as a dict, one line to print): `cpu`, `cores`, `torch`, `python`."""
    facts = {"cpu": cpu_model(), "cores": visible_cores(), "torch": torch_version(),
             "python": platform.python_version()}
    line = (f"machine: {facts['cpu']}, {facts['cores']} core{'s' if facts['cores'] != 1 else ''} visible, "
            f"torch {facts['torch']}, Python {facts['python']}")
    return facts, line
