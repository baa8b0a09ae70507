"""The choice of batches in flight from measured costs (`scheduling.overlap`): a pure decision on recorded
preparation and forward times, and its running means as the traffic changes. Never timed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from encode_server.scheduling.overlap import (
    MIN_BATCHES,
    OVERLAP_FROM_SHARE,
    SERIAL_BELOW_SHARE,
    AdaptiveOverlap,
    choose_overlap,
)

pytestmark = pytest.mark.quick

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(prepare=seconds, forward=seconds, current=st.sampled_from([1, 2]))
def test_the_choice_follows_the_share_of_preparation_with_a_band_that_keeps_the_current_count(prepare, forward,
                                                                                               current):
    choice = choose_overlap(prepare, forward, current)
    share = prepare / (prepare + forward) if prepare + forward > 0 else 0.0
    if share >= OVERLAP_FROM_SHARE:
        assert choice.in_flight == 2
    elif share < SERIAL_BELOW_SHARE:
        assert choice.in_flight == 1
    else:
        assert choice.in_flight == current
    assert f"{share:.0%}" in choice.reason


def test_small_images_keep_one_batch_and_camera_images_overlap():
    # CPU means a server reported in /server_info on a 2-core VM: tiny-qwen2.5-vl, 56x56 PNGs at concurrency
    # 64, prepared in 3.95 ms of CPU for 11.1 ms of forward (where one batch in flight served more requests a
    # second); the camera checkpoint, 1280x720 and 1920x1080 JPEGs at concurrency 8, 64.7 ms preparing for
    # 61.5 ms of forward (where two served more).
    small = choose_overlap(0.00395, 0.0111, current=1)
    assert small.in_flight == 1 and "queue is not split" in small.reason
    camera = choose_overlap(0.0647, 0.0615, current=1)
    assert camera.in_flight == 2 and "prepared during the forward" in camera.reason
    assert choose_overlap(0.00395, 0.0111, current=2).in_flight == 1  # and back


def test_the_running_choice_waits_for_enough_batches_then_adapts_both_ways():
    overlap = AdaptiveOverlap(initial=1)
    for _ in range(MIN_BATCHES - 1):
        assert overlap.observe(0.0647, 0.0615).in_flight == 1  # not measured enough yet
    assert overlap.observe(0.0647, 0.0615).in_flight == 2
    changes = []
    for _ in range(40):  # the traffic turns to small images: back to one batch in flight, once
        choice = overlap.observe(0.00395, 0.0111)
        if not changes or changes[-1] != choice.in_flight:
            changes.append(choice.in_flight)
    assert changes == [2, 1]
    for _ in range(40):  # and to camera images again
        choice = overlap.observe(0.0647, 0.0615)
    assert choice.in_flight == 2
    summary = overlap.summary()
    assert summary["adaptive"] is True and summary["batches_in_flight"] == 2
    assert summary["prepare_cpu_ms"] == pytest.approx(64.7, rel=0.01)
    assert summary["forward_cpu_ms"] == pytest.approx(61.5, rel=0.01)


def test_negative_times_are_not_taken():
    overlap = AdaptiveOverlap(initial=1, min_batches=1)
    assert overlap.observe(-1.0, 0.02).in_flight == 1 and overlap.batches == 0
