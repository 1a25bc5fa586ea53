"""Issue 27: hostile connections. Timeouts, the connection limit, a bounded shutdown, quiet client
disconnects, early refusal of prompts that cannot fit, fresh /metrics gauges, strict media types.

Two kinds of server, as in test_hostile_client:
- the real app and HttpServerManager over a scripted worker, served in a thread by the same
  GracefulServer and uvicorn configuration as the real server (``hardened``): connection-level
  behaviour and the shutdown sequence, quickly;
- the real server process on the embedded model (``server`` and per-test launches): SIGTERM,
  process exit, the log, memory, /metrics of a real prefill.

Each docstring says what happened before the fix (main at 20dd731).
"""
import dataclasses
import importlib.util
import json
import os
import queue
import resource
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Dict, List, Optional

import httpx
import pytest

from lightllm.server.api_http import MAX_REQUEST_BODY_BYTES, create_app
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.serving import (MAX_INCOMPLETE_EVENT_BYTES, SHUTDOWN_FAIL_GRACE_S, HeaderDeadlineProtocol,
                                                HttpToolsProtocol,
                                                HttpToolsHeaderDeadlineProtocol, header_deadline_protocol, make_server)
from lightllm.server.router.manager import GaugePublisher, StepTiming, WorkerReady
from lightllm.utils.embedded_model import get_default_model_dir
from lightllm.utils.server_launcher import free_port, launch_server, scrape, sse_data, strict_json
from unit_tests.server.http.test_hostile_client import Script, ScriptedWorker
from unit_tests.server.process_util import process_gone

MAX_REQ_TOTAL_LEN = 1024
# Short timeouts so that the tests see them pass
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 0.5
TIMEOUT_SLACK_S = 1.0  # a timeout fires within this of its nominal time
# The real server exits this long after the graceful-shutdown bound at most (the failed requests'
# 503s, the worker's exit, the interpreter's)
EXIT_MARGIN_S = SHUTDOWN_FAIL_GRACE_S + 6.0
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SHORT_PROMPT = CHAT_PROMPT.format("What is the capital of France?")  # 17 tokens
TOKEN_IDS = list(range(300, 340))  # what the scripted worker generates
# The HTTP parsers (--http) the connection tests run under: h11 always, httptools where installed
HTTP_PARSERS = ["h11"] + (["httptools"] if HttpToolsProtocol is not None else [])
# The event loops (--loop) the server is checked under: asyncio always, uvloop where installed
EVENT_LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") is not None else [])


def _raise_open_file_limit(wanted: int) -> int:
    """This process's open-file limit raised towards ``wanted``; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _connect(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _partial_post(url: str, path: str = "/generate", declared: int = 1000, sent: bytes = b'{"inputs": "hi') -> socket.socket:
    """A connection that sent a POST's headers and the first bytes of its body, and stalls."""
    s = _connect(url)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return s


