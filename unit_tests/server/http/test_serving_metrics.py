"""The serving latency histograms of /metrics (time to first token, inter-token latency, queue
time, end to end) on a real server process with the embedded model: their counts follow the
requests and tokens served, their sums agree with each other and, loosely, with what the
client measured."""
import json
import threading
import time

import pytest

from lightllm.server.metrics import (INTER_TOKEN_LATENCY_BUCKETS_S, QUEUE_TIME_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S,
                                     TTFT_BUCKETS_S, UPDATE_DELIVERY_BUCKETS_S)
from lightllm.utils.server_launcher import SSE_DATA_PREFIX, launch_server, scrape

HISTOGRAMS = {
    "ttft": "lightllm_time_to_first_token_seconds",
    "itl": "lightllm_inter_token_latency_seconds",
    "queue": "lightllm_request_queue_time_seconds",
    "e2e": "lightllm_e2e_request_latency_seconds",
}
DELIVERY = "lightllm_update_delivery_seconds"
# Two running requests at most: of four sent together, two wait in the queue
RUNNING_MAX = 2
CONCURRENT = 4
CHAT = [{"role": "user", "content": "Count from one to twenty."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", str(RUNNING_MAX)], str(log))
    yield s
    s.stop()


def _counts(page) -> dict:
    return {k: page.value(n + "_count", 0.0) for k, n in HISTOGRAMS.items()}


def _sums(page) -> dict:
    return {k: page.value(n + "_sum", 0.0) for k, n in HISTOGRAMS.items()}


class Timed:
    """Client-side wall time and time to the first token of one request."""

    def __init__(self):
        self.start = time.monotonic()
        self.first = None
        self.wall = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic() - self.start

    def done(self) -> None:
        self.wall = time.monotonic() - self.start


def _events(r):
    """The data of a server-sent event stream, as each line arrives (sse_data reads all first)."""
    for line in r.iter_lines():
        if line.startswith(SSE_DATA_PREFIX):
            yield line[len(SSE_DATA_PREFIX):]


def _generate(c, n: int) -> tuple:
    t = Timed()
    r = c.post("/generate", json={"inputs": "1, 2, 3,", "parameters": {"max_new_tokens": n, "ignore_eos": True}})
    t.done()
    assert r.status_code == 200, r.text
    return r.json()["count_output_tokens"], t


def _generate_stream(c, n: int) -> tuple:
    t, tokens = Timed(), 0
    body = {"inputs": "a, b, c,", "parameters": {"max_new_tokens": n, "ignore_eos": True}}
    with c.stream("POST", "/generate_stream", json=body) as r:
        for data in _events(r):
            if json.loads(data)["token"] is not None:
                t.token()
                tokens += 1
    t.done()
    return tokens, t


def _chat_stream(c, n: int) -> tuple:
    t, usage = Timed(), None
    body = {"messages": CHAT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for data in _events(r):
            if data == "[DONE]":
                continue
            ev = json.loads(data)
            if ev["choices"] and ev["choices"][0]["delta"]["content"]:
                t.token()
            usage = ev.get("usage") or usage
    t.done()
    return usage["completion_tokens"], t


def _completion(c, n: int) -> tuple:
    t = Timed()
    r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": n, "temperature": 0,
                                        "ignore_eos": True})
    t.done()
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"], t


def test_bucket_lists_ascend():
    for buckets in (TTFT_BUCKETS_S, INTER_TOKEN_LATENCY_BUCKETS_S, QUEUE_TIME_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S,
                    UPDATE_DELIVERY_BUCKETS_S):
        assert list(buckets) == sorted(set(buckets)) and buckets[0] > 0


def test_one_streamed_request_against_the_client_clock(server):
    before = scrape(server.url)
    with server.client() as c:
        tokens, t = _generate_stream(c, 8)
    grown = scrape(server.url) - before
    assert tokens == 8
    assert _counts(grown) == {"ttft": 1, "itl": 7, "queue": 1, "e2e": 1}
    s = _sums(grown)
    # the server's intervals lie within the client's: it receives the request later and
    # answers before the client reads the answer
    assert 0 < s["ttft"] <= t.first
    assert 0 < s["e2e"] <= t.wall
    assert 0 <= s["queue"] <= s["ttft"]
    assert 0 < s["itl"] <= s["e2e"] - s["ttft"] + 0.05  # router clock vs HTTP clock: a little slack
    # loosely the same as the client saw (no other load: HTTP and JSON cost little next to the forwards)
    assert s["e2e"] >= 0.5 * t.wall and s["ttft"] >= 0.25 * t.first
    # every step's message reached the event loop (8 steps gave tokens; gauge messages come on top), each
    # within the request's life
    delivered = grown.value(DELIVERY + "_count", 0.0)
    assert delivered >= tokens
    assert 0 <= grown.value(DELIVERY + "_sum", 0.0) <= delivered * s["e2e"]


def test_histogram_counts_follow_requests_and_tokens(server):
    before = scrape(server.url)
    results = []
    with server.client() as c:
        results.append(_generate(c, 6))
        results.append(_generate_stream(c, 5))
        results.append(_completion(c, 4))
        results.append(_chat_stream(c, 7))
    together = [None] * CONCURRENT
    # sent at once: on a fast GPU a 10-token request ends before a thread that starts late sends
    start = threading.Barrier(CONCURRENT)

    def run(i):
        with server.client() as c:
            start.wait()
            together[i] = _generate(c, 10) if i % 2 else _generate_stream(c, 10)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CONCURRENT)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    results += together
    grown = scrape(server.url) - before
    requests = len(results)
    tokens = sum(n for n, _ in results)
    assert [n for n, _ in results] == [6, 5, 4, 7] + [10] * CONCURRENT
    # one first token per request; one gap per later token (no MTP: one token per step); one
    # queue time per admitted request; one latency per finished request
    assert _counts(grown) == {"ttft": requests, "itl": tokens - requests, "queue": requests, "e2e": requests}
    s = _sums(grown)
    assert all(v > 0 for k, v in s.items() if k != "queue") and s["queue"] >= 0
    assert s["queue"] <= s["ttft"] <= s["e2e"]
    assert s["itl"] <= s["e2e"] - s["ttft"] + 0.05 * requests
    assert s["e2e"] <= sum(t.wall for _, t in results)
    streamed = [t for _, t in results if t.first is not None]
    assert len(streamed) == 2 + CONCURRENT // 2
    # a streamed request's first token reached the client after the server saw it leave the
    # router; a non-streamed one's whole answer did
    assert s["ttft"] <= sum(t.first if t.first is not None else t.wall for _, t in results)
    # RUNNING_MAX of the CONCURRENT run at once: the others waited for a whole request (10
    # tokens) to finish, so the queue held them for at least a few inter-token gaps
    mean_itl = s["itl"] / (tokens - requests)
    assert s["queue"] >= (CONCURRENT - RUNNING_MAX) * 3 * mean_itl
    # the histograms agree with the older ones fed from the same requests
    assert grown.value("lightllm_request_duration_seconds_count") == requests
    assert grown.value("lightllm_request_duration_seconds_sum") == pytest.approx(s["e2e"])
    assert grown.value("lightllm_generation_tokens_total") == tokens


