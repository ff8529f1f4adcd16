"""benchmarks/cpu_meter.py: the CPU time of a process tree, grandchildren included."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.cpu_meter import TICKS, CpuMeter

# A child that starts a grandchild; the grandchild burns BURN_S of CPU time (not wall time,
# so a busy machine cannot shorten it), then sleeps so the meter sees its total before it
# exits, as a Ray actor outlives the steps it is measured over.
BURN_S = 0.6
GRANDCHILD = f"import time\nwhile time.process_time() < {BURN_S}: pass\ntime.sleep(1.5)\n"
CHILD = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {GRANDCHILD!r}])"


def test_the_meter_counts_the_cpu_time_of_a_grandchild():
    began = time.time()
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    meter = CpuMeter(child.pid).start()
    child.wait(timeout=120)
    meter.stop()
    used = meter.cpu_between(began, time.time())
    # The burn, plus two interpreters starting (a few tenths of a second at most). /proc
    # gives user and system time each in whole clock ticks, truncated: a process's total
    # reads up to two ticks under what it used (0.59 s for the 0.6 s burn, seen under load).
    assert BURN_S - 2 / TICKS <= used < BURN_S + 1.0
    assert len(meter.samples) >= 3


def test_an_unstarted_meter_says_so():
    with pytest.raises(ValueError, match="no samples"):
        CpuMeter(1).cpu_between(0.0, 1.0)


@pytest.mark.parametrize(
    ("start", "end", "used"),
    [
        pytest.param(10.0, 12.0, 3.0, id="on-samples"),
        pytest.param(10.5, 11.5, 1.5, id="interpolated"),
        pytest.param(0.0, 99.0, 3.0, id="clamped-to-the-samples"),
    ],
)
def test_cpu_between_interpolates_between_samples(start, end, used):
    meter = CpuMeter(1)
    meter.samples = [(10.0, 1.0), (11.0, 2.0), (12.0, 4.0)]
    assert meter.cpu_between(start, end) == pytest.approx(used)
