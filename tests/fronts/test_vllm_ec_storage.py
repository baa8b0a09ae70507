"""The vLLM EC storage (`fronts.vllm.connectors.example.SharedStorage`): vLLM's layout, atomic writes, the bound and the
minimum age, hits, and what is found at start-up. In-process, on a fake wall clock."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from encode_server.fronts.vllm.connectors.example import FILE_NAME, TENSOR_KEY, SharedStorage, check_identifier

pytestmark = pytest.mark.quick


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(seed: int, count: int = 4, width: int = 8, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_written_where_and_as_vllms_connector_reads_it(tmp_path):
    storage = SharedStorage(tmp_path, fsync=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = rows(1, dtype=dtype)
        storage.write(f"item-{dtype}", tensor)
        loaded = load_file(str(tmp_path / f"item-{dtype}" / FILE_NAME))
        assert list(loaded) == [TENSOR_KEY] and loaded[TENSOR_KEY].dtype == dtype
        assert torch.equal(loaded[TENSOR_KEY], tensor)
    assert storage.files == 3 and storage.stats.writes == 3
    assert storage.bytes_held == sum(path.stat().st_size for path in tmp_path.rglob(FILE_NAME))


def test_a_slice_of_a_larger_batch_is_stored_alone(tmp_path):
    batch = rows(2, count=10)
    SharedStorage(tmp_path, fsync=False).write("slice", batch[3:7])
    assert torch.equal(load_file(str(tmp_path / "slice" / FILE_NAME))[TENSOR_KEY], batch[3:7])


def test_lookup_is_a_hit_only_for_a_whole_file(tmp_path):
    storage = SharedStorage(tmp_path, fsync=False)
    assert not storage.lookup("absent") and storage.stats.hits == 0
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / ".encoder_cache.1.abc.tmp").write_bytes(b"half")
    assert not storage.lookup("partial")
    storage.write("there", rows(3))
    assert storage.lookup("there") and storage.stats.hits == 1
    assert storage.stored_rows("there") == 4 and storage.stored_rows("absent") is None


def test_identifiers_that_cannot_name_one_folder_are_refused(tmp_path):
    for bad in ("", ".", "..", "a/b", "..\\x", "a\0b", "x" * 256):
        with pytest.raises(ValueError):
            check_identifier(bad)
    assert check_identifier("b1a2" * 16) == "b1a2" * 16


def test_bound_evicts_least_recently_written_or_hit_first(tmp_path):
    clock = Clock()
    probe = SharedStorage(tmp_path / "probe", fsync=False)
    size = probe.write("x", rows(0))
    storage = SharedStorage(tmp_path / "ec", max_bytes=3 * size, min_age_s=10, clock=clock, fsync=False)
    for index in range(3):
        storage.write(f"item{index}", rows(index))
        clock.now += 20
    assert storage.lookup("item0")  # a hit: now the most recently used
    clock.now += 20
    storage.write("item3", rows(3))
    assert storage.stats.evictions == 1 and not (tmp_path / "ec" / "item1").exists()
    assert sorted(os.listdir(tmp_path / "ec")) == ["item0", "item2", "item3"]
    assert storage.bytes_held <= 3 * size and storage.files == 3


def test_nothing_younger_than_the_minimum_age_is_evicted(tmp_path):
    clock = Clock()
    size = SharedStorage(tmp_path / "probe", fsync=False).write("x", rows(0))
    storage = SharedStorage(tmp_path / "ec", max_bytes=2 * size, min_age_s=60, clock=clock, fsync=False)
    for index in range(4):
        storage.write(f"item{index}", rows(index))
        clock.now += 1
    assert storage.stats.evictions == 0 and storage.files == 4 and storage.bytes_held == 4 * size
    clock.now += 60  # all old enough now: the next write brings the storage back within the bound
    storage.write("item4", rows(4))
    assert storage.files == 2 and storage.stats.evictions == 3
    assert sorted(os.listdir(tmp_path / "ec")) == ["item3", "item4"]


def test_start_up_counts_what_is_there_oldest_first_and_clears_leftovers(tmp_path):
    clock = Clock()
    first = SharedStorage(tmp_path, fsync=False, clock=clock)
    size = first.write("old", rows(1))
    first.write("new", rows(2))
    os.utime(tmp_path / "old" / FILE_NAME, (1, 1))
    os.utime(tmp_path / "new" / FILE_NAME, (2, 2))
    (tmp_path / "new" / ".encoder_cache.9.dead.tmp").write_bytes(b"interrupted")
    again = SharedStorage(tmp_path, max_bytes=size, min_age_s=0, fsync=False, clock=clock)
    assert again.files == 2 and again.bytes_held == 2 * size
    assert not (tmp_path / "new" / ".encoder_cache.9.dead.tmp").exists()
    again.evict()
    assert os.listdir(tmp_path) == ["new"]


def test_concurrent_writers_and_readers_never_see_a_partial_file(tmp_path):
    storage = SharedStorage(tmp_path, fsync=False)
    tensor = rows(5, count=2000, width=64)
    errors: list[str] = []
    done = threading.Event()

    def read():
        while not done.is_set():
            path = tmp_path / "same" / FILE_NAME
            if path.exists():
                try:
                    if not torch.equal(load_file(str(path))[TENSOR_KEY], tensor):
                        errors.append("different rows")
                except FileNotFoundError:
                    pass
                except Exception as exc:
                    errors.append(repr(exc))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=lambda: [storage.write("same", tensor) for _ in range(10)]) for _ in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    done.set()
    reader.join()
    assert errors == []
    assert os.listdir(tmp_path / "same") == [FILE_NAME] and storage.files == 1
