"""--httpserver_workers N: several HTTP processes over one worker. A request's updates reach the
process that sent it, /metrics adds up every process's counts, and a dead worker or a dead HTTP
process ends the server cleanly (shutdown: test_connection_hardening.py)."""
import concurrent.futures
import os
import queue
import re
import signal
import subprocess
import time
from types import SimpleNamespace
from typing import List

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.server.core.objs.messages import (ReqStepUpdate, StepTiming, first_request_id,
                                                step_messages, updates_by_http_worker)
from lightllm.server.httpserver.peers import PEER_DIED_EXIT_CODE
from lightllm.server.metrics import METRICS_PUBLISH_S, ServerMetrics, SharedMetricsPage, merge_metric_pages
from lightllm.server.router.manager import GaugePublisher
from lightllm.utils.server_launcher import MetricsPage, http_process_pids, launch_server, scrape
from unit_tests.server.process_util import process_gone

WORKERS = 2
PROMPTS = [f"Question {i}: what is {i} plus {2 * i}? Answer briefly." for i in range(12)]
NEW_TOKENS = 10
EXIT_TIMEOUT_S = 30.0
WORKER_DIED_EXIT_CODE = 1  # api_http's


def _update(req_id: int) -> ReqStepUpdate:
    return ReqStepUpdate(req_id, [req_id], [0.0], None, 3, 0, 0, 0.0)


def test_request_ids_route_back_to_their_process():
    """Each process's ids (first_request_id, then every N) come back to it, and to no other."""
    n = 3
    ids = {w: [first_request_id(w, n) + k * n for k in range(5)] for w in range(n)}
    assert ids[0][:2] == [3, 6] and ids[2][:2] == [5, 8]
    assert len({i for v in ids.values() for i in v}) == 15  # no id twice
    assert first_request_id(0, 1) == 1  # one process: 1, 2, 3, ... as before
    parts = updates_by_http_worker([_update(i) for w in (2, 0, 1, 2) for i in ids[w][:2]], n)
    assert [[u.req_id for u in part] for part in parts] == [ids[0][:2], ids[1][:2], ids[2][:2] + ids[2][:2]]
    # a step's messages: to each process with updates, and always to process 0 (the gauges)
    sent = step_messages([_update(i) for i in ids[2][:2]], n)
    assert [(dest, [u.req_id for u in part]) for dest, part in sent] == [(0, []), (2, ids[2][:2])]
    assert [dest for dest, _ in step_messages([], n)] == [0]
    assert [(dest, [u.req_id for u in part]) for dest, part in step_messages([_update(7)], 1)] == [(0, [7])]


class _FakeRouter:
    def __init__(self):
        self.backend = SimpleNamespace(mem_manager=SimpleNamespace(size=100, available_size=90), prompt_cache=None)
        self.running: List[object] = []
        self.queue = SimpleNamespace(waiting=[])

    def take_timing(self) -> StepTiming:
        return StepTiming(seconds=1.0, steps=1)


def _drain(q: queue.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_gauge_publisher_sends_each_process_its_updates_and_the_first_the_stats():
    router, qs = _FakeRouter(), [queue.Queue() for _ in range(3)]
    pub = GaugePublisher(router, qs)
    pub.send([_update(4), _update(3), _update(7), _update(6)])  # processes 1, 0, 1, 0
    sent = [_drain(q) for q in qs]
    assert [[[u.req_id for u in ups] for ups, _ in msgs] for msgs in sent] == [[[3, 6]], [[4, 7]], []]
    assert sent[0][0][1].timing.steps == 1 and sent[0][0][1].kv_used_tokens == 10
    pub.send([_update(4)])  # process 0 has none of them: it still gets the stats (the step's timing)
    sent = [_drain(q) for q in qs]
    assert [len(m) for m in sent] == [1, 1, 0] and sent[0][0][0] == [] and sent[0][0][1].timing.steps == 1
    router.running.append("r")
    pub.refresh()  # gauges alone: the first process only
    sent = [_drain(q) for q in qs]
    assert [len(m) for m in sent] == [1, 0, 0] and sent[0][0][1].running_reqs == 1


def _two_pages():
    """Process 0 (the worker's gauges and counters are its own) and process 1, hand-counted."""
    m0, m1 = ServerMetrics(), ServerMetrics()
    m0.requests.labels("stop").inc(2)
    m0.generation_tokens.inc(10)
    m0.observe_step(3)
    m0.observe_step(3)
    m0.kv_used_tokens.set(100)
    m0.ttft.observe(0.015)
    m1.requests.labels("stop").inc(1)
    m1.requests.labels("length").inc(4)
    m1.generation_tokens.inc(5)
    m1.observe_step(1, [0.5])  # a labeled series only process 1 has
    m1.ttft.observe(0.2)
    return m0, m1


def test_merged_page_adds_up_the_processes_counts():
    m0, m1 = _two_pages()
    text = merge_metric_pages([m0.render().decode(), m1.render().decode()]).decode()
    page = MetricsPage.parse(text)
    assert page.value("lightllm_request_count_total", finish_reason="stop") == 3
    assert page.value("lightllm_request_count_total", finish_reason="length") == 4
    assert page.value("lightllm_generation_tokens_total") == 15
    assert page.value("lightllm_kv_used_tokens") == 100  # process 1 leaves the worker's gauges at 0
    assert page.value("lightllm_mtp_accept_len_count") == 3 and page.value("lightllm_mtp_accept_len_sum") == 7
    assert page.value("lightllm_mtp_mean_tokens_per_step") == pytest.approx(7 / 3)  # not 3 + 1
    assert page.value("lightllm_time_to_first_token_seconds_bucket", le="0.02") == 1
    assert page.value("lightllm_time_to_first_token_seconds_bucket", le="0.25") == 2
    assert page.value("lightllm_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert page.value("lightllm_mtp_draft_confidence_count", depth="1") == 1
    created = [MetricsPage.parse(m.render().decode()).value("lightllm_request_count_created", finish_reason="stop")
               for m in (m0, m1)]
    assert page.value("lightllm_request_count_created", finish_reason="stop") == min(created)
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))  # each family once
    assert set(names) == {f.name for m in (m0, m1) for f in text_string_to_metric_families(m.render().decode())}
    # one process: the page is its own, unchanged
    assert merge_metric_pages([m0.render().decode()]) == m0.render()


