"""MetricsPage.quantile against hand-computed histogram_quantile cases; process_cpu_seconds against the
interpreter's own CPU clock."""
import math
import sys
import time

import pytest

from lightllm.utils.server_launcher import MetricsPage, process_cpu_seconds


def _histogram(name, cumulative):
    return MetricsPage({(name + "_bucket", (("le", le),)): n for le, n in cumulative})


def test_quantile_interpolates_within_the_bucket():
    page = _histogram("x", [("1", 10), ("2", 10), ("4", 30), ("+Inf", 40)])
    # rank 20 of 40 is the 10th of the 20 observations in (2, 4]
    assert page.quantile("x", 0.5) == pytest.approx(3.0)
    # rank 5: halfway through (0, 1]
    assert page.quantile("x", 0.125) == pytest.approx(0.5)
    # rank 10 sits at the top of (0, 1]; the empty (1, 2] is skipped
    assert page.quantile("x", 0.25) == pytest.approx(1.0)
    # rank 39.6 is in +Inf: the largest finite bound, as Prometheus gives it
    assert page.quantile("x", 0.99) == 4.0


def test_quantile_of_nothing_is_none():
    assert _histogram("x", [("1", 0), ("+Inf", 0)]).quantile("x", 0.5) is None
    assert MetricsPage({}).quantile("x", 0.5) is None


def test_quantile_of_a_grown_page():
    later = _histogram("x", [("1", 12), ("2", 20), ("+Inf", 20)])
    earlier = _histogram("x", [("1", 10), ("2", 10), ("+Inf", 10)])
    # grown: 2 in (0, 1], 8 in (1, 2]; rank 5 is the 3rd of 8
    assert (later - earlier).quantile("x", 0.5) == pytest.approx(1 + 3 / 8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_cpu_seconds_follows_the_process_clock():
    import os

    start, ref0 = process_cpu_seconds(os.getpid()), time.process_time()
    deadline = time.process_time() + 0.3
    x = 0
    while time.process_time() < deadline:  # burn CPU
        x += 1
    used, ref = process_cpu_seconds(os.getpid()) - start, time.process_time() - ref0
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert math.isclose(used, ref, abs_tol=2 * tick + 0.02)
    assert process_cpu_seconds(2 ** 22 + 12345) is None  # above pid_max's default: no such process
