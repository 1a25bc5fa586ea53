"""Hostile-client run (issues 13 and 27): throw every hostile request of the issues at a live server
while ``--concurrency`` ordinary clients keep working (until the probes end, at least ``--normal``
requests), then check that /health is 200, no ordinary request failed and no request still holds
KV. The probes (``_probes``) go by the issues' item numbers (issue 27's as 27.N); what ends the
server (issue 13's item 5, SIGKILL of the API server, the worker-death watchdog, and issue 27's
SIGTERM with held connections) lives in unit_tests only.

    python benchmarks/hostile_client.py --url http://127.0.0.1:8123 --out hostile.json
    python benchmarks/hostile_client.py --server_args "--mtp_mode eagle_with_att --mtp_step 3"
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import shlex
import socket
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.tools.client import KV_USED_TOKENS, REQUEST_COUNT, RUNNING_REQUESTS, USAGE, serve  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402
from lightllm.utils.server_launcher import scrape, sse_data, strict_json  # noqa: E402

REQUEST_TIMEOUT_S = 300.0
HANG_UP_AFTER_S = 2.0  # how long an abandoning client waits (decoding by then) before it hangs up
ABANDONING_CLIENTS = 8
ABORT_DEADLINE_S = 1.5  # hang-up to abort (the server polls every 0.5 s)
HEALTH_LATENCY_LIMIT_S = 0.5
QUIET_DEADLINE_S = 30.0  # for running requests and KV to drain at the end
HUGE_BODY_BYTES = 20 * 1024 * 1024
CHUNKED_BODY_BYTES = 9 * 1024 * 1024
BIG_PROMPT_CHARS = 7_500_000  # under an 8 MiB body limit, far over any --max_req_total_len
DEEP_NESTING = 100_000
# Issue 27
HUGE_PROMPTS = 8  # sent at once, each BIG_PROMPT_CHARS
HUGE_REFUSAL_S = 1.0
UPLOAD_DROPS = 50
DROPPED_BODY_BYTES = 100_000  # declared; 5000 sent
BODY_TIMEOUT_SLACK_S = 2.0
METRICS_POLL_S = 0.1
LONG_PREFILL_WORDS = 1000  # at most; fewer on a server with a smaller --max_req_total_len
QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPT = CHAT_PROMPT.format(QUESTION)


@dataclass
class ProbeResult:
    item: str  # the item number
    name: str
    expected: str
    got: str
    ok: bool
    seconds: float


@dataclass
class NormalLoad:
    """Ordinary requests running beside the probes; each must succeed."""

    sent: int = 0
    failed: List[str] = field(default_factory=list)


class Client:
    """The few calls the probes make."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)

    def post(self, path: str, body=None, raw: Optional[bytes] = None) -> httpx.Response:
        if raw is not None:
            return self.http.post(path, content=raw, headers={"content-type": "application/json"})
        return self.http.post(path, json=body)

    def stream(self, path: str, body) -> Tuple[int, List[str]]:
        with self.http.stream("POST", path, json=body) as r:
            return r.status_code, sse_data(r.iter_lines())

    def metric(self, name: str, **labels: str) -> float:
        """A sample of /metrics; 0 when the page has none yet (a labelled counter before its first count)."""
        return scrape(self.url).value(name, 0.0, **labels)

    def health(self) -> int:
        return self.http.get("/health").status_code


def error_param(body) -> Optional[str]:
    """The field an error answer names (OpenAI's error object: error.param)."""
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("param") if isinstance(error, dict) else None


def _refused(c: Client, path: str, body=None, raw: Optional[bytes] = None, status: int = 400,
             field_name: Optional[str] = None) -> Tuple[bool, str]:
    r = c.post(path, body, raw)
    try:
        got_field = error_param(r.json())
    except ValueError:
        got_field = None
    ok = r.status_code == status and (field_name is None or got_field == field_name)
    return ok, f"{r.status_code} {got_field or r.text[:60]}"


def _gen(params) -> Dict:
    return {"inputs": "hi", "parameters": {"max_new_tokens": 4, **params}}


Probe = Tuple[str, str, str, Callable[[Client], Tuple[bool, str]]]  # item, name, expected, run


