"""How many cores this process may use: its CPU affinity, bounded by a container's CPU quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: cgroup v2's `cpu.max` ("QUOTA PERIOD", or "max PERIOD"), then cgroup v1's CFS quota and period.
CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def quota_cores(v2: Path = CGROUP_V2_CPU_MAX, v1_quota: Path = CGROUP_V1_QUOTA,
                v1_period: Path = CGROUP_V1_PERIOD) -> int | None:
    """The container's CPU quota in whole cores (rounded up), or None without one."""
    try:
        quota, period = v2.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = v1_quota.read_text().strip(), v1_period.read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 says -1 for none
        return None
    return max(1, math.ceil(quota_us / period_us))


def usable_cores() -> int:
    """The cores this process may run on (`taskset`, cpusets), at most its container's quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = quota_cores()
    return max(1, min(cores, quota) if quota else cores)
