"""`records`: a finished part given new timings keeps everything else it holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from encode_server.models import ItemLayout
from encode_server.records import BatchInfo, EncodedPart, Timings

pytestmark = pytest.mark.quick


def test_with_timings_keeps_every_other_field_of_the_part_and_of_its_timings():
    part = EncodedPart(embedding=torch.ones(3, 2), layouts=(ItemLayout(3, (1, 2, 6)),), batch_size=7,
                       timings=Timings(queue=1.0, preprocess=2.0, encode=3.0, transfer=4.0, prepare_cpu=1.5,
                                       forward_cpu=2.5), cached=(True,),
                       cache_tiers=("store",), batch=BatchInfo(4, "image", 7, 9, 30, "replica=0", 1.0, (1.1, 1.2),
                                                               (1.2, 1.5)))
    queued = part.with_timings(part.timings.with_queue(9.0))
    assert queued == dataclasses.replace(part, timings=dataclasses.replace(part.timings, queue=9.0))
    sent = part.with_timings(part.timings.with_transfer(5.0))
    assert sent.timings == Timings(queue=1.0, preprocess=2.0, encode=3.0, transfer=5.0, prepare_cpu=1.5,
                                   forward_cpu=2.5)
    # Every field is carried over, so one added later cannot be dropped here unnoticed.
    for field in dataclasses.fields(EncodedPart):
        if field.name != "timings":
            assert getattr(sent, field.name) is getattr(part, field.name), field.name
    assert len(dataclasses.fields(EncodedPart)) == 7 and len(dataclasses.fields(Timings)) == 6