def _read_until_closed(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes)."""
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
    except socket.timeout:
        return data + b"<still open>"
    except ConnectionResetError:
        return data


def _status(raw: bytes) -> Optional[int]:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else None


def _body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


# ---------------------------------------------------------------- the app over a scripted worker

@dataclasses.dataclass
class Hardened:
    url: str
    manager: HttpServerManager
    worker: ScriptedWorker
    server: object  # GracefulServer
    thread: threading.Thread

    def shut_down(self) -> float:
        """Begin shutdown as SIGTERM does; returns when the server has stopped (seconds taken)."""
        t0 = time.monotonic()
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"
        return time.monotonic() - t0


@contextmanager
def hardened(script: Script = Script(TOKEN_IDS), **args):
    """The real app, served by the real server's GracefulServer in a thread, over a ScriptedWorker."""
    worker = ScriptedWorker(script)
    settings = {"max_req_total_len": MAX_REQ_TOTAL_LEN, "timeout_request_header": HEADER_TIMEOUT_S,
                "timeout_request_body": BODY_TIMEOUT_S, "timeout_keep_alive": KEEP_ALIVE_S, **args}
    start_args = dataclasses.replace(StartArgs(), resolved_model_dir=get_default_model_dir(), **settings)
    ready = WorkerReady(vocab_size=49152, max_total_token_num=4096, device="cpu", data_type="float32")
    manager = HttpServerManager(start_args, worker.in_q, worker.out_q, ready, worker=worker)
    app = create_app(manager, exit_process=lambda code: None)
    port = free_port()
    server = make_server(app, manager, start_args, port=port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    h = Hardened(f"http://127.0.0.1:{port}", manager, worker, server, thread)
    try:
        yield h
    finally:
        if thread.is_alive():
            server.should_exit = server.force_exit = True
            thread.join(10)
        worker.stop()


def _post(url: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


@pytest.mark.parametrize("http", HTTP_PARSERS)
def test_idle_and_slow_header_connections_are_closed(http):
    """Before: no header timeout; an idle connection (or one trickling its headers) stayed open for ever."""
    with hardened(http=http) as h:
        idle = _connect(h.url)
        slow = _connect(h.url)
        t0 = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(int(HEADER_TIMEOUT_S / 0.2) + 3):  # one header byte per 0.2 s, past the deadline
            try:
                slow.sendall(b"X")
            except OSError:
                break
            time.sleep(0.2)
        assert _read_until_closed(slow, 5) == b""
        assert _read_until_closed(idle, 5) == b""
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + TIMEOUT_SLACK_S
        # an ordinary client on a kept-alive connection: served, then closed when idle
        ka = _connect(h.url)
        ka.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        t0 = time.monotonic()
        reply = _read_until_closed(ka, 5)
        assert _status(reply) == 200
        assert KEEP_ALIVE_S - 0.1 < time.monotonic() - t0 < KEEP_ALIVE_S + TIMEOUT_SLACK_S


@pytest.mark.parametrize("http", HTTP_PARSERS)
def test_stalled_and_trickled_bodies_get_408(http):
    """Before: no body timeout; a client that sent part of its body held the request (and shutdown) for ever."""
    with hardened(http=http) as h:
        stalled = _partial_post(h.url)
        trickled = _partial_post(h.url, path="/v1/completions", sent=b'{"prompt": "')
        t0 = time.monotonic()
        for _ in range(int(BODY_TIMEOUT_S / 0.2) + 3):  # one byte per 0.2 s never finishes in time
            try:
                trickled.sendall(b"a")
            except OSError:
                break
            time.sleep(0.2)
        for s in (stalled, trickled):
            reply = _read_until_closed(s, 5)
            assert _status(reply) == 408, reply
            assert _body(reply)["error"]["param"] == "body"
            assert b"connection: close" in reply.lower()
        assert time.monotonic() - t0 < BODY_TIMEOUT_S + TIMEOUT_SLACK_S
        assert httpx.get(h.url + "/health").status_code == 200


@pytest.mark.parametrize("http", HTTP_PARSERS)
def test_connections_past_the_limit_get_503(http):
    """--limit_concurrency N serves N open connections; the next gets a 503 (before: no limit; then one
    fewer than N, uvicorn counting the new connection)."""
    limit = 4
    with hardened(limit_concurrency=limit, http=http) as h:
        idle = [_connect(h.url) for _ in range(limit - 1)]
        time.sleep(0.1)
        assert httpx.get(h.url + "/health").status_code == 200  # the limit-th connection is served
        idle.append(_connect(h.url))
        time.sleep(0.1)
        assert httpx.get(h.url + "/health").status_code == 503
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert httpx.get(h.url + "/health").status_code == 200


@pytest.mark.parametrize("loop", EVENT_LOOPS)
def test_loop_flag_picks_the_event_loop(loop):
    """--loop: the server runs on the loop asked for, streams, and still closes a connection whose
    headers do not come (the header deadline is a timer of that loop)."""
    with hardened(loop=loop) as h:
        assert type(h.server._loop).__module__.split(".")[0] == loop
        with httpx.stream("POST", h.url + "/v1/completions", timeout=30,
                          json={"prompt": "Q", "max_tokens": 8, "stream": True}) as r:
            events = list(sse_data(r.iter_lines()))
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert [strict_json(e)["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
        s = _connect(h.url)
        t0 = time.monotonic()
        assert _read_until_closed(s, HEADER_TIMEOUT_S + 5) == b""
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + TIMEOUT_SLACK_S


def test_http_flag_picks_the_parser():
    assert issubclass(header_deadline_protocol(1.0, "h11"), HeaderDeadlineProtocol)
    auto = header_deadline_protocol(2.0, "auto")
    assert auto.header_timeout_s == 2.0
    if HttpToolsProtocol is None:
        assert issubclass(auto, HeaderDeadlineProtocol)
        with pytest.raises(ValueError, match="httptools is not installed"):
            header_deadline_protocol(1.0, "httptools")
    else:
        assert issubclass(auto, HttpToolsHeaderDeadlineProtocol)
        assert issubclass(header_deadline_protocol(1.0, "httptools"), HttpToolsProtocol)
    with pytest.raises(ValueError, match="not one of auto, h11, httptools"):
        header_deadline_protocol(1.0, "uvloop")


@pytest.mark.parametrize("http", HTTP_PARSERS)
def test_oversized_headers_get_400(http):
    """At most 16 KiB of headers (h11's bound, kept for httptools, which has none): a client that
    keeps sending one header line gets a 400 and its connection is closed; others are served."""
    with hardened(http=http) as h:
        s = _connect(h.url)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Long: ")
        sent = 0
        try:
            while sent < 4 * MAX_INCOMPLETE_EVENT_BYTES:
                s.sendall(b"a" * 1024)
                sent += 1024
        except OSError:  # closed by the server already
            pass
        reply = _read_until_closed(s, 5)
        assert _status(reply) == 400, reply
        ok = _connect(h.url)
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Fine: " + b"a" * 4096 + b"\r\nConnection: close\r\n\r\n")
        assert _status(_read_until_closed(ok, 5)) == 200


def _responses(raw: bytes) -> List[dict]:
    """The JSON bodies of the HTTP responses (with Content-Length) one after another in ``raw``."""
    bodies = []
    while raw:
        head, rest = raw.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        bodies.append(json.loads(rest[:length]))
        raw = rest[length:]
    return bodies


@pytest.mark.parametrize("http", HTTP_PARSERS)
def test_pipelined_requests_outlive_the_header_deadline(http):
    """Requests sent back to back on one connection (HTTP/1.1 pipelining) are both answered, in order,
    though the first takes longer than the header deadline: the second's headers are in, so its wait
    behind the first is no idle connection."""
    tokens = 30
    script = Script(TOKEN_IDS, interval_s=2 * HEADER_TIMEOUT_S / tokens)  # each request: ~2 header deadlines
    with hardened(script, http=http) as h:
        body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": tokens}}).encode()
        request = (b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        s = _connect(h.url)
        s.sendall(request + request.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
        raw = _read_until_closed(s, 4 * 2 * HEADER_TIMEOUT_S + TIMEOUT_SLACK_S)
        assert not raw.endswith(b"<still open>"), raw
        assert [r["count_output_tokens"] for r in _responses(raw)] == [tokens, tokens], raw


def test_content_type_must_be_json_and_generate_refuses_stream():
    """Before: text/plain (a cross-site "simple" request) and form bodies started generations;
    "stream": true on /generate was ignored."""
    body = json.dumps({"inputs": "Q", "parameters": {"max_new_tokens": 2}}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "Q"}], "max_tokens": 2}).encode()
    with hardened() as h:
        for path, raw in (("/generate", body), ("/generate_stream", body), ("/v1/chat/completions", chat)):
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
                headers = {} if ctype is None else {"content-type": ctype}
                r = httpx.post(h.url + path, content=raw, headers=headers)
                assert r.status_code == 415, (path, ctype, r.text)
                assert r.json()["error"]["param"] == "content-type"
        assert scrape(h.url).value("lightllm_request_count", 0.0, finish_reason="length") == 0  # none ran
        r = httpx.post(h.url + "/generate", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200, r.text
        for path, stream, hint in (("/generate", True, "/generate_stream"), ("/generate_stream", False, "/generate")):
            r = _post(h.url, path, {"inputs": "Q", "stream": stream})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "stream" and hint in err["message"], r.text
        r = _post(h.url, "/generate", {"inputs": "Q", "stream": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        assert _post(h.url, "/generate", {"inputs": "Q", "stream": False, "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_shutdown_refuses_unfinished_bodies_and_lets_in_flight_requests_finish():
    """Before: shutdown waited for the unfinished body for ever."""
    script = Script(TOKEN_IDS, interval_s=0.05)
    with hardened(script, timeout_graceful_shutdown=10.0, timeout_request_body=60.0) as h:
        results: Dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            results[i] = _post(h.url, "/generate", {"inputs": "Q", "parameters": {"max_new_tokens": 20}})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        pending = _partial_post(h.url)
        time.sleep(0.3)  # all in flight (20 tokens take 1 s)
        took = h.shut_down()
        for t in threads:
            t.join(10)
        assert [results[i].status_code for i in range(4)] == [200] * 4
        assert all(results[i].json()["count_output_tokens"] == 20 for i in range(4))
        reply = _read_until_closed(pending, 5)
        assert _status(reply) == 503 and b"shutting down" in reply
        assert took < 3.0  # the requests' second, not the body's 60 s nor the 10 s bound


def test_shutdown_bound_fails_what_is_still_running():
    """Before: no bound (uvicorn's timeout_graceful_shutdown was unset); now 503 / an error event at the bound."""
    bound = 1.0
    script = Script(TOKEN_IDS, interval_s=0.05)
    with hardened(script, timeout_graceful_shutdown=bound) as h:
        results: Dict[str, object] = {}

        def long_request() -> None:
            results["plain"] = _post(h.url, "/generate", {"inputs": "Q", "parameters": {
                "max_new_tokens": 1000, "ignore_eos": True}})

        def long_stream() -> None:
            with httpx.stream("POST", h.url + "/v1/completions", timeout=30, json={
                    "prompt": "Q", "max_tokens": 1000, "stream": True}) as r:
                results["stream"] = list(sse_data(r.iter_lines()))

        threads = [threading.Thread(target=f) for f in (long_request, long_stream)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        took = h.shut_down()
        for t in threads:
            t.join(10)
        plain = results["plain"]
        assert plain.status_code == 503 and "timeout_graceful_shutdown" in plain.json()["error"]["message"]
        events = results["stream"]
        assert events[-1] == "[DONE]" and "shutting down" in strict_json(events[-2])["error"]["message"]
        assert bound <= took < bound + SHUTDOWN_FAIL_GRACE_S
        assert {rid for rid, _ in h.worker.aborts} == {1, 2}  # both aborted in the worker


def test_a_second_signal_fails_in_flight_requests_at_once():
    """Before: a second SIGTERM did nothing."""
    script = Script(TOKEN_IDS, interval_s=0.05)
    with hardened(script, timeout_graceful_shutdown=30.0) as h:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=_post(h.url, "/generate", {
            "inputs": "Q", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}})))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        h.server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.3)
        h.server.handle_exit(signal.SIGTERM, None)
        h.thread.join(10)
        t.join(10)
        assert result["r"].status_code == 503
        assert time.monotonic() - t0 < 2.0


def test_prompt_that_cannot_fit_is_refused_before_tokenizing():
    """Before: tokenized in full (seconds for megabytes), then blamed on max_new_tokens."""
    with hardened() as h:
        m = h.manager.max_token_chars
        assert m is not None and m >= 16  # SmolLM2: a run of 80 spaces after a newline is one token
        too_many = "a" * ((MAX_REQ_TOTAL_LEN - 1) * m + 1)
        t0 = time.monotonic()
        cases = [("/generate", {"inputs": too_many, "parameters": {"max_new_tokens": 1}}, "inputs"),
                 ("/v1/completions", {"prompt": too_many, "max_tokens": 1}, "prompt"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_many}], "max_tokens": 1},
                  "messages")]
        for path, body, field in cases:
            r = _post(h.url, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "characters" in r.json()["error"]["message"] and "max_new_tokens" not in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        # a prompt within the character bound but over the token limit: counted, and still its own fault
        words = "hello " * MAX_REQ_TOTAL_LEN
        for path, body, field in [("/generate", {"inputs": words, "parameters": {"max_new_tokens": 1}}, "inputs"),
                                  ("/v1/completions", {"prompt": words, "max_tokens": 1}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]},
                                   "messages")]:
            r = _post(h.url, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "tokens" in r.json()["error"]["message"]
        # both fit alone, not together: max_new_tokens's fault
        r = _post(h.url, "/generate", {"inputs": "hello " * 600, "parameters": {"max_new_tokens": 600}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text
        assert not h.worker.aborts and httpx.get(h.url + "/health").status_code == 200


def test_character_bound_holds_for_the_longest_tokens():
    """The bound refuses no prompt that fits: a prompt of the longest token repeated has no more
    characters per token than max_token_chars, and is served."""
    with hardened() as h:
        tok = h.manager.tokenizer
        pieces = tok.batch_decode([[i] for i in range(len(tok))])
        longest = pieces[max(range(len(pieces)), key=lambda i: len(pieces[i]))]
        text = longest * (MAX_REQ_TOTAL_LEN // 4)
        n = len(tok.encode(text))
        assert len(longest) == h.manager.max_token_chars
        assert len(text) <= n * h.manager.max_token_chars and n < MAX_REQ_TOTAL_LEN
        r = _post(h.url, "/generate", {"inputs": text, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------- /metrics gauges of the router

class _FakeRouter:
    """What GaugePublisher reads of a RouterManager."""

    def __init__(self, kv_size: int = 100):
        self.backend = SimpleNamespace(mem_manager=SimpleNamespace(size=kv_size, available_size=kv_size), prompt_cache=None)
        self.running: List[object] = []
        self.queue = SimpleNamespace(waiting=deque())

    def take_timing(self) -> StepTiming:
        return StepTiming(seconds=1.0, steps=1)


def _gauges_sent(q: queue.Queue) -> List[tuple]:
    sent = []
    while not q.empty():
        updates, stats = q.get_nowait()
        sent.append((len(updates), stats.kv_used_tokens, stats.running_reqs, stats.waiting_reqs, stats.timing.steps))
    return sent


def test_gauge_publisher_sends_admissions_before_the_step_and_kv_during_it():
    """Before: gauges went out only with a step's updates, after the step."""
    router, q = _FakeRouter(), queue.Queue()
    pub = GaugePublisher(router, [q], refresh_s=0.01)
    router.queue.waiting.append("r1")
    pub.before_step()
    assert _gauges_sent(q) == [(0, 0, 0, 1, 0)]  # the first reading; no updates, no timing
    pub.before_step()
    assert _gauges_sent(q) == []  # nothing changed
    router.queue.waiting.popleft()
    router.running.append("r1")  # admitted
    pub.before_step()
    assert _gauges_sent(q) == [(0, 0, 1, 0, 0)]
    router.backend.mem_manager.available_size = 40  # the step allocates KV
    pub.before_step()
    assert _gauges_sent(q) == []  # the counts alone are checked before a step
    pub.start()
    try:
        deadline = time.monotonic() + 5
        while q.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # no more: the thread sends changes only
        assert _gauges_sent(q) == [(0, 60, 1, 0, 0)]
        pub.send(["update"])  # after the step: the updates and the step's timing
        assert _gauges_sent(q) == [(1, 60, 1, 0, 1)]
    finally:
        pub.stop()


# ---------------------------------------------------------------- the real server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    s = launch_server(["--max_req_total_len", str(MAX_REQ_TOTAL_LEN), "--running_max_req_size", "8",
                       "--timeout_request_header", "5", "--timeout_request_body", "5"], str(log))
    yield s
    s.stop()


def _log(s) -> str:
    with open(s.log_path) as f:
        return f.read()


def _drop_mid_upload(url: str, reset: bool) -> None:
    s = _partial_post(url, declared=100000, sent=b'{"inputs": "' + b"x" * 5000)
    if reset:  # RST instead of FIN: linger on, for 0 s
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_clients_that_drop_mid_upload_leave_no_traceback(server):
    """Before: every drop logged a ~60-line ClientDisconnect traceback (52 in one hostile run)."""
    drops = 50
    before = _log(server)
    for i in range(drops):
        _drop_mid_upload(server.url, reset=i % 2 == 1)
    time.sleep(1.0)
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    new = _log(server)[len(before):]
    assert "Traceback" not in new and "Exception in ASGI" not in new and "ERROR" not in new, new[-3000:]
    assert len(new.splitlines()) <= drops + 5  # one line per drop at most


def _rss_peak_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


HUGE_PROMPTS = 8
HUGE_PROMPT_CHARS = MAX_REQUEST_BODY_BYTES - 1024  # an 8 MiB body, just under the limit
# The edge reads and parses the eight 8 MiB bodies at once: 0.6-1.03 s each on the 2-core CPU machine while the
# suite's other worker ran (one run over 1.0 s); refusing after tokenizing took up to 62 s.
HUGE_REFUSAL_S = 5.0
# Besides twice its idle time, the short request may wait for the edge's own work on the huge
# bodies (reading and parsing them: a refusal's time at most) and for its thread to start; on a
# GPU that is more than the 20 ms request itself. Tokenizing the bodies took 35 s (see below).
SHORT_REQUEST_SLACK_S = HUGE_REFUSAL_S
API_MEMORY_LIMIT_BYTES = 1 << 30


def test_huge_prompts_are_refused_at_once_and_do_not_slow_others(server):
    """Before: eight 8 MB prompts were tokenized in full (up to 62 s, 1.38M tokens each) on the 4
    shared tokenizer threads; a concurrent 17-token request took 35 s instead of 0.9 s and the API
    process grew from 415 MB to ~3 GB."""
    short = {"inputs": SHORT_PROMPT, "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    huge = json.dumps({"inputs": "a" * HUGE_PROMPT_CHARS, "parameters": {"max_new_tokens": 1}}).encode()
    assert len(huge) <= MAX_REQUEST_BODY_BYTES
    with server.client() as c:
        c.post("/generate", json=short)  # warm
        idle = []
        for _ in range(2):
            t0 = time.monotonic()
            assert c.post("/generate", json=short).status_code == 200
            idle.append(time.monotonic() - t0)
    idle_s = min(idle)

    def send_huge(_) -> tuple:
        with server.client() as c:
            t0 = time.monotonic()
            r = c.post("/generate", content=huge, headers={"content-type": "application/json"})
            return r.status_code, r.json()["error"]["param"], time.monotonic() - t0

    def send_short() -> float:
        with server.client() as c:
            t0 = time.monotonic()
            assert c.post("/generate", json=short).status_code == 200
            return time.monotonic() - t0

    with ThreadPoolExecutor(HUGE_PROMPTS + 1) as pool:
        short_f = pool.submit(send_short)
        refusals = list(pool.map(send_huge, range(HUGE_PROMPTS)))
        short_s = short_f.result()
    assert all(status == 400 and field == "inputs" for status, field, _ in refusals), refusals
    assert max(s for _, _, s in refusals) < HUGE_REFUSAL_S, refusals
    assert short_s < 2 * idle_s + SHORT_REQUEST_SLACK_S, (short_s, idle_s)
    assert _rss_peak_bytes(server.proc.pid) < API_MEMORY_LIMIT_BYTES
    print(f"huge refusals {max(s for _, _, s in refusals):.3f} s; short {short_s:.2f} s (idle {idle_s:.2f} s); "
          f"API peak RSS {_rss_peak_bytes(server.proc.pid) / 2**20:.0f} MiB")


LONG_PREFILL_WORDS = 1000  # 1001 tokens: about 5 s of prefill in one step on one CPU thread
MIN_PREFILL_S = 1.0  # long enough for several /metrics samples (one every 0.1 s) during it


@pytest.fixture
def cpu_server(tmp_path):
    """The server on the CPU with one thread on every machine: a GPU prefills the longest prompt
    (--max_req_total_len) in milliseconds, too fast to sample /metrics during it. The gauges are
    the router's, the same for every device."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", LIGHTLLM_CPU_THREADS="1")
    s = launch_server(["--max_req_total_len", str(MAX_REQ_TOTAL_LEN), "--running_max_req_size", "8"],
                      str(tmp_path / "server.log"), env=env)
    yield s
    s.stop()


def test_metrics_show_a_long_prefill_while_it_runs(cpu_server):
    """Before: the gauges were sent only after a step, so during a long prefill /metrics read 0
    running requests and 0 KV (5 s into a 75 s prefill)."""
    server = cpu_server
    prompt = "word " * LONG_PREFILL_WORDS
    samples: List[tuple] = []  # (time, running, kv used)
    first_event = {}

    def stream() -> None:
        with httpx.stream("POST", server.url + "/generate_stream", timeout=120, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 2}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    first_event.setdefault("t", time.monotonic())

    t = threading.Thread(target=stream)
    t0 = time.monotonic()
    t.start()
    while t.is_alive():
        page = scrape(server.url)
        samples.append((time.monotonic(), page.value("lightllm_running_requests"), page.value("lightllm_kv_used_tokens")))
        time.sleep(0.1)
    t.join()
    during = [(ts, running, kv) for ts, running, kv in samples if ts < first_event["t"]]
    assert first_event["t"] - t0 > MIN_PREFILL_S, "the prefill was too short to tell"
    assert any(running == 1 and kv >= LONG_PREFILL_WORDS for _, running, kv in during), samples
    time.sleep(0.5)
    page = scrape(server.url)
    assert page.value("lightllm_running_requests") == 0 and page.value("lightllm_kv_used_tokens") == 0


# ---------------------------------------------------------------- SIGTERM of the real server

def _children(pid: int) -> List[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


IN_FLIGHT = 4  # short requests: they finish within the bound
SHORT_NEW_TOKENS = 12
# A request that cannot finish within the bound on any machine: nearly the embedded model's 8192
# positions, decoded eagerly (--disable_cudagraph): about 0.1 s a token on a 2-core CPU, ~15 ms on
# an H200 (with CUDA graphs ~1.3 ms, so 8000 tokens in ~10 s: too close to the bound;
# docs/decode_step.md)
SIGTERM_MAX_REQ_TOTAL_LEN = 8192
LONG_NEW_TOKENS = 8000
SIGTERM_KV_TOKENS = SIGTERM_MAX_REQ_TOTAL_LEN + 1024  # the long request's reservation and the short ones'
GRACEFUL_S = 8.0


def _sigterm_with_crowd(tmp_path, idle: int, slow: int, extra_args=(), group: bool = True) -> None:
    """Short and one long in-flight request, one unfinished body, ``idle`` idle and ``slow``
    slow-body connections; SIGTERM to the process group (as a supervisor does; ``group`` False: to
    the API server's process alone, as ``kill PID`` or a container runtime does). The server must
    exit within the bound with every short request finished (on a fast device they may finish
    before the signal: none may fail), the long one failed with 503, its children gone and a clean
    log (exit status 0)."""
    s = launch_server(["--max_req_total_len", str(SIGTERM_MAX_REQ_TOTAL_LEN), "--running_max_req_size", "8",
                       "--max_total_token_num", str(SIGTERM_KV_TOKENS), "--disable_cudagraph",
                       "--timeout_graceful_shutdown", str(GRACEFUL_S), "--timeout_request_body", "120",
                       "--timeout_request_header", "120", *extra_args], str(tmp_path / "server.log"))
    crowd: List[socket.socket] = []
    try:
        children = _children(s.proc.pid)
        assert children, "no worker / resource tracker processes found"
        results: Dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            new_tokens = LONG_NEW_TOKENS if i == IN_FLIGHT else SHORT_NEW_TOKENS
            results[i] = httpx.post(s.url + "/generate", timeout=60, json={
                "inputs": SHORT_PROMPT, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(IN_FLIGHT + 1)]
        for t in threads:
            t.start()
        pending = _partial_post(s.url)
        crowd += [_connect(s.url) for _ in range(idle)]
        slow_posts = [_partial_post(s.url, declared=10000, sent=b'{"inputs": "') for _ in range(slow)]
        stop_trickle = threading.Event()

        def trickle() -> None:  # one byte per connection every 0.2 s: never done
            while not stop_trickle.wait(0.2):
                for p in slow_posts:
                    try:
                        p.sendall(b"a")
                    except OSError:
                        pass

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        time.sleep(1.0)  # in flight
        t0 = time.monotonic()
        (os.killpg if group else os.kill)(s.proc.pid, signal.SIGTERM)
        code = s.proc.wait(timeout=GRACEFUL_S + EXIT_MARGIN_S)
        took = time.monotonic() - t0
        stop_trickle.set()
        for t in threads:
            t.join(10)
        assert code == 0
        assert [results[i].status_code for i in range(IN_FLIGHT)] == [200] * IN_FLIGHT
        assert all(results[i].json()["count_output_tokens"] == SHORT_NEW_TOKENS for i in range(IN_FLIGHT))
        assert results[IN_FLIGHT].status_code == 503, "the long request finished within the bound"
        assert "timeout_graceful_shutdown" in results[IN_FLIGHT].json()["error"]["message"]
        assert _status(_read_until_closed(pending, 5)) == 503
        for p in slow_posts:
            assert _status(_read_until_closed(p, 5)) in (503, None)  # refused, or closed
        deadline = time.monotonic() + 5
        while not all(process_gone(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(process_gone(pid) for pid in children), "orphan processes"
        log = _log(s)
        for bad in ("Traceback", "leaked", "Exception in ASGI", "Cancel "):
            assert bad not in log, log[-3000:]
        print(f"SIGTERM with {idle} idle / {slow} slow connections: exited in {took:.2f} s "
              f"(--timeout_graceful_shutdown {GRACEFUL_S:g})")
        assert GRACEFUL_S <= took < GRACEFUL_S + EXIT_MARGIN_S
    finally:
        for sock in crowd:
            sock.close()
        s.stop()


def test_sigterm_with_an_unfinished_body_exits_in_bound(tmp_path):
    """Before: uvicorn waited for the unfinished body for ever (a second SIGTERM did not help);
    the worker died at once of the group's SIGTERM; "leaked semaphore" at every shutdown."""
    _sigterm_with_crowd(tmp_path, idle=0, slow=0)


@pytest.mark.parametrize("group", [True, False], ids=["process_group", "api_server_alone"])
def test_sigterm_with_two_http_processes_exits_in_bound(tmp_path, group):
    """--httpserver_workers 2: the requests in flight on either process finish (or fail at the
    bound), and the other process and the worker exit with the API server, whether the signal went to
    the whole group (each process must count it once) or to the API server alone (it passes it on)."""
    _sigterm_with_crowd(tmp_path, idle=0, slow=0, extra_args=("--httpserver_workers", "2"), group=group)


IDLE_CONNECTIONS = 1000
SLOW_CONNECTIONS = 50


# slow on CPU (27 s); test_sigterm_with_an_unfinished_body_exits_in_bound is the CPU suite's bound check
@pytest.mark.slow
def test_sigterm_with_many_idle_and_slow_connections_exits_in_bound(tmp_path):
    """Before: as above, and 1000 idle and 100 slow connections stayed open."""
    limit = _raise_open_file_limit(IDLE_CONNECTIONS + SLOW_CONNECTIONS + 512)
    idle = min(IDLE_CONNECTIONS, limit - SLOW_CONNECTIONS - 512)
    _sigterm_with_crowd(tmp_path, idle=idle, slow=SLOW_CONNECTIONS,
                        extra_args=("--limit_concurrency", str(2 * (idle + SLOW_CONNECTIONS))))
