"""The deployment files parse, and configure the server only through settings it has."""

from __future__ import annotations

import re
import subprocess

import yaml

from encode_server.ops.settings import OPTIONS

from .helpers import ROOT

DEPLOY = ROOT / "deploy"
KNOWN_VARIABLES = {option.env_var for option in OPTIONS}
KNOWN_FLAGS = {option.flag for option in OPTIONS}


def test_shell_scripts_are_valid_and_use_real_flags():
    scripts = sorted(DEPLOY.glob("*.sh"))
    assert {p.name for p in scripts} >= {"single-gpu.sh", "tensor-parallel.sh", "data-parallel.sh", "multi-node.sh"}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert text.splitlines()[1].startswith("#"), f"{script.name} should explain itself"
        for flag in re.findall(r"(--[a-z][a-z-]+)", text):
            assert flag in KNOWN_FLAGS, f"{script.name}: unknown flag {flag}"


def test_kubernetes_deployment_probes_health_and_sets_known_variables():
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "encode-server.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"Deployment", "Service"}
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    names = {entry["name"] for entry in container["env"]}
    assert names and names <= KNOWN_VARIABLES, names - KNOWN_VARIABLES
    assert kinds["Service"]["spec"]["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]


def test_systemd_unit_runs_the_server_with_an_environment_file():
    unit = (DEPLOY / "systemd" / "encode-server.service").read_text()
    assert "ExecStart=" in unit and "encode-server" in unit and "EnvironmentFile=" in unit
    assert "KillSignal=SIGTERM" in unit
