"""Deepstack on the wire: the native header's optional `deepstack`, and the receiver's `main` / `deepstack` views.

Messages are plain pyzmq frames pushed at a real `EmbeddingReceiver`, so these tests pin the wire
format itself, not only the sender's helper.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from encode_server.delivery.wire import Header, WireError, decode_header
from encode_server.receiver import EmbeddingError, EmbeddingReceiver
from tests.support.helpers import push

pytestmark = pytest.mark.quick


def header(req_id: str, shape: tuple[int, int], deepstack: int = 0, part_idx: int = 0, num_parts: int = 1) -> Header:
    return Header(req_id=req_id, part_idx=part_idx, num_parts=num_parts, modality="image", dtype="float32",
                  shape=shape, items=[{"tokens": shape[0], "grid_thw": [1, 2, 2 * shape[0]]}], deepstack=deepstack)


def rows(tokens: int, hidden: int, deepstack: int, start: float = 0.0) -> np.ndarray:
    """Rows whose block b holds values b * 1000 + ..., so a wrong split is visible."""
    blocks = [start + b * 1000 + np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden)
              for b in range(1 + deepstack)]
    return np.concatenate(blocks, axis=-1).astype("<f4")


# --- the header ------------------------------------------------------------------------------

def test_header_without_deepstack_is_byte_identical_to_the_plain_format():
    plain = header("r", (3, 8)).encode()
    assert b"deepstack" not in plain
    assert list(json.loads(plain)) == ["v", "req_id", "part_idx", "num_parts", "modality", "dtype", "shape",
                                       "items", "error"]
    assert plain == (b'{"v":1,"req_id":"r","part_idx":0,"num_parts":1,"modality":"image","dtype":"float32",'
                     b'"shape":[3,8],"items":[{"tokens":3,"grid_thw":[1,2,6]}],"error":null}')
    assert decode_header(plain).deepstack == 0


def test_header_with_deepstack_round_trips():
    encoded = header("r", (3, 12), deepstack=3).encode()
    assert json.loads(encoded)["deepstack"] == 3
    assert decode_header(encoded) == header("r", (3, 12), deepstack=3)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True, None])
def test_header_refuses_a_bad_deepstack(value):
    data = json.loads(header("r", (3, 12)).encode())
    data["deepstack"] = value
    with pytest.raises(WireError, match="deepstack"):
        decode_header(json.dumps(data).encode())


def test_header_refuses_rows_that_do_not_split_into_the_blocks():
    with pytest.raises(WireError, match="do not split"):
        decode_header(header("r", (3, 10), deepstack=2).encode())


# --- the receiver ----------------------------------------------------------------------------

def test_receiver_gives_main_and_deepstack_views_merged_over_parts():
    tokens, hidden, k = 3, 4, 2
    first, second = rows(tokens, hidden, k), rows(2, hidden, k, start=0.5)
    with EmbeddingReceiver() as receiver:
        push(receiver.port,
             [header("ds", (2, hidden * (1 + k)), k, part_idx=1, num_parts=2).encode(), second.tobytes()],
             [header("ds", (tokens, hidden * (1 + k)), k, part_idx=0, num_parts=2).encode(), first.tobytes()])
        got = receiver.get("ds", timeout=5)
    whole = np.concatenate([first, second])
    assert got.num_deepstack == k and got.tensor.shape == (5, hidden * 3)
    assert got.main.shape == (5, hidden) and torch.equal(got.main, torch.from_numpy(whole[:, :hidden]))
    assert len(got.deepstack) == k
    for block, view in enumerate(got.deepstack, start=1):
        assert torch.equal(view, torch.from_numpy(whole[:, block * hidden:(block + 1) * hidden]))
        assert view.data_ptr() == got.tensor.data_ptr() + block * hidden * 4  # a view, not a copy
    assert torch.equal(torch.cat([got.main, *got.deepstack], dim=-1), got.tensor)


def test_receiver_without_deepstack_main_is_the_whole_tensor():
    with EmbeddingReceiver() as receiver:
        push(receiver.port, [header("plain", (2, 6)).encode(), rows(2, 6, 0).tobytes()])
        got = receiver.get("plain", timeout=5)
    assert got.num_deepstack == 0 and got.deepstack == []
    assert got.main is got.tensor


def test_receiver_refuses_parts_that_disagree_on_deepstack():
    with EmbeddingReceiver() as receiver:
        push(receiver.port,
             [header("mixed", (2, 8), 1, part_idx=0, num_parts=2).encode(), rows(2, 4, 1).tobytes()],
             [header("mixed", (2, 8), 0, part_idx=1, num_parts=2).encode(), rows(2, 8, 0).tobytes()])
        with pytest.raises(EmbeddingError, match="deepstack"):
            receiver.get("mixed", timeout=5)
