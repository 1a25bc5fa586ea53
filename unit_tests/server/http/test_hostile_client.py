"""Issue 13 at the HTTP edge: one hostile but ordinary client must not hurt the server or others.

Two kinds of server:
- the real server of the embedded model (``server``, as in test_api_http), for validation,
  bodies and OpenAI details;
- the real app and HttpServerManager over a *scripted worker* (``scripted``): a thread that
  answers the manager's queues with a fixed token sequence, grouped like MTP blocks or not,
  at a fixed pace, and can die on demand. It pins stream hold-back, token counts at a stop,
  disconnects and the watchdog exactly.

Each test's docstring says what it did on the code before the fix (main at 952485d).
"""
import dataclasses
import json
import logging
import math
import os
import queue
import random
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

from lightllm.server.api_http import MAX_REQUEST_BODY_BYTES, create_app
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.httpserver.manager import HttpServerManager, stop_prefix_len
from lightllm.server.router.manager import AbortReq, AddReq, StepTiming, WorkerReady, WorkerStats
from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate
from lightllm.utils.embedded_model import get_default_model_dir
from lightllm.utils.server_launcher import free_port, launch_server, sse_data, strict_json

MAX_REQ_TOTAL_LEN = 512
TEXT = "To find 7 * 6, we multiply 7 by 6."


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(get_default_model_dir())


# ---------------------------------------------------------------- the real server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    s = launch_server(["--max_req_total_len", str(MAX_REQ_TOTAL_LEN), "--running_max_req_size", "8"], str(log))
    yield s
    s.stop()


def _still_serves(c: httpx.Client) -> None:
    r = c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert c.get("/health").status_code == 200


# Values that passed validation and then crashed the worker (1), or produced non-finite
# log-probs (2); each must now be a 400 naming the field.
ENGINE_CANNOT_HOLD = [
    ({"do_sample": True, "top_k": 2**31}, "top_k"),
    ({"do_sample": True, "temperature": 1e39}, "temperature"),
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"do_sample": True, "seed": 2**64 - 1}, "seed"),
    ({"do_sample": True, "temperature": 1e-50}, "temperature"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"),
    ({"logit_bias": {"5": 1e308}}, "logit_bias"),
    ({"logit_bias": {str(2**40): 1}}, "logit_bias"),
    ({"temperature": 10**400}, "temperature"),
]


@pytest.mark.parametrize("params,field", ENGINE_CANNOT_HOLD)
def test_values_the_engine_cannot_hold_are_400(server, params, field):
    """Before: 200 (then the worker died: /health 503 for good) for top_k, temperature 1e39,
    repetition_penalty, seed; 200 with garbage / NaN for 1e-50 and 1e308; 500 for 10**400."""
    with server.client() as c:
        r = c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3, **params}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field + ":")
        _still_serves(c)


def test_extreme_valid_values_keep_logprobs_finite(server):
    """The bounds' promise: at their edges log-probs stay finite and JSON stays valid. A bias
    of +100 on one token makes it the only choice (log-prob ~0), the reference here. Before:
    passed too; the out-of-range values that broke it are test_values_the_engine_cannot_hold_are_400."""
    forced = 330  # any ordinary token id of the vocabulary
    base = {"max_new_tokens": 4, "ignore_eos": True, "return_details": True}
    bias = {"logit_bias": {str(forced): 100}}
    sampled = {"do_sample": True, "temperature": 0.01, "seed": 1}
    with server.client() as c:
        for extra in (bias, {**bias, **sampled}):
            r = c.post("/generate", json={"inputs": "Hello", "parameters": {**base, **extra}})
            assert r.status_code == 200, r.text
            toks = strict_json(r.text)["tokens"]
            assert [t["id"] for t in toks] == [forced] * 4
            assert all(-1e-3 <= t["logprob"] <= 0 for t in toks)
        for extra in ({"repetition_penalty": 0.01}, {"repetition_penalty": 100.0},
                      {**sampled, "repetition_penalty": 0.01, "logit_bias": {str(forced): -100}}):
            r = c.post("/generate", json={"inputs": "Hello Hello", "parameters": {**base, **extra}})
            assert r.status_code == 200, r.text
            assert all(-math.inf < t["logprob"] <= 0 for t in strict_json(r.text)["tokens"])
        with c.stream("POST", "/generate_stream", json={"inputs": "Hello", "parameters": {**base, **bias, **sampled}}) as r:
            events = [strict_json(e) for e in sse_data(r.iter_lines())]
        assert [e["token"]["id"] for e in events] == [forced] * 4


