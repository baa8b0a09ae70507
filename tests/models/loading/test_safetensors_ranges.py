"""Reading some tensors of safetensors files by byte range, and which `--model` values are Hub ids."""

from __future__ import annotations

import io
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from encode_server.models.loading.hub import HubId, parse_hub_id
from encode_server.models.loading.safetensors_ranges import SafetensorsFormatError, copy_tensors, read_header

pytestmark = pytest.mark.quick


class CountingFile(io.FileIO):
    """A local file that records every read: (offset, length)."""

    reads: list[tuple[int, int]]

    def read(self, size: int = -1) -> bytes:
        offset = self.tell()
        data = super().read(size)
        self.reads.append((offset, len(data)))
        return data


def opener(folder: Path, log: dict[str, list[tuple[int, int]]]):
    @contextmanager
    def open_file(name: str):
        handle = CountingFile(folder / name, "r")
        handle.reads = log.setdefault(name, [])
        with handle:
            yield handle

    return open_file


def test_copy_reads_only_the_chosen_tensors_and_writes_them_unchanged(tmp_path):
    tensors = {
        "a.f16": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "b.f32": torch.arange(5, dtype=torch.float32),
        "c.i64": torch.arange(3, dtype=torch.int64),
        "d.bf16": torch.ones(7, dtype=torch.bfloat16),
        "e.u8": torch.arange(3, dtype=torch.uint8),
        "f.empty": torch.zeros(0, 4),
        "skip.big": torch.randn(1000),
    }
    save_file({k: v for k, v in tensors.items() if k < "d"}, str(tmp_path / "one.safetensors"), {"format": "pt"})
    save_file({k: v for k, v in tensors.items() if k >= "d"}, str(tmp_path / "two.safetensors"))
    log: dict[str, list[tuple[int, int]]] = {}
    open_file = opener(tmp_path, log)
    headers = {}
    for name in ("one.safetensors", "two.safetensors"):
        with open_file(name) as handle:
            headers[name] = read_header(handle, name)
    chosen = {"a.f16": "one.safetensors", "c.i64": "one.safetensors", "b.f32": "one.safetensors",
              "d.bf16": "two.safetensors", "e.u8": "two.safetensors", "f.empty": "two.safetensors"}
    progressed: dict[str, int] = {}

    def progress(name: str, total: int):
        class Bar:
            def update(self, n: int) -> None:
                progressed[name] = progressed.get(name, 0) + n

        progressed[name] = 0
        return nullcontext(Bar())

    log.clear()
    read = copy_tensors(open_file, headers, chosen, tmp_path / "out.safetensors", progress)
    wanted = sum(tensors[k].numel() * tensors[k].element_size() for k in chosen)
    assert read == wanted == sum(progressed.values())
    assert sum(length for reads in log.values() for _, length in reads) == wanted, "no byte beyond the tensors"
    assert len(log["one.safetensors"]) == 1, "back-to-back tensors are one read"
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(chosen) and handle.metadata() == {"format": "pt"}
        for key in chosen:
            got = handle.get_tensor(key)
            assert got.dtype == tensors[key].dtype and torch.equal(got, tensors[key]), key


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with open(tmp_path / "bad.safetensors", "rb") as handle, pytest.raises(SafetensorsFormatError, match="bad"):
        read_header(handle, "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with open(tmp_path / "short.safetensors", "rb") as handle, pytest.raises(SafetensorsFormatError, match="cut"):
        read_header(handle, "short.safetensors")


@pytest.mark.parametrize("model,expected", [
    ("Qwen/Qwen2.5-VL-7B-Instruct", HubId("Qwen/Qwen2.5-VL-7B-Instruct")),
    ("org/tiny@main", HubId("org/tiny", "main")),
    ("org/tiny@refs/pr/1", HubId("org/tiny", "refs/pr/1")),
    ("org/tiny@" + "a" * 40, HubId("org/tiny", "a" * 40)),
    ("tiny-qwen2.5-vl", None), ("/models/qwen", None), ("./org/name", None), ("a/b/c", None),
    ("org/", None), ("org/name@", None), ("org/na--me", None), ("org/name.", None), ("org name/x", None),
])
def test_which_model_values_are_hub_ids(model, expected):
    assert parse_hub_id(model) == expected
