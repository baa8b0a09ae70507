"""Resident memory under a steady mix for 10 minutes, and after a burst of large images.

Slow (about 13 minutes on this machine): run with `-m slow`. It drives `benchmarks/rss_soak.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import ROOT


@pytest.mark.slow
def test_rss_stays_flat_under_the_mix_and_comes_back_after_a_burst():
    done = subprocess.run([sys.executable, "benchmarks/rss_soak.py", "--duration-s", "600", "--rest-s", "20",
                           "--burst-s", "20", "--recovery-s", "60"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])["summary"]
    assert summary["mix_requests"] > 1000 and not summary["mix_failures"] and not summary["burst_failures"]
    # After the first minute, RSS grows by under 5% (peaks of the second and the last minute).
    assert summary["growth_after_first_minute"] < 0.05, summary
    # A burst of large images returns to within 10% of the pre-burst level within a minute of its end.
    assert summary["recovered_within_10pct_after_s"] is not None, summary
    assert summary["recovered_within_10pct_after_s"] <= 60.0, summary