def test_openai_errors_name_the_clients_fields(server):
    """Before: 'inputs', 'max_new_tokens', 'stop_sequences' (and max_completion_tokens was an
    unknown field)."""
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": ""}, "prompt", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens", "max_new_tokens"),
        ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 100000}, "max_completion_tokens",
         "max_new_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "stop_sequences"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_new_tokens"),
    ]
    with server.client() as c:
        for path, body, field, internal in cases:
            r = c.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, (body, r.json())
            assert r.json()["error"]["message"].startswith(field + ":")
            assert internal is None or internal not in r.json()["error"]["message"], r.json()
            assert "inputs" not in r.json()["error"]["message"]


@pytest.mark.parametrize("raw,field", [
    ('{"inputs": "hi \\ud800 there", "parameters": {"max_new_tokens": 2}}', "inputs"),
    ('{"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop_sequences": ["\\udfff"]}}', "stop_sequences"),
    ('{"inputs": "hi", "\\ud800": 1}', "\\ud800"),
    ("[" * 100000 + "]" * 100000, "body"),
    ('{"inputs": "hi", "parameters": {"max_new_tokens": ' + "9" * 5000 + "}}", "body"),
    ('{"inputs": "hi", "parameters": []}', "parameters"),
], ids=["surrogate-inputs", "surrogate-stop", "surrogate-key", "deep-nesting", "5000-digits", "parameters-list"])
def test_undecodable_text_and_deep_json_are_400(server, raw, field):
    """Before: 500 for the lone surrogates (the tokenizer raised), for 100k-deep nesting
    (RecursionError) and for a 5000-digit integer (Python's int digit limit); 200 for parameters [] (taken
    as none)."""
    with server.client() as c:
        r = c.post("/generate", content=raw.encode("utf-8"), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert strict_json(r.text)["error"]["param"] == field
        for path, body, f in [
            ("/v1/completions", '{"prompt": "a \\ud800"}', "prompt"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a \\udc00"}]}', "messages"),
        ]:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == f, r.text
        _still_serves(c)


def test_body_limit_is_413(server):
    """Before: no limit (a 20 MB body was tokenized, then refused with 400 after 20 s)."""
    small = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}}).encode()
    with server.client() as c:
        at_limit = small + b" " * (MAX_REQUEST_BODY_BYTES - len(small))  # valid JSON, exactly the limit
        assert c.post("/generate", content=at_limit, headers={"content-type": "application/json"}).status_code == 200
        r = c.post("/generate", content=at_limit + b" ", headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"

        def chunks():  # no Content-Length: the limit holds on the bytes read
            yield small
            for _ in range(MAX_REQUEST_BODY_BYTES // 2**20 + 1):
                yield b" " * 2**20
        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        _still_serves(c)


def test_a_large_prompt_does_not_block_health(server):
    """Before: the prompt was tokenized on the event loop, so /health waited as long as it took;
    then (issue 27) it was tokenized in full (1.3 s) on a worker thread before its 400. Now it is
    refused at once by its length in characters (test_connection_hardening has the details)."""
    big = "hello world, this is filler. " * 50000  # 1.5 MB: about 1.3 s to tokenize
    done = {}

    def post_big():
        t0 = time.time()
        with server.client() as c:
            done["status"] = c.post("/generate", json={"inputs": big}).status_code
        done["seconds"] = time.time() - t0

    th = threading.Thread(target=post_big)
    th.start()
    worst = 0.0
    with server.client() as c:
        while th.is_alive():
            t0 = time.time()
            assert c.get("/health").status_code == 200
            worst = max(worst, time.time() - t0)
            time.sleep(0.05)
    th.join()
    assert done["status"] == 400  # far longer than --max_req_total_len
    assert done["seconds"] < 1.0, "refused only after tokenizing"
    assert worst < 0.5, (worst, done)


def test_openai_max_completion_tokens_usage_chunk_and_unsupported_fields(server):
    """Before: max_completion_tokens was an unknown field; usage rode on the last content chunk
    of every stream; logprobs / echo / best_of / suffix were silently dropped; role 'bogus' passed."""
    msgs = [{"role": "user", "content": "Count from one to ten."}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 5, "ignore_eos": True,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 5, "max_tokens": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        assert c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 5, "max_tokens": 5,
                                                    "temperature": 0}).status_code == 200

        body = {"prompt": "1, 2, 3,", "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
        for include_usage in (True, False, None):
            extra = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
            with c.stream("POST", "/v1/completions", json={**body, **extra}) as r:
                events = sse_data(r.iter_lines())
            assert events[-1] == "[DONE]"
            chunks = [strict_json(e) for e in events[:-1]]
            if include_usage:
                *content, last = chunks
                assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
                assert all(ch["usage"] is None for ch in content)
            else:
                content = chunks
                assert all("usage" not in ch for ch in content)
            assert content[-1]["choices"][0]["finish_reason"] == "length"

        for field, value in [("logprobs", 21), ("logprobs", True), ("echo", True), ("best_of", 2), ("suffix", "x"),
                             ("n", True)]:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": None, "echo": False,
                                            "best_of": 1, "n": 1})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "logprobs": False})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "bogus", "content": "hi"}], "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages" and "role" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def _worker_pids(api_pid: int) -> List[int]:
    """The API server's spawned worker processes (not multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(api_pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "multiprocessing" in line and "resource_tracker" not in line]


def test_api_server_exits_nonzero_when_the_worker_dies(tmp_path):
    """Before: /health 503 and a 500 for every request, forever; the process never exited."""
    s = launch_server(["--max_req_total_len", "128", "--running_max_req_size", "2"], str(tmp_path / "server.log"))
    try:
        pids = _worker_pids(s.proc.pid)
        assert pids, "no worker process found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        code = s.proc.wait(timeout=30)
        assert code != 0
        assert "model worker exited" in open(s.log_path).read()
    finally:
        s.stop()


# ---------------------------------------------------------------- the scripted worker

@dataclasses.dataclass
class Script:
    token_ids: List[int]
    group: int = 1  # tokens per update (MTP commits several per step)
    interval_s: float = 0.01  # between updates
    logprob: float = -0.5


class ScriptedWorker:
    """Answers AddReq with ``script`` (cycled up to max_new_tokens), AbortReq by dropping the
    request; honours stop_token_ids like the real worker (token by token)."""

    def __init__(self, script: Script):
        self.script = script
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        self.aborts: List[tuple] = []  # (req_id, time)
        self.alive = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self.alive

    @property
    def exitcode(self) -> Optional[int]:
        return None if self.alive else -signal.SIGKILL

    def stop(self) -> None:
        self.in_q.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        reqs = {}  # req_id -> [AddReq, output ids]
        while True:
            try:
                msg = self.in_q.get(timeout=self.script.interval_s)
            except queue.Empty:
                msg = ...
            if msg is None:
                return
            if isinstance(msg, AddReq):
                reqs[msg.req_id] = [msg, []]
            elif isinstance(msg, AbortReq):
                self.aborts.append((msg.req_id, time.monotonic()))
                reqs.pop(msg.req_id, None)
            if not self.alive or not reqs:
                continue
            updates = [self._step(req, out) for req, out in reqs.values()]
            for u in updates:
                if u.finish_reason is not None:
                    reqs.pop(u.req_id)
            self.out_q.put((updates, WorkerStats(0, len(reqs), 0, StepTiming())))

    def _step(self, req: AddReq, out: List[int]) -> ReqStepUpdate:
        new, finish = [], None
        for _ in range(self.script.group):
            out.append(self.script.token_ids[len(out) % len(self.script.token_ids)])
            new.append(out[-1])
            if any(out[-len(s):] == s for s in req.params.stop_token_ids if len(s) <= len(out)):
                finish = "stop"
            elif len(out) >= req.params.max_new_tokens:
                finish = "length"
            if finish:
                break
        return ReqStepUpdate(req_id=req.req_id, token_ids=new, logprobs=[self.script.logprob] * len(new),
                             finish_reason=finish, prompt_tokens=len(req.prompt_ids), mtp_accepted_token_num=0,
                             asd_relaxed_token_num=0, asd_regret_spent=0.0, accept_len=len(new))


@dataclasses.dataclass
class ScriptedApp:
    url: str
    manager: HttpServerManager
    worker: ScriptedWorker
    exit_codes: List[int]


@contextmanager
def scripted(script: Script, **args):
    """The real app over a ScriptedWorker, served by uvicorn on a free port in a thread; ``args``:
    StartArgs fields."""
    worker = ScriptedWorker(script)
    args = dataclasses.replace(StartArgs(), resolved_model_dir=get_default_model_dir(),
                               max_req_total_len=MAX_REQ_TOTAL_LEN, **args)
    ready = WorkerReady(vocab_size=49152, max_total_token_num=4096, device="cpu", data_type="float32")
    manager = HttpServerManager(args, worker.in_q, worker.out_q, ready, worker=worker)
    exit_codes: List[int] = []
    app = create_app(manager, exit_process=exit_codes.append)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    try:
        yield ScriptedApp(f"http://127.0.0.1:{port}", manager, worker, exit_codes)
    finally:
        srv.should_exit = True
        th.join(10)
        worker.stop()


def _generate(app: ScriptedApp, params: dict) -> dict:
    r = httpx.post(app.url + "/generate", timeout=30, json={"inputs": "Q", "parameters": params})
    assert r.status_code == 200, r.text
    return strict_json(r.text)


def _stream(app: ScriptedApp, path: str, body: dict) -> List[dict]:
    with httpx.stream("POST", app.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        return [strict_json(e) for e in sse_data(r.iter_lines()) if e != "[DONE]"]


@pytest.mark.parametrize("group", [1, 4])
def test_streams_hold_back_a_possible_stop_string(tok, group):
    """Before: the stream sent 'To find 7 * 6,' (final text 'To find 7 *') and /generate_stream
    sent token events for ' ', '6', ',' and ' we' past the stop."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    kept = "To find 7 *"
    kept_ids = tok.encode(kept, add_special_tokens=False)
    assert ids[:len(kept_ids)] == kept_ids  # the reference: the kept text's own tokens
    with scripted(Script(ids, group=group)) as app:
        for stop, final in [(" 6, we", kept), (" 6, wx", TEXT)]:  # the second never completes
            body = {"prompt": "Q", "max_tokens": len(ids), "stop": stop, "stream": True}
            chunks = _stream(app, "/v1/completions", body)
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == final
            events = _stream(app, "/generate_stream", {"inputs": "Q", "parameters": {
                "max_new_tokens": len(ids), "stop_sequences": [stop]}})
            token_ids = [e["token"]["id"] for e in events if e["token"] is not None]
            assert token_ids == (kept_ids if final == kept else ids)
            assert events[-1]["finished"] and events[-1]["generated_text"] == final
            assert sum(e["finished"] for e in events) == 1