def _refusal(item: str, name: str, path: str, body=None, field_name: str = "", raw: Optional[bytes] = None) -> Probe:
    """A probe that wants a 400 naming ``field_name``."""
    return item, name, f"400 {field_name}", lambda c: _refused(c, path, body, raw, field_name=field_name)


def _refusal_probes() -> List[Probe]:
    probes = [_refusal(item, name, "/generate", _gen(params), field_name) for item, name, params, field_name in [
        ("1", "top_k 2**31 sampled", {"do_sample": True, "top_k": 2**31}, "top_k"),
        ("1", "temperature 1e39 sampled", {"do_sample": True, "temperature": 1e39}, "temperature"),
        ("1", "repetition_penalty 1e39", {"repetition_penalty": 1e39}, "repetition_penalty"),
        ("1", "asd_regret_budget 1e39", {"asd_regret_budget": 1e39}, "asd_regret_budget"),
        ("1", "seed 2**64", {"do_sample": True, "seed": 2**64}, "seed"),
        ("1", "seed 2**64-1 (overflows at token 2)", {"do_sample": True, "seed": 2**64 - 1}, "seed"),
        ("2", "temperature 1e-50 sampled", {"do_sample": True, "temperature": 1e-50, "return_details": True},
         "temperature"),
        ("2", "repetition_penalty 1e-50", {"repetition_penalty": 1e-50, "return_details": True},
         "repetition_penalty"),
        ("2", "logit_bias 1e308", {"logit_bias": {"5": 1e308}, "return_details": True}, "logit_bias"),
    ]]
    probes.append(("1", "the issue's curl, then /health", "400, health 200", _curl_then_health))
    return probes


def _curl_then_health(c: Client) -> Tuple[bool, str]:
    r = c.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "do_sample": True, "top_k": 2147483648}})
    h = c.health()
    return r.status_code == 400 and h == 200, f"{r.status_code}, health {h}"


def _edge_values_finite(c: Client) -> Tuple[bool, str]:
    params = {"max_new_tokens": 8, "ignore_eos": True, "return_details": True, "do_sample": True,
              "temperature": 0.01, "repetition_penalty": 0.01, "logit_bias": {"5": 100, "6": -100}, "seed": 7}
    r = c.post("/generate", {"inputs": "Hello Hello Hello", "parameters": params})
    if r.status_code != 200:
        return False, f"{r.status_code}"
    lps = [t["logprob"] for t in strict_json(r.text)["tokens"]]
    status, events = c.stream("/generate_stream", {"inputs": "Hello Hello Hello", "parameters": params})
    stream_lps = [strict_json(e)["token"]["logprob"] for e in events]
    finite = all(isinstance(x, float) and math.isfinite(x) for x in lps + stream_lps)
    return finite and status == 200, f"200, {len(lps) + len(stream_lps)} log-probs finite={finite}"


def _abandoned_requests(c: Client) -> Tuple[bool, str]:
    before = c.metric(REQUEST_COUNT, finish_reason="abort")
    body = {"inputs": "Count from one to one thousand:", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}

    def hang_up(_):
        try:
            httpx.post(c.url + "/generate", json=body, timeout=HANG_UP_AFTER_S)
            return False  # it finished before we hung up: not abandoned
        except httpx.TimeoutException:
            return True

    with ThreadPoolExecutor(ABANDONING_CLIENTS) as ex:
        abandoned = sum(ex.map(hang_up, range(ABANDONING_CLIENTS)))
    hung_up = time.time()
    aborted = 0.0
    while time.time() - hung_up < ABORT_DEADLINE_S * 4:
        aborted = c.metric(REQUEST_COUNT, finish_reason="abort") - before
        if aborted >= abandoned:
            break
        time.sleep(0.05)
    took = time.time() - hung_up
    ok = abandoned == ABANDONING_CLIENTS and aborted >= abandoned and took <= ABORT_DEADLINE_S
    return ok, f"{int(aborted)}/{abandoned} aborted in {took:.2f}s"


def _huge_body(c: Client) -> Tuple[bool, str]:
    t0 = time.time()
    ok, got = _refused(c, "/generate", raw=b" " * HUGE_BODY_BYTES, status=413, field_name="body")
    took = time.time() - t0
    return ok and took < 2.0, f"{got} in {took:.2f}s"


