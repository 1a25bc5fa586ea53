import json
import sys

from benchmarks import bench_gil_handoff
from lightllm.server.httpserver.serving import HTTP_SWITCH_INTERVAL_S, tune_http_process


def test_runs_both_arms_and_reports_latencies_from_put_to_read(tmp_path):
    out = tmp_path / "gil.json"
    before = sys.getswitchinterval()
    assert bench_gil_handoff.main(["--messages", "20", "--rounds", "1", "--step_ms", "1", "--out", str(out)]) == 0
    assert sys.getswitchinterval() == before  # each arm restores the process's interval
    rows = json.loads(out.read_text())["rows"]
    assert [r["switch_interval_ms"] for r in rows] == [5.0, 1e3 * HTTP_SWITCH_INTERVAL_S]
    for r in rows:  # a latency is read time minus put time: never negative, percentiles in order
        assert 0 <= r["latency_ms_p50"] <= r["latency_ms_p99"] <= r["latency_ms_max"]


def test_tune_http_process_sets_the_shorter_switch_interval():
    before = sys.getswitchinterval()
    try:
        tune_http_process()
        assert sys.getswitchinterval() == HTTP_SWITCH_INTERVAL_S < bench_gil_handoff.PYTHON_DEFAULT_SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)