@pytest.mark.parametrize("group", [1, 4])
def test_generate_stream_token_texts_add_up_to_the_text(tok, group):
    """Each /generate_stream event's token text is what it adds to the text: emoji split over byte tokens
    and a stop string cut inside a token. Before: each token decoded alone ('\ufffd' for every emoji byte
    token, ' we' past a stop that keeps 'w'), so the events did not add up to generated_text."""
    emoji = "Party: 🎉🎉 done 🍕."
    for text, stop, final in [(emoji, None, emoji), (TEXT, "e multiply", "To find 7 * 6, w")]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any(tok.decode([t]).endswith("\ufffd") for t in ids) == (text == emoji)  # split characters
        params = {"max_new_tokens": len(ids), **({"stop_sequences": [stop]} if stop else {})}
        with scripted(Script(ids, group=group)) as app:
            events = _stream(app, "/generate_stream", {"inputs": "Q", "parameters": params})
            out = _generate(app, {**params, "return_details": True})
        assert events[-1]["generated_text"] == final == out["generated_text"][0]
        assert "".join(e["token"]["text"] for e in events if e["token"] is not None) == final
        # the details keep each token's own text (with its log-prob)
        assert [t["text"] for t in out["tokens"]] == [tok.decode([t]) for t in ids[:len(out["tokens"])]]


