"""lightllm/tools/client.py (and the /metrics page of lightllm/utils/server_launcher.py): flags,
settings, metric names, the parsed page, and the bounded request drivers against a small local
HTTP server."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from lightllm.server.metrics import ServerMetrics
from lightllm.tools import client
from lightllm.tools.client import (
    USAGE,
    AsdSetting,
    auto_max_req_total_len,
    generate_body,
    send_all,
    send_timed,
    server_flags,
    wave_server_flags,
)
from lightllm.utils.server_launcher import MetricsPage

# ---- flags and settings ----


def test_server_flags_skip_none_and_expand_lists():
    assert server_flags(mtp_mode="eagle_with_att", mtp_step=3, mtp_draft_model_dir=["/a", "/b"],
                        mtp_asd_regret_budget=None, mtp_asd_local_regret_ratio=0.25) == [
        "--mtp_mode", "eagle_with_att", "--mtp_step", "3", "--mtp_draft_model_dir", "/a", "/b",
        "--mtp_asd_local_regret_ratio", "0.25"]
    assert server_flags() == []


def test_asd_settings():
    assert USAGE == AsdSetting(2.0625, 0.25, 2)
    assert AsdSetting.q25(0.3).start_args() == dict(mtp_asd_regret_budget=0.3, mtp_asd_local_regret_ratio=0.3,
                                                   mtp_asd_block_max_mismatch=1)
    assert server_flags(**AsdSetting(0.0).start_args()) == ["--mtp_asd_regret_budget", "0.0"]


def test_wave_flags_and_request_length():
    assert auto_max_req_total_len([100, 200, 150], 256) == 512  # 456 -> 512
    assert auto_max_req_total_len([64], 64) == 128
    assert wave_server_flags(None, 8, 512) == [
        "--running_max_req_size", "8", "--max_req_total_len", "512", "--batch_max_tokens", "4096"]
    # the prefill chunk holds a whole request
    assert wave_server_flags("/m", 8, 8192)[:2] == ["--model_dir", "/m"]
    assert wave_server_flags("/m", 8, 8192)[-1] == "8192"


def test_generate_body():
    assert generate_body("hi", 16) == {"inputs": "hi", "parameters": {"max_new_tokens": 16, "do_sample": False}}
    assert generate_body("hi", 16, 2.0, return_details=True)["parameters"] == {
        "max_new_tokens": 16, "do_sample": False, "return_details": True, "asd_regret_budget": 2.0}


# ---- /metrics ----


def test_metric_names_are_the_servers():
    m = ServerMetrics()
    m.batch_step_seconds.inc(0.5)
    m.batch_steps.inc(3)
    m.batch_step_requests.inc(7)
    m.requests.labels(finish_reason="abort").inc()
    m.running_reqs.set(2)
    m.kv_used_tokens.set(40)
    for accept_len in (1, 3, 3):
        m.observe_step(accept_len)
    page = MetricsPage.parse(m.render().decode())
    assert [page.value(n) for n in client.ENGINE_CLOCK] == [0.5, 3.0, 7.0]
    assert page.value(client.REQUEST_COUNT, finish_reason="abort") == 1.0
    assert (page.value(client.RUNNING_REQUESTS), page.value(client.KV_USED_TOKENS)) == (2.0, 40.0)
    assert page.histogram(client.MTP_ACCEPT_LEN) == {1: 1, 2: 0, 3: 2, 4: 0, 5: 0, 6: 0, 7: 0, 8: 0}


PAGE = """# HELP lightllm_mtp_accept_len Committed tokens per request per MTP verify step
# TYPE lightllm_mtp_accept_len histogram
lightllm_mtp_accept_len_bucket{le="1.0"} 5.0
lightllm_mtp_accept_len_bucket{le="2.0"} 9.0
lightllm_mtp_accept_len_bucket{le="3.0"} 12.0
lightllm_mtp_accept_len_bucket{le="4.0"} 20.0
lightllm_mtp_accept_len_bucket{le="5.0"} 20.0
lightllm_mtp_accept_len_bucket{le="+Inf"} 20.0
lightllm_mtp_accept_len_count 20.0
lightllm_mtp_accept_len_sum 54.0
# HELP lightllm_request_count Finished requests by finish reason
# TYPE lightllm_request_count counter
lightllm_request_count_total{finish_reason="abort"} 2.0
lightllm_request_count_total{finish_reason="eos"} 9.0
lightllm_generation_tokens_total 70.0
"""


def test_metrics_page_by_hand():
    page = MetricsPage.parse(PAGE)
    hist = page.histogram("lightllm_mtp_accept_len")
    assert hist == {1: 5, 2: 4, 3: 3, 4: 8, 5: 0}
    assert sum(k * c for k, c in hist.items()) == page.value("lightllm_mtp_accept_len_sum") == 54
    assert page.value("lightllm_request_count_total", finish_reason="eos") == 9.0
    assert page.by_key('lightllm_request_count_total{finish_reason="abort"}') == 2.0
    assert page.by_key("lightllm_generation_tokens_total") == 70.0
    with pytest.raises(KeyError, match="lightllm_batch_steps_total"):
        page.value("lightllm_batch_steps_total")
    assert page.value("lightllm_request_count_total", 0.0, finish_reason="error") == 0.0
    assert page.histogram("lightllm_request_duration_seconds") == {}
    later = MetricsPage.parse(PAGE.replace('le="2.0"} 9.0', 'le="2.0"} 11.0').replace('le="3.0"} 12.0', 'le="3.0"} 14.0')
                              .replace('le="4.0"} 20.0', 'le="4.0"} 22.0').replace('le="5.0"} 20.0', 'le="5.0"} 22.0')
                              .replace("tokens_total 70.0", "tokens_total 95.5"))
    grown = later - page
    assert grown.value("lightllm_generation_tokens_total") == 25.5
    assert grown.histogram("lightllm_mtp_accept_len") == {1: 0, 2: 2, 3: 0, 4: 0, 5: 0}  # two more steps of 2


# ---- the drivers, against a local server ----


class _Handler(BaseHTTPRequestHandler):
    """/generate echoes its body after a short wait (counting requests in flight);
    /generate_stream sends two token events and a final one; /fail is a 500."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        state = self.server.state
        with state.lock:
            state.in_flight += 1
            state.most = max(state.most, state.in_flight)
        time.sleep(0.02)
        with state.lock:
            state.in_flight -= 1
        if self.path == "/fail":
            return self._send(500, "text/plain", b"boom")
        if self.path == "/v1/completions":  # a stream of max_tokens one-token chunks, then the usage
            return self._completion_stream(body)
        if self.path == "/generate_stream":
            events = [{"token": {"id": 5}}, {"token": {"id": 6}},
                      {"token": None, "finished": True, "generated_text": body["inputs"] + "!", "finish_reason": "eos",
                       "details": {"prompt_tokens": 3, "mtp_accepted_token_num": 1}}]
            return self._send(200, "text/event-stream", "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode())
        return self._send(200, "application/json", json.dumps({"echo": body}).encode())

    def _completion_stream(self, body):
        n = body["max_tokens"]

        def chunk(finish=None):
            return {"choices": [{"index": 0, "text": "x", "finish_reason": finish, "logprobs": {"tokens": ["x"]}}]}

        events = [chunk() for _ in range(n - 1)] + [dict(chunk("length"), mtp_accepted_token_num=n // 2)]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        parts = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(sum(map(len, parts))))
        self.end_headers()
        for part in parts:
            self.wfile.write(part)
            self.wfile.flush()
            time.sleep(0.002)

    def _send(self, status, kind, data: bytes):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.state = SimpleNamespace(lock=threading.Lock(), in_flight=0, most=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server.state
    server.shutdown()
    server.server_close()


def test_send_all_keeps_order_and_the_concurrency_bound(local_server):
    url, state = local_server
    bodies = [{"i": i} for i in range(12)]
    assert send_all(url, bodies, concurrency=3) == [{"echo": b} for b in bodies]
    assert 1 <= state.most <= 3
    assert send_all(url, [{"messages": []}], 1, path="/v1/chat/completions") == [{"echo": {"messages": []}}]
    with pytest.raises(RuntimeError, match="/fail returned HTTP 500: boom"):
        send_all(url, [{}], 1, path="/fail")


def test_on_last_start_runs_once_before_the_last_send(local_server):
    """The hook runs on the thread about to send the last body, after every other body was handed out."""
    url, _ = local_server
    started, at_hook = [], []

    def call(conn, item):
        started.append(item)
        return item

    assert client._threaded(url, list(range(12)), 3, None, call, on_last_start=lambda: at_hook.append(list(started))) \
        == list(range(12))
    [seen] = at_hook
    assert 11 not in seen and len(seen) >= 12 - 3  # at most the other two threads' items still to start
    timed, _ = send_timed(url, [generate_body("a", 4)], 1, on_last_start=lambda: at_hook.append("sent"))
    assert at_hook[-1] == "sent" and len(timed) == 1


def test_send_timed_plain_and_streamed(local_server):
    url, _ = local_server
    timed, wall = send_timed(url, [generate_body("a", 4), generate_body("b", 4)], 2)
    assert [t.response["echo"]["inputs"] for t in timed] == ["a", "b"]
    assert all(0 < t.latency_s <= wall and t.ttft_s is None and t.streamed_tokens is None for t in timed)
    timed, _ = send_timed(url, [generate_body("a", 4)], 1, stream=True)
    [t] = timed
    assert t.streamed_tokens == 2 and t.response["generated_text"] == "a!" and 0 < t.ttft_s <= t.latency_s
    assert t.response["details"] == {"prompt_tokens": 3, "mtp_accepted_token_num": 1}


LAG_SLACK_S = 1e-3  # a loop may run a timer up to its clock resolution early


@pytest.mark.parametrize("procs", [1, 2])
def test_send_streamed_in_order_over_client_processes(local_server, procs):
    url, state = local_server
    bodies = [client.completion_stream_body(f"p{i:02d}", 2 + i % 3) for i in range(9)]
    lag = []
    t0 = time.time()
    traces = client.send_streamed(url, bodies, concurrency=4, procs=procs, lag=lag)
    assert [t.output_tokens for t in traces] == [2 + i % 3 for i in range(9)]  # the bodies' order
    # every client process's loop lag, sampled while it streamed
    assert lag and all(t0 <= t <= time.time() and late > -LAG_SLACK_S for t, late in lag)
    assert all(t.prompt_tokens == 3 and t.finish_reason == "length" for t in traces)
    assert all(sum(n for _, n in t.chunks) == t.output_tokens for t in traces)
    assert [t.mtp_accepted_token_num for t in traces] == [(2 + i % 3) // 2 for i in range(9)]
    assert all(t.sent_s < t.chunks[0][0] <= t.chunks[-1][0] <= t.done_s and t.ttft_s > 0 for t in traces)
    assert 1 <= state.most <= 4


def test_a_connection_the_server_closed_while_idle_is_opened_again():
    """HTTP/1.1 keep-alive, but the server closes each connection after one response (as an idle
    timeout does): the next request on that connection goes out again on a new one."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    served = []

    def serve():
        for _ in range(3):
            conn, _ = listener.accept()
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                headers, body = head.split(b"\r\n\r\n", 1)
                length = int(next(h.split(b":")[1] for h in headers.split(b"\r\n") if h.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(4096)
                served.append(json.loads(body))
                data = json.dumps({"n": len(served)}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(data), data))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    assert send_all(url, [{"i": 0}, {"i": 1}, {"i": 2}], concurrency=1) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert served == [{"i": 0}, {"i": 1}, {"i": 2}]
    thread.join(5)
    listener.close()
