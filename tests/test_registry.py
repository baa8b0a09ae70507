"""The family registry: one module per family, lookups, built-ins, and families without a TP plan."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import processors
from encode_server.parallel.tensor_parallel import shard_encoder
from processors import registry
from processors.family import Family
from processors.sharding import ShardingError

from .helpers import ROOT, run_python_module

PROCESSORS = ROOT / "processors"


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (relative imports resolved within processors)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = f"processors.{node.module}" if node.level else node.module
            names.add(base or "processors")
    return names


def test_every_family_module_declares_a_family_and_lookups_find_it():
    found = registry.families()
    assert {"qwen2_5_vl", "qwen2_vl", "internvl", "qwen2_audio"} <= {f.name for f in found}
    for module, family in zip(registry.FAMILY_MODULES, found):
        assert isinstance(family, Family) and module.startswith("processors.")
        assert registry.family_named(family.name) is family
        for model_type in family.model_types:
            assert registry.family_for_model_type(model_type) is family
    assert registry.family_for_model_type("llava_next") is None and registry.family_named("nope") is None
    assert set(processors.BUILTIN_MODELS) >= {"tiny-qwen2.5-vl", "tiny-internvl", "tiny-qwen2-audio"}
    assert processors.BUILTIN_MODELS == registry.builtin_models()


def test_processors_know_nothing_of_the_server_and_checkpoint_imports_no_family():
    for path in PROCESSORS.glob("*.py"):
        assert not any(name.startswith("encode_server") for name in imported_modules(path)), path.name
    family_modules = set(registry.FAMILY_MODULES)
    assert not imported_modules(PROCESSORS / "checkpoint.py") & (family_modules | {"processors.registry"})


def test_importing_the_families_stays_cheap():
    code = ("import sys, processors.registry as r; r.families(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'encode_server'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registry_prints_the_readme_table():
    out = run_python_module("processors.registry")
    assert out.returncode == 0, out.stderr
    assert out.stdout == registry.family_table_markdown() and not out.stderr
    assert "| qwen2_5_vl | `qwen2_5_vl` | `tiny-qwen2.5-vl` | image, video |" in out.stdout


def test_readme_model_table_is_the_generated_one():
    readme = (ROOT / "docs" / "MODELS.md").read_text()
    assert registry.family_table_markdown() in readme, \
        "regenerate the table in docs/MODELS.md: python -m processors.registry"


def test_sharding_a_family_without_a_plan_is_refused(monkeypatch):
    adapter = processors.load_adapter("tiny-qwen2-audio", "cpu", "float32")
    planless = dataclasses.replace(registry.family_named("qwen2_audio"), shard=None)
    monkeypatch.setattr(registry, "families", lambda: (planless,))
    with pytest.raises(ShardingError, match="qwen2_audio: this family has no tensor-parallel plan"):
        shard_encoder(adapter, mesh=None)
    adapter.info = dataclasses.replace(adapter.info, family="unknown_family")
    with pytest.raises(ShardingError, match="unknown_family: this family has no tensor-parallel plan"):
        shard_encoder(adapter, mesh=None)


def test_tp_size_2_with_a_family_without_a_plan_fails_at_start_with_the_message():
    # The qwen2_5_vl family with its plan removed, in the server process (rank 0); rank 1 is a fresh process.
    code = ("import dataclasses, processors.registry as r, processors.qwen_vl as q; "
            "q.FAMILY = dataclasses.replace(q.FAMILY, shard=None); r.families.cache_clear(); "
            "from encode_server.__main__ import main; main(['--tp-size', '2', '--port', '0'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "qwen2_5_vl: this family has no tensor-parallel plan, so --tp-size must be 1" in result.stderr


def test_builtin_weights_come_from_the_fixed_seed():
    first = processors.load_adapter("tiny-internvl", "cpu", "float32").encoder.state_dict()
    second = processors.load_adapter("tiny-internvl", "cpu", "float32").encoder.state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)