def test_request_clock_observes_vllm_semantics():
    """No server: one request's updates through RequestClock, on made-up clocks."""
    from lightllm.server.core.objs.messages import ReqStepUpdate
    from lightllm.server.metrics import RequestClock, ServerMetrics

    def update(tokens, queue=None):
        return ReqStepUpdate(1, [5] * tokens, [0.0] * tokens, None, 4, 0, 0, 0.0, accept_len=tokens,
                             queue_time_s=queue)

    m = ServerMetrics()
    clock = RequestClock(m, arrival=100.0)
    clock.on_update(update(1, queue=0.25), sent_at=7.0, received=100.5)  # the prefill's first token
    clock.on_update(update(3, queue=0.25), sent_at=7.125, received=100.75)  # an MTP step: 3 tokens, one gap
    clock.on_update(update(0, queue=0.25), sent_at=7.5, received=101.0)  # no tokens (an abort): no gap
    clock.on_update(update(1, queue=0.25), sent_at=7.625, received=101.0)
    assert clock.finished(101.25) == 1.25

    def hist(h):
        return {s.name.rsplit("_", 1)[1]: s.value for s in h.collect()[0].samples if s.name.endswith(("_count", "_sum"))}

    assert hist(m.ttft) == {"count": 1, "sum": 0.5}
    assert hist(m.inter_token_latency) == {"count": 2, "sum": 0.125 + 0.5}
    assert hist(m.queue_time) == {"count": 1, "sum": 0.25}
    assert hist(m.e2e_latency) == {"count": 1, "sum": 1.25} == hist(m.request_latency)


def test_loop_histogram_is_exposed_as_prometheus_clients_histogram():
    """The same observations (on bucket bounds, between, above the last, 0) into a LoopHistogram
    and into prometheus_client's own Histogram give the same exposition, but for ``_created``."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from lightllm.server.metrics import INTER_TOKEN_LATENCY_BUCKETS_S, LoopHistogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("x_seconds", "A histogram", INTER_TOKEN_LATENCY_BUCKETS_S, ours)
    ref = Histogram("x_seconds", "A histogram", buckets=INTER_TOKEN_LATENCY_BUCKETS_S, registry=theirs)
    for v in [0.0, 0.001, 0.0010001, 0.0025, 0.003, 0.5, 0.75, 80.0, 81.0, 1e6] + [0.01 * i for i in range(50)]:
        fast.observe(v)
        ref.observe(v)

    def lines(registry):
        return [x for x in generate_latest(registry).decode().splitlines() if "_created" not in x]

    assert lines(ours) == lines(theirs)
    assert any(x.startswith('x_seconds_bucket{le="+Inf"} 60.0') for x in lines(ours))