@pytest.mark.parametrize("group", [1, 4])
def test_token_counts_end_at_a_stop_string_whatever_the_grouping(tok, group):
    """Stop '6, w' is not a token sequence of the text, so only the HTTP side sees it. Before:
    counts ran to the end of the update that completed the stop: 9 one token per update, 12
    in MTP-like groups of 4, instead of the 6 tokens of 'To find 7 * '."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    kept_ids = tok.encode("To find 7 * ", add_special_tokens=False)
    assert ids[:len(kept_ids)] == kept_ids
    with scripted(Script(ids, group=group)) as app:
        before = app.manager.metrics.generation_tokens._value.get()
        out = _generate(app, {"max_new_tokens": len(ids), "stop_sequences": ["6, w"], "return_details": True})
        assert out["generated_text"] == ["To find 7 * "] and out["finish_reason"] == "stop"
        assert out["count_output_tokens"] == len(kept_ids)
        assert [t["id"] for t in out["tokens"]] == kept_ids
        assert app.manager.metrics.generation_tokens._value.get() - before == len(kept_ids)
        r = httpx.post(app.url + "/v1/completions", timeout=30,
                       json={"prompt": "Q", "max_tokens": len(ids), "stop": "6, w"}).json()
        assert r["usage"]["completion_tokens"] == len(kept_ids)
        events = _stream(app, "/generate_stream", {"inputs": "Q", "parameters": {
            "max_new_tokens": len(ids), "stop_sequences": ["6, w"]}})
        assert events[-1]["details"]["count_output_tokens"] == len(kept_ids)


def test_abandoned_non_streaming_request_is_aborted_within_a_second(tok, caplog):
    """Before: tokens kept flowing, the 1 s queue timeout never fired: no abort at all (and
    an abort, when it came, logged a CancelledError traceback)."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    caplog.set_level(logging.INFO)
    with scripted(Script(ids, interval_s=0.02)) as app:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(app.url + "/generate", timeout=0.5,
                       json={"inputs": "Q", "parameters": {"max_new_tokens": 200, "ignore_eos": True}})
        hung_up = time.monotonic()
        while not app.worker.aborts and time.monotonic() - hung_up < 5:
            time.sleep(0.05)
        assert app.worker.aborts, "the request was never aborted"
        assert app.worker.aborts[0][1] - hung_up < 1.2
        assert hung_up - t0 < 1.0
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()
                or "CancelledError" in r.getMessage()]


