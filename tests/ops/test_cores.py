"""The cores a process may use: its affinity, bounded by a container's CPU quota (cgroup v2 or v1)."""

from __future__ import annotations

import os

import pytest

from encode_server.ops.cores import quota_cores, usable_cores

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(("v2", "v1", "cores"), [
    ("max 100000\n", None, None),  # v2, no quota
    ("150000 100000\n", None, 2),  # 1.5 cores: rounded up
    ("50000 100000\n", None, 1),
    ("400000 100000\n", None, 4),
    (None, ("-1", "100000"), None),  # v1, no quota
    (None, ("200000", "100000"), 2),
    (None, None, None),  # no cgroup files at all
])
def test_the_quota_in_whole_cores(tmp_path, v2, v1, cores):
    paths = {"v2": tmp_path / "cpu.max", "v1_quota": tmp_path / "quota", "v1_period": tmp_path / "period"}
    if v2 is not None:
        paths["v2"].write_text(v2)
    if v1 is not None:
        paths["v1_quota"].write_text(v1[0])
        paths["v1_period"].write_text(v1[1])
    assert quota_cores(**paths) == cores


def test_usable_cores_follow_the_affinity():
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(own)})
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, own)
    quota = quota_cores()
    assert usable_cores() == (min(len(own), quota) if quota else len(own))