def _chunked_body(c: Client) -> Tuple[bool, str]:
    def chunks():
        yield b'{"inputs": "'
        for _ in range(CHUNKED_BODY_BYTES // 2**20):
            yield b"x" * 2**20
        yield b'"}'
    r = c.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    return r.status_code == 413, f"{r.status_code}"


def _health_while_tokenizing(c: Client) -> Tuple[bool, str]:
    result = {}

    def big():
        t0 = time.time()
        result["status"] = c.post("/generate", {"inputs": "hello world, this is filler. " * (BIG_PROMPT_CHARS // 29)}).status_code
        result["seconds"] = time.time() - t0

    th = threading.Thread(target=big)
    th.start()
    worst, polls = 0.0, 0
    while th.is_alive():
        t0 = time.time()
        c.health()
        worst = max(worst, time.time() - t0)
        polls += 1
        time.sleep(0.05)
    th.join()
    ok = result["status"] == 400 and worst < HEALTH_LATENCY_LIMIT_S
    return ok, f"prompt {result['status']} after {result['seconds']:.1f}s; worst /health {worst * 1000:.0f} ms ({polls} polls)"


def _socket(c: Client) -> socket.socket:
    host, port = c.url.rsplit("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S)


def _partial_post(c: Client, declared: int, sent: bytes) -> socket.socket:
    """A connection that sent a POST's headers and the first ``sent`` bytes of its body."""
    s = _socket(c)
    s.sendall(f"POST /generate HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
              f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return s


def _stalled_body(body_timeout_s: float) -> Callable[[Client], Tuple[bool, str]]:
    def probe(c: Client) -> Tuple[bool, str]:
        s = _partial_post(c, 1000, b'{"inputs": "hi')
        s.settimeout(body_timeout_s + BODY_TIMEOUT_SLACK_S)
        t0 = time.time()
        try:
            reply = s.recv(4096)
        except socket.timeout:
            reply = b""
        finally:
            s.close()
        took = time.time() - t0
        status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "none"
        return status == "408", f"{status} after {took:.1f}s"
    return probe


def _upload_drops(log_path: Optional[str]) -> Callable[[Client], Tuple[bool, str]]:
    def probe(c: Client) -> Tuple[bool, str]:
        logged = os.path.getsize(log_path) if log_path else 0
        for i in range(UPLOAD_DROPS):
            s = _partial_post(c, DROPPED_BODY_BYTES, b'{"inputs": "' + b"x" * 5000)
            if i % 2:  # half of them with a reset
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        time.sleep(1.0)
        health = c.health()
        if not log_path:
            return health == 200, f"health {health} (log not seen: --url)"
        with open(log_path) as f:
            f.seek(logged)
            new = f.read()
        tracebacks = new.count("Traceback")
        return health == 200 and not tracebacks, f"health {health}, {tracebacks} tracebacks, {len(new.splitlines())} log lines"
    return probe


def _huge_prompts_at_once(c: Client) -> Tuple[bool, str]:
    huge = json.dumps({"inputs": "a" * BIG_PROMPT_CHARS, "parameters": {"max_new_tokens": 1}}).encode()
    short = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    t0 = time.time()
    c.post("/generate", short)
    idle = time.time() - t0

    def send_huge(_) -> Tuple[int, float]:
        t0 = time.time()
        r = httpx.post(c.url + "/generate", content=huge, headers={"content-type": "application/json"},
                       timeout=REQUEST_TIMEOUT_S)
        return r.status_code, time.time() - t0

    def send_short() -> float:
        t0 = time.time()
        c.post("/generate", short)
        return time.time() - t0

    with ThreadPoolExecutor(HUGE_PROMPTS + 1) as ex:
        short_f = ex.submit(send_short)
        refused = list(ex.map(send_huge, range(HUGE_PROMPTS)))
        loaded = short_f.result()
    worst = max(t for _, t in refused)
    ok = all(status == 400 for status, _ in refused) and worst < HUGE_REFUSAL_S
    return ok, f"{sum(s == 400 for s, _ in refused)}/{HUGE_PROMPTS} 400, worst {worst:.2f}s; short {loaded:.2f}s (idle {idle:.2f}s)"


def _metrics_during_prefill(c: Client) -> Tuple[bool, str]:
    max_len = c.http.get("/v1/models").json()["data"][0]["max_model_len"]
    words = min(LONG_PREFILL_WORDS, max_len - 16)
    seen = {"first": None, "running": 0.0, "kv": 0.0}  # when the prefill first showed; the most shown

    def stream() -> None:
        c.stream("/generate_stream", {"inputs": "word " * words, "parameters": {"max_new_tokens": 1}})

    th = threading.Thread(target=stream)
    t0 = time.time()
    th.start()
    while th.is_alive():
        running, kv = c.metric(RUNNING_REQUESTS), c.metric(KV_USED_TOKENS)
        if kv >= words and running >= 1 and seen["first"] is None:
            seen["first"] = time.time() - t0
        seen["running"], seen["kv"] = max(seen["running"], running), max(seen["kv"], kv)
        time.sleep(METRICS_POLL_S)
    th.join()
    took = time.time() - t0
    ok = seen["first"] is not None and seen["first"] < took
    shown = "never" if seen["first"] is None else f"after {seen['first']:.1f}s"
    return ok, (f"KV >= {words} shown {shown} of a {took:.1f}s request (at most {seen['running']:.0f} running, "
                f"{seen['kv']:.0f} KV)")


def _prompt_alone_too_long(c: Client) -> Tuple[bool, str]:
    max_len = c.http.get("/v1/models").json()["data"][0]["max_model_len"]
    return _refused(c, "/v1/completions", {"prompt": "hello " * max_len, "max_tokens": 1}, field_name="prompt")


def _text_plain_post(c: Client) -> Tuple[bool, str]:
    r = c.http.post("/generate", content=b'{"inputs": "hi"}', headers={"content-type": "text/plain"})
    field_name = error_param(r.json()) if r.status_code == 415 else None
    return r.status_code == 415 and field_name == "content-type", f"{r.status_code} {field_name}"


def _stop_case(c: Client) -> Tuple[str, str]:
    """(stop string, the greedy text) for a stop that spans several tokens mid-text."""
    text = c.post("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 48}}).json()["generated_text"][0]
    start = text.find(" ", len(text) // 3)
    return text[start:start + 6], text


def _stream_holds_back(c: Client) -> Tuple[bool, str]:
    stop, text = _stop_case(c)
    kept = text[:text.find(stop)]
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stop": stop}
    final = c.post("/v1/completions", body).json()["choices"][0]["text"]
    _, events = c.stream("/v1/completions", {**body, "stream": True})
    streamed = "".join(strict_json(e)["choices"][0]["text"] for e in events if e != "[DONE]")
    params = {"max_new_tokens": 48, "stop_sequences": [stop]}
    ids = [t["id"] for t in c.post("/generate", {"inputs": PROMPT, "parameters": {**params, "return_details": True}}
                                   ).json()["tokens"]]
    _, events = c.stream("/generate_stream", {"inputs": PROMPT, "parameters": params})
    stream_ids = [strict_json(e)["token"]["id"] for e in events if strict_json(e)["token"] is not None]
    ok = streamed == final == kept and stream_ids == ids
    return ok, f"stop {stop!r}: stream==final {streamed == final}, final==kept {final == kept}, events==tokens {stream_ids == ids}"


def _counts_end_at_stop(c: Client) -> Tuple[bool, str]:
    stop, _ = _stop_case(c)
    out = c.post("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 48, "stop_sequences": [stop],
                                                                "return_details": True}}).json()
    final, pieces = out["generated_text"][0], [t["text"] for t in out["tokens"]]
    covers = "".join(pieces).startswith(final)
    fewest = not pieces or not "".join(pieces[:-1]).startswith(final) or not final
    usage = c.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stop": stop}
                   ).json()["usage"]["completion_tokens"]
    ok = covers and fewest and out["count_output_tokens"] == len(pieces) == usage
    return ok, f"count {out['count_output_tokens']}, tokens {len(pieces)}, usage {usage}, fewest covering {covers and fewest}"


def _include_usage(c: Client) -> Tuple[bool, str]:
    body = {"prompt": "1, 2, 3,", "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": True}
    _, with_usage = c.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    _, without = c.stream("/v1/completions", body)
    chunks = [strict_json(e) for e in with_usage[:-1]]
    last_ok = chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    others_ok = all(ch.get("usage") is None for ch in chunks[:-1])
    plain_ok = all("usage" not in strict_json(e) for e in without[:-1])
    return last_ok and others_ok and plain_ok, f"final usage chunk {last_ok}, none elsewhere {others_ok and plain_ok}"


def _max_completion_tokens(c: Client) -> Tuple[bool, str]:
    msgs = [{"role": "user", "content": "Count to twenty."}]
    r = c.post("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 5, "ignore_eos": True, "temperature": 0})
    n = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
    conflict, got = _refused(c, "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 5, "max_tokens": 6},
                             field_name="max_completion_tokens")
    return r.status_code == 200 and n == 5 and conflict, f"{r.status_code} with {n} tokens; conflict {got}"


def _probes(body_timeout_s: float, log_path: Optional[str]) -> List[Probe]:
    chat = [{"role": "user", "content": "hi"}]
    surrogate = b'{"inputs": "hi \\ud800 there", "parameters": {"max_new_tokens": 2}}'
    deep = b"[" * DEEP_NESTING + b"]" * DEEP_NESTING
    return _refusal_probes() + [
        ("2", "range edges, return_details", "200, finite log-probs", _edge_values_finite),
        ("3", f"{ABANDONING_CLIENTS} non-streaming clients hang up", f"aborted <= {ABORT_DEADLINE_S}s",
         _abandoned_requests),
        ("4", "20 MB body", "413 < 2s", _huge_body),
        ("4", "9 MB chunked body", "413", _chunked_body),
        ("4", "/health while an 8 MB prompt is refused", f"< {HEALTH_LATENCY_LIMIT_S * 1000:.0f} ms",
         _health_while_tokenizing),
        ("6", "stop string across updates", "stream == final", _stream_holds_back),
        ("7", "counts end at the stop", "fewest covering tokens", _counts_end_at_stop),
        _refusal("8", "lone surrogate in inputs", "/generate", raw=surrogate, field_name="inputs"),
        _refusal("8", "100k-deep JSON", "/generate", raw=deep, field_name="body"),
        ("9", "max_completion_tokens", "200; conflict 400", _max_completion_tokens),
        ("9", "stream_options.include_usage", "usage in a last chunk", _include_usage),
        _refusal("9", "logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        _refusal("9", "echo true", "/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        _refusal("9", "best_of 2", "/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        _refusal("9", "role 'bogus'", "/v1/chat/completions", {"messages": [{"role": "bogus", "content": "hi"}]},
                 "messages"),
        _refusal("9", "max_tokens 10**6 names max_tokens", "/v1/chat/completions",
                 {"messages": chat, "max_tokens": 10**6}, "max_tokens"),
        _refusal("9", "empty prompt names prompt", "/v1/completions", {"prompt": ""}, "prompt"),
        ("27.1", "stalled request body", "408", _stalled_body(body_timeout_s)),
        ("27.2", f"{UPLOAD_DROPS} clients drop mid-upload", "no traceback", _upload_drops(log_path)),
        ("27.3", f"{HUGE_PROMPTS} x 7.5 MB prompts at once", f"400 < {HUGE_REFUSAL_S:g}s each", _huge_prompts_at_once),
        ("27.4", "/metrics during a long prefill", "running, KV shown", _metrics_during_prefill),
        ("27.5", "prompt alone too long, max_tokens 1", "400 prompt", _prompt_alone_too_long),
        _refusal("27.5", '"stream": true on /generate', "/generate", {"inputs": "hi", "stream": True}, "stream"),
        ("27.5", "text/plain POST (a cross-site simple request)", "415 content-type", _text_plain_post),
    ]


def _normal_client(url: str, i: int) -> Optional[str]:
    """One ordinary request (greedy, short); None when it succeeded, else what went wrong."""
    q = f"What is {i} plus {i + 3}?"
    try:
        if i % 2:
            r = httpx.post(url + "/generate", timeout=REQUEST_TIMEOUT_S,
                           json={"inputs": CHAT_PROMPT.format(q), "parameters": {"max_new_tokens": 24}})
            ok = r.status_code == 200 and r.json()["finish_reason"] in ("eos", "length")
        else:
            r = httpx.post(url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0})
            ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return None if ok else f"#{i}: {r.status_code} {r.text[:80]}"
    except httpx.HTTPError as e:
        return f"#{i}: {type(e).__name__}"


def _normal_load(url: str, at_least: int, concurrency: int, probes_done: threading.Event, load: NormalLoad) -> None:
    """``concurrency`` clients send ordinary requests until the probes are done (and at least ``at_least``)."""
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if probes_done.is_set() and load.sent >= at_least:
                    return
                i = load.sent
                load.sent += 1
            failure = _normal_client(url, i)
            if failure is not None:
                with lock:
                    load.failed.append(failure)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(url: str, normal: int, concurrency: int, body_timeout_s: float, log_path: Optional[str] = None) -> Dict:
    c = Client(url)
    load = NormalLoad()
    probes_done = threading.Event()
    background = threading.Thread(target=_normal_load, args=(url, normal, concurrency, probes_done, load))
    background.start()
    results = []
    for item, name, expected, probe in _probes(body_timeout_s, log_path):
        t0 = time.time()
        try:
            ok, got = probe(c)
        except Exception as e:  # a probe that breaks is a failed probe, and the run goes on
            ok, got = False, f"{type(e).__name__}: {str(e)[:80]}"
        results.append(ProbeResult(item, name, expected, got, ok, round(time.time() - t0, 2)))
    probes_done.set()
    background.join()
    deadline = time.time() + QUIET_DEADLINE_S
    while time.time() < deadline and (c.metric(RUNNING_REQUESTS) or c.metric(KV_USED_TOKENS)):
        time.sleep(0.2)
    final = {"health": c.health(), "normal_sent": load.sent, "normal_lost": len(load.failed),
             "normal_failures": load.failed, "running_requests": c.metric(RUNNING_REQUESTS),
             "kv_used_tokens": c.metric(KV_USED_TOKENS)}
    final["ok"] = (final["health"] == 200 and not load.failed and not final["running_requests"]
                   and not final["kv_used_tokens"])
    return {"results": [asdict(r) for r in results], "final": final,
            "passed": all(r.ok for r in results) and final["ok"]}


REPORT_TABLE = (Column("item", "item"), Column("name", "probe"), Column("expected", "expected"), Column("got", "got"),
                Column("ok", "ok", lambda ok: "yes" if ok else "NO"))


def format_table(report: Dict) -> str:
    f = report["final"]
    end = {"item": "end", "name": "/health, normal requests lost, KV in use", "expected": "200, 0, 0",
           "got": f"{f['health']}, {f['normal_lost']}/{f['normal_sent']}, {f['kv_used_tokens']:.0f}", "ok": f["ok"]}
    return render_table(report["results"] + [end], REPORT_TABLE, markdown=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; without it one is started with --server_args")
    p.add_argument("--server_args", default=f"--mtp_mode eagle_with_att --mtp_step 3 --mtp_asd_regret_budget {USAGE.budget}"
                                            " --timeout_request_body 5",
                   help="flags for the server this script starts (without --url)")
    p.add_argument("--body_timeout", type=float, default=5.0,
                   help="the server's --timeout_request_body (the stalled-body probe waits that long)")
    p.add_argument("--normal", type=int, default=24,
                   help="ordinary requests sent beside the probes (at least; they run until the probes end)")
    p.add_argument("--concurrency", type=int, default=4, help="ordinary requests in flight at once")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    log = None if args.url else os.path.join(tempfile.mkdtemp(prefix="hostile_"), "server.log")
    with serve(shlex.split(args.server_args), log) if log else contextlib.nullcontext() as server:
        url = server.url if server else args.url
        if log:
            print(f"server log: {log}")
        report = run(url, args.normal, args.concurrency, args.body_timeout, log)
    report.update({"date": datetime.datetime.now().isoformat(timespec="seconds"), "url": url,
                   "server_args": None if args.url else args.server_args})
    print(format_table(report))
    print("PASSED" if report["passed"] else "FAILED")
    if args.out:
        write_json(args.out, report, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