def test_abandoned_request_the_worker_does_not_answer_is_aborted_within_a_second(tok):
    """The disconnect poll also runs while no update comes (one timer wakes every waiting request
    each DISCONNECT_POLL_S, instead of a timeout on each wait for an update)."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    with scripted(Script(ids, interval_s=5.0)) as app:  # one update per message, then 5 s of silence
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(app.url + "/generate", timeout=0.5,
                       json={"inputs": "Q", "parameters": {"max_new_tokens": 200, "ignore_eos": True}})
        hung_up = time.monotonic()
        while not app.worker.aborts and time.monotonic() - hung_up < 3:
            time.sleep(0.05)
        assert app.worker.aborts, "the request was never aborted"
        assert app.worker.aborts[0][1] - hung_up < 1.2
        assert app.manager.token_text(ids[0]) == tok.decode([ids[0]])


def test_non_finite_logprobs_are_sent_as_null(tok):
    """Before: /generate answered 500 (JSON has no NaN) and /generate_stream sent "logprob": NaN."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    with scripted(Script(ids, logprob=math.nan)) as app:
        out = _generate(app, {"max_new_tokens": 3, "return_details": True})
        assert [t["logprob"] for t in out["tokens"]] == [None] * 3
        events = _stream(app, "/generate_stream", {"inputs": "Q", "parameters": {"max_new_tokens": 3}})
        assert [e["token"]["logprob"] for e in events] == [None] * 3


def test_worker_death_fails_waiting_requests_and_exits(tok):
    """Before: create_app had no exit hook and waiting requests got a 500 only after the 1 s
    timeout, then every request a 500 forever."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    with scripted(Script(ids, interval_s=0.05)) as app:
        result = {}

        def wait_long():
            result["r"] = httpx.post(app.url + "/generate", timeout=30, json={
                "inputs": "Q", "parameters": {"max_new_tokens": 400, "ignore_eos": True}})

        th = threading.Thread(target=wait_long)
        th.start()
        time.sleep(0.3)
        died = time.monotonic()
        app.worker.alive = False
        th.join(10)
        assert result["r"].status_code == 503, result["r"].text
        assert httpx.get(app.url + "/health").status_code == 503
        while not app.exit_codes and time.monotonic() - died < 5:
            time.sleep(0.05)
        assert app.exit_codes == [1]
        assert time.monotonic() - died < 3


def test_stop_prefix_len_matches_brute_force():
    """The hold-back rule against the definition, over random short strings (a new function)."""
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randrange(0, 9)))
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        want = max((k for k in range(len(text) + 1) for s in stops
                    if k < len(s) and s.startswith(text[len(text) - k:])), default=0)
        assert stop_prefix_len(text, stops) == want, (text, stops)
