"""The family registry: one module per family, lookups, built-ins, and families without a TP plan."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encode_server import models
from encode_server.models import registry
from encode_server.models.family import Family
from encode_server.models.sharding.blocks import ShardingError
from encode_server.parallel.tensor_parallel import shard_encoder
from tests.support.helpers import ROOT, run_python_module

MODELS = ROOT / "encode_server" / "models"


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (for `from a import b`, both `a` and `a.b`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: the model layer imports absolutely"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_family_module_declares_a_family_and_lookups_find_it():
    found = registry.families()
    assert {"qwen2_5_vl", "qwen2_vl", "internvl", "qwen2_audio"} <= {f.name for f in found}
    for module, family in zip(registry.FAMILY_MODULES, found):
        assert isinstance(family, Family)
        assert module == f"encode_server.models.families.{family.name}" or family.name == registry.FALLBACK_FAMILY
        assert registry.family_named(family.name) is family
        for model_type in family.model_types:
            assert registry.family_for_model_type(model_type) is family
    assert registry.family_for_model_type("llava_next") is None and registry.family_named("nope") is None
    assert set(models.BUILTIN_MODELS) >= {"tiny-qwen2.5-vl", "tiny-internvl", "tiny-qwen2-audio"}
    assert models.BUILTIN_MODELS == registry.builtin_models()


def test_every_family_module_is_listed():
    listed = set(registry.FAMILY_MODULES)
    on_disk = {f"encode_server.models.families.{path.stem}" for path in (MODELS / "families").glob("*.py")
               if path.stem != "__init__"}
    assert on_disk <= listed, "add the family module to FAMILY_MODULES in encode_server/models/registry.py"


def test_the_model_layer_knows_nothing_of_the_server_and_checkpoint_imports_no_family():
    for path in MODELS.rglob("*.py"):
        server = {name for name in imported_modules(path)
                  if name.startswith("encode_server") and not name.startswith("encode_server.models")}
        assert not server, path
    family_modules = set(registry.FAMILY_MODULES)
    checkpoint = imported_modules(MODELS / "loading" / "checkpoint.py")
    assert not checkpoint & (family_modules | {"encode_server.models.registry"})


def test_shared_parts_of_the_model_layer_import_no_family():
    """Families build on towers, inputs, layers, loading and sharding, never the other way round."""
    for part in ("towers", "inputs", "layers", "loading", "sharding"):
        for path in (MODELS / part).rglob("*.py"):
            imported = {name for name in imported_modules(path) if name.startswith(
                ("encode_server.models.families", "encode_server.models.generic"))}
            assert not imported, path


def test_importing_the_families_stays_cheap():
    code = ("import sys, encode_server.models.registry as r; r.families(); "
            "print(sorted({m for m in sys.modules if m == 'transformers' or m.startswith('transformers.') "
            "or m.startswith('encode_server.') and not m.startswith('encode_server.models')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registry_prints_the_readme_table():
    out = run_python_module("encode_server.models.registry")
    assert out.returncode == 0, out.stderr
    assert out.stdout == registry.family_table_markdown() and not out.stderr
    assert "| qwen2_5_vl | `qwen2_5_vl` | `tiny-qwen2.5-vl` | image, video |" in out.stdout


def test_readme_model_table_is_the_generated_one():
    readme = (ROOT / "docs" / "MODELS.md").read_text()
    assert registry.family_table_markdown() in readme, \
        "regenerate the table in docs/MODELS.md: python -m encode_server.models.registry"


def test_sharding_a_family_without_a_plan_is_refused(monkeypatch):
    adapter = models.load_adapter("tiny-qwen2-audio", "cpu", "float32")
    planless = dataclasses.replace(registry.family_named("qwen2_audio"), shard=None)
    monkeypatch.setattr(registry, "families", lambda: (planless,))
    with pytest.raises(ShardingError, match="qwen2_audio: this family has no tensor-parallel plan"):
        shard_encoder(adapter, mesh=None)
    adapter.info = dataclasses.replace(adapter.info, family="unknown_family")
    with pytest.raises(ShardingError, match="unknown_family: this family has no tensor-parallel plan"):
        shard_encoder(adapter, mesh=None)


def test_tp_size_2_with_a_family_without_a_plan_fails_at_start_with_the_message():
    # The qwen2_5_vl family with its plan removed, in the server process (rank 0); rank 1 is a fresh process.
    result = run_python_module("tests.support.no_plan_server", "--tp-size", "2", "--port", "0", timeout=180)
    assert result.returncode != 0
    assert "qwen2_5_vl: this family has no tensor-parallel plan, so --tp-size must be 1" in result.stderr


def test_builtin_weights_come_from_the_fixed_seed():
    first = models.load_adapter("tiny-internvl", "cpu", "float32").encoder.state_dict()
    second = models.load_adapter("tiny-internvl", "cpu", "float32").encoder.state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)