def test_shared_page_reads_the_other_processes_last_publish(tmp_path):
    m0, m1 = _two_pages()
    p0, p1 = SharedMetricsPage(m0, str(tmp_path), 0), SharedMetricsPage(m1, str(tmp_path), 1)
    assert MetricsPage.parse(p0.render().decode()).value("lightllm_generation_tokens_total") == 10  # 1 not yet
    (tmp_path / "http_1.prom.tmp").write_text("garbage")  # a write in progress is not read
    p1.publish()
    assert MetricsPage.parse(p0.render().decode()).value("lightllm_generation_tokens_total") == 15
    m1.generation_tokens.inc(1)  # not published yet: process 0 shows the last publish ...
    assert MetricsPage.parse(p0.render().decode()).value("lightllm_generation_tokens_total") == 15
    assert MetricsPage.parse(p1.render().decode()).value("lightllm_generation_tokens_total") == 6  # 0 never published
    p0.publish()
    assert MetricsPage.parse(p1.render().decode()).value("lightllm_generation_tokens_total") == 16  # its own now


# ---------------------------------------------------------------- real servers (the embedded model, CPU)

def _generate(url: str, prompt: str) -> str:
    r = httpx.post(url + "/generate", timeout=120, json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"][0]


def _peer_pids(log_path: str) -> List[int]:
    return http_process_pids(0, log_path)[1:]


def _children(pid: int) -> List[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for_peers(s, n: int) -> List[int]:
    deadline = time.monotonic() + 60
    while len(_peer_pids(s.log_path)) < n - 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _peer_pids(s.log_path)
    assert len(pids) == n - 1, open(s.log_path).read()[-3000:]
    return pids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("workers") / "server.log"
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", "8",
                       "--httpserver_workers", str(WORKERS)], str(log))
    yield s
    s.stop()


def test_concurrent_requests_get_their_own_tokens_from_either_process(server):
    """Concurrent greedy requests, spread over both processes, get what each prompt gets alone; both
    processes served; /metrics counts every request once, whichever process answers the scrape."""
    _wait_for_peers(server, WORKERS)
    before = scrape(server.url)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _generate(server.url, p), PROMPTS * 2))
    alone = [_generate(server.url, p) for p in PROMPTS]
    assert together == alone * 2
    with open(server.log_path) as f:
        served_by = re.findall(r"(http\[1\] )?lightllm\.server\.api_http: POST /generate 200", f.read())
    assert any(served_by) and not all(served_by), "one process served every request"
    time.sleep(2 * METRICS_PUBLISH_S)
    for _ in range(4):  # scrapes land on either process: each adds up both
        grown = scrape(server.url) - before
        finished = sum(v for (name, _), v in grown.samples.items() if name == "lightllm_request_count_total")
        assert finished == 3 * len(PROMPTS)  # every finish reason
        assert grown.value("lightllm_e2e_request_latency_seconds_count") == 3 * len(PROMPTS)


def test_dead_worker_fails_both_processes_requests_and_ends_the_server(tmp_path):
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", "8",
                       "--httpserver_workers", str(WORKERS)], str(tmp_path / "server.log"))
    try:
        peers = _wait_for_peers(s, WORKERS)
        worker = [p for p in _children(s.proc.pid)
                  if p not in peers and "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(worker) == 1, worker
        statuses = {}

        def long_request(i: int) -> None:
            statuses[i] = httpx.post(s.url + "/generate", timeout=60, json={
                "inputs": PROMPTS[i], "parameters": {"max_new_tokens": 400, "ignore_eos": True}}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(long_request, i) for i in range(8)]
            time.sleep(3.0)  # in flight on both processes
            os.kill(worker[0], signal.SIGKILL)
            for f in futures:
                f.result(timeout=EXIT_TIMEOUT_S)
        assert s.proc.wait(timeout=EXIT_TIMEOUT_S) == WORKER_DIED_EXIT_CODE
        assert sorted(statuses.values()) == [503] * 8, statuses
        assert all(process_gone(p) for p in peers)
        log = open(s.log_path).read()
        assert "http[1]" in log and "the model worker exited" in log
    finally:
        s.stop()


def test_dead_http_process_shuts_the_server_down(tmp_path):
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", "8",
                       "--httpserver_workers", str(WORKERS)], str(tmp_path / "server.log"))
    try:
        peer = _wait_for_peers(s, WORKERS)[0]
        children = _children(s.proc.pid)
        os.kill(peer, signal.SIGKILL)
        assert s.proc.wait(timeout=EXIT_TIMEOUT_S) == PEER_DIED_EXIT_CODE
        deadline = time.monotonic() + 5
        while not all(process_gone(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(process_gone(p) for p in children), "orphan processes"
        log = open(s.log_path).read()
        assert "HTTP process http-1 exited" in log and "Traceback" not in log, log[-3000:]
    finally:
        s.stop()
