"""The prompt cache at the HTTP edge: the cached prompt tokens of each request in the responses
(LightLLM's prompt_cached_tokens, OpenAI's usage.prompt_tokens_details.cached_tokens), and the
cache's series of /metrics, from a scripted worker whose updates and stats are made up here (as
test_hostile_client's): every expected value is computed by hand from the script."""
import dataclasses
import queue
import threading
import time
from contextlib import contextmanager
from typing import List, Optional, Sequence

import httpx
import pytest
import uvicorn

from lightllm.server.api_http import create_app
from lightllm.server.core.objs.messages import (AbortReq, AddReq, PromptCacheStats, ReqStepUpdate, StepTiming,
                                                WorkerReady, WorkerStats)
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.metrics import ServerMetrics
from lightllm.tools import client
from lightllm.utils.embedded_model import get_default_model_dir
from lightllm.utils.server_launcher import MetricsPage, free_port, scrape, sse_data, strict_json

MAX_REQ_TOTAL_LEN = 512
PROMPT = "the rain in spain stays mainly in the plain"
CHAT = [{"role": "user", "content": PROMPT}]
NEW_TOKENS = 3
OUT_TOKEN = 330  # any ordinary token id of the vocabulary
# Prompt tokens each request finds in the cache, in the order the worker receives them
CACHED = (4, 7, 2, 6, 5, 3, 1, 8, 4, 2)
EVICTED_PER_REQ = 2  # tokens the worker says it evicted to admit each request
SERVER_START_S = 30


class CacheWorker:
    """Answers every AddReq with NEW_TOKENS tokens, one per update, as if the next value of
    ``cached`` of its prompt came from the prompt cache (every update says so); each step's stats
    carry the cache's totals since start (None with ``cache_on`` False: the cache is off)."""

    def __init__(self, cached: Sequence[int], cache_on: bool = True):
        self.cached = list(cached)
        self.cache_on = cache_on
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        self.hit = self.computed = self.evicted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return True

    exitcode = None

    def stop(self) -> None:
        self.in_q.put(None)
        self._thread.join(5)

    def _cache(self) -> Optional[PromptCacheStats]:
        if not self.cache_on:
            return None
        return PromptCacheStats(cached_tokens=self.computed - self.evicted, hit_tokens_total=self.hit,
                                computed_tokens_total=self.computed, evicted_tokens_total=self.evicted)

    def _run(self) -> None:
        reqs = {}  # req_id -> [AddReq, cached tokens, tokens sent]
        while True:
            msg = self.in_q.get()
            while True:  # everything that arrived: choices of one request are admitted together
                if msg is None:
                    return
                if isinstance(msg, AddReq):
                    cached = self.cached.pop(0) if self.cache_on else 0
                    reqs[msg.req_id] = [msg, cached, 0]
                    self.hit += cached
                    self.computed += len(msg.prompt_ids) - cached
                    self.evicted += EVICTED_PER_REQ if self.cache_on else 0
                elif isinstance(msg, AbortReq):
                    reqs.pop(msg.req_id, None)
                try:
                    msg = self.in_q.get_nowait()
                except queue.Empty:
                    break
            while reqs:
                updates = []
                for req_id, entry in list(reqs.items()):
                    req, cached, sent = entry
                    entry[2] = sent = sent + 1
                    finish = "length" if sent >= req.params.max_new_tokens else None
                    if finish:
                        del reqs[req_id]
                    updates.append(ReqStepUpdate(
                        req_id=req_id, token_ids=[OUT_TOKEN], logprobs=[-0.5], finish_reason=finish,
                        prompt_tokens=len(req.prompt_ids), mtp_accepted_token_num=0, asd_relaxed_token_num=0,
                        asd_regret_spent=0.0, prompt_cached_tokens=cached))
                self.out_q.put((updates, WorkerStats(0, len(reqs), 0, StepTiming(), prompt_cache=self._cache())))


@dataclasses.dataclass
class CacheApp:
    url: str
    manager: HttpServerManager
    worker: CacheWorker


@contextmanager
def cache_app(cached: Sequence[int], cache_on: bool = True):
    """The real app and manager over a CacheWorker, served by uvicorn on a free port in a thread."""
    worker = CacheWorker(cached, cache_on)
    args = dataclasses.replace(StartArgs(), resolved_model_dir=get_default_model_dir(),
                               max_req_total_len=MAX_REQ_TOTAL_LEN)
    ready = WorkerReady(vocab_size=49152, max_total_token_num=4096, device="cpu", data_type="float32")
    manager = HttpServerManager(args, worker.in_q, worker.out_q, ready, worker=worker)
    app = create_app(manager, exit_process=lambda code: None)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + SERVER_START_S
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    try:
        yield CacheApp(f"http://127.0.0.1:{port}", manager, worker)
    finally:
        srv.should_exit = True
        th.join(10)
        worker.stop()


def _post(app: CacheApp, path: str, body: dict) -> dict:
    r = httpx.post(app.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return strict_json(r.text)


def _stream(app: CacheApp, path: str, body: dict) -> List[dict]:
    with httpx.stream("POST", app.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    return [strict_json(d) for d in data if d != "[DONE]"]


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _prompt_lens(manager: HttpServerManager):
    """(completions prompt tokens, chat prompt tokens), as the server tokenizes them."""
    return len(manager.encode_prompt(PROMPT)), len(manager.apply_chat_template(CHAT))


def test_responses_carry_the_cached_prompt_tokens():
    with cache_app(CACHED) as app:
        plain, chat = _prompt_lens(app.manager)
        assert plain > max(CACHED)  # every scripted cache hit fits in the prompt
        params = {"max_new_tokens": NEW_TOKENS}
        # LightLLM /generate: next to prompt_tokens (request 0: CACHED[0])
        out = _post(app, "/generate", {"inputs": PROMPT, "parameters": params})
        assert (out["prompt_tokens"], out["prompt_cached_tokens"]) == (plain, CACHED[0])
        # /generate_stream: in the details of the last event (request 1)
        events = _stream(app, "/generate_stream", {"inputs": PROMPT, "parameters": params})
        assert [e["details"] for e in events[:-1]] == [None] * (NEW_TOKENS - 1)
        details = events[-1]["details"]
        assert (details["prompt_tokens"], details["prompt_cached_tokens"]) == (plain, CACHED[1])
        # OpenAI, not streamed (requests 2, 3)
        body = {"max_tokens": NEW_TOKENS, "temperature": 0}
        out = _post(app, "/v1/completions", {"prompt": PROMPT, **body})
        assert out["usage"] == _usage(plain, NEW_TOKENS, CACHED[2])
        out = _post(app, "/v1/chat/completions", {"messages": CHAT, **body})
        assert out["usage"] == _usage(chat, NEW_TOKENS, CACHED[3])
        # OpenAI, streamed with include_usage: only the extra last chunk has usage (requests 4, 5)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for i, (path, prompt, n) in enumerate([("/v1/completions", {"prompt": PROMPT}, plain),
                                               ("/v1/chat/completions", {"messages": CHAT}, chat)]):
            chunks = _stream(app, path, {**prompt, **streamed})
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == _usage(n, NEW_TOKENS, CACHED[4 + i])
        # n = 2: the prompt once, as prompt_tokens, with the fewer cached tokens of its two choices
        out = _post(app, "/v1/completions", {"prompt": PROMPT, "n": 2, **body})  # requests 6, 7
        assert out["usage"] == _usage(plain, 2 * NEW_TOKENS, min(CACHED[6:8]))
        chunks = _stream(app, "/v1/chat/completions", {"messages": CHAT, "n": 2, **streamed})  # requests 8, 9
        assert chunks[-1]["usage"] == _usage(chat, 2 * NEW_TOKENS, min(CACHED[8:10]))
        # the cache's series over the same requests: 2 with the completions prompt, then 2 chat, ...
        lens = [plain, plain, plain, chat, plain, chat, plain, plain, chat, chat]
        computed = sum(n - c for n, c in zip(lens, CACHED))
        evicted = EVICTED_PER_REQ * len(CACHED)
        page = scrape(app.url)
        assert page.value(client.PROMPT_CACHE_HIT_TOKENS) == sum(CACHED)
        assert page.value(client.PROMPT_TOKENS_COMPUTED) == computed
        assert page.value(client.PROMPT_CACHE_EVICTED_TOKENS) == evicted
        assert page.value(client.PROMPT_CACHE_TOKENS) == computed - evicted
        assert page.value(client.PROMPT_CACHE_HIT_RATE) == pytest.approx(sum(CACHED) / (sum(CACHED) + computed))


def test_cache_off_reports_zero_and_leaves_the_series_at_zero():
    with cache_app(CACHED, cache_on=False) as app:
        plain, _ = _prompt_lens(app.manager)
        out = _post(app, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS}})
        assert (out["prompt_tokens"], out["prompt_cached_tokens"]) == (plain, 0)
        out = _post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": NEW_TOKENS})
        assert out["usage"] == _usage(plain, NEW_TOKENS, 0)
        page = scrape(app.url)
        for name in (client.PROMPT_CACHE_TOKENS, client.PROMPT_CACHE_HIT_TOKENS, client.PROMPT_TOKENS_COMPUTED,
                     client.PROMPT_CACHE_EVICTED_TOKENS, client.PROMPT_CACHE_HIT_RATE):
            assert page.value(name) == 0.0, name  # registered, never updated
        assert page.value("lightllm_generation_tokens_total") == 2 * NEW_TOKENS  # the requests did run


# ---------------------------------------------------------------- ServerMetrics alone

def _stats(cache: Optional[PromptCacheStats]) -> WorkerStats:
    return WorkerStats(kv_used_tokens=0, running_reqs=0, waiting_reqs=0, timing=StepTiming(), prompt_cache=cache)


def _page(m: ServerMetrics) -> dict:
    page = MetricsPage.parse(m.render().decode())
    return {"tokens": page.value(client.PROMPT_CACHE_TOKENS), "hit": page.value(client.PROMPT_CACHE_HIT_TOKENS),
            "computed": page.value(client.PROMPT_TOKENS_COMPUTED),
            "evicted": page.value(client.PROMPT_CACHE_EVICTED_TOKENS), "rate": page.value(client.PROMPT_CACHE_HIT_RATE)}


def test_counters_advance_by_the_totals_increase_and_survive_a_reset():
    m = ServerMetrics()
    assert _page(m) == {"tokens": 0, "hit": 0, "computed": 0, "evicted": 0, "rate": 0}
    m.observe_worker(_stats(PromptCacheStats(cached_tokens=30, hit_tokens_total=10, computed_tokens_total=30,
                                             evicted_tokens_total=0)))
    assert _page(m) == {"tokens": 30, "hit": 10, "computed": 30, "evicted": 0, "rate": 0.25}
    # the same totals again (a gauge-only refresh): the counters stay
    m.observe_worker(_stats(PromptCacheStats(30, 10, 30, 0)))
    assert _page(m) == {"tokens": 30, "hit": 10, "computed": 30, "evicted": 0, "rate": 0.25}
    m.observe_worker(_stats(PromptCacheStats(cached_tokens=20, hit_tokens_total=40, computed_tokens_total=50,
                                             evicted_tokens_total=25)))
    assert _page(m) == {"tokens": 20, "hit": 40, "computed": 50, "evicted": 25, "rate": 40 / 90}
    # the cache off for a message (None): nothing moves, and the totals seen last are kept
    m.observe_worker(_stats(None))
    assert _page(m) == {"tokens": 20, "hit": 40, "computed": 50, "evicted": 25, "rate": 40 / 90}
    m.observe_worker(_stats(PromptCacheStats(20, 44, 56, 25)))
    assert _page(m) == {"tokens": 20, "hit": 44, "computed": 56, "evicted": 25, "rate": 44 / 100}
    # a worker that started counting again: its new totals are all increase, nothing goes back
    m.observe_worker(_stats(PromptCacheStats(cached_tokens=5, hit_tokens_total=3, computed_tokens_total=5,
                                             evicted_tokens_total=0)))
    assert _page(m) == {"tokens": 5, "hit": 47, "computed": 61, "evicted": 25, "rate": 3 / 8}
    # and from there by increases again
    m.observe_worker(_stats(PromptCacheStats(5, 4, 9, 1)))
    assert _page(m) == {"tokens": 5, "hit": 48, "computed": 65, "evicted": 26, "rate": 4 / 13}


def test_cache_off_updates_no_series():
    m = ServerMetrics()
    for _ in range(3):
        m.observe_worker(WorkerStats(kv_used_tokens=7, running_reqs=1, waiting_reqs=0, timing=StepTiming()))
    assert _page(m) == {"tokens": 0, "hit": 0, "computed": 0, "evicted": 0, "rate": 0}
    assert MetricsPage.parse(m.render().decode()).value(client.KV_USED_TOKENS) == 7  # the rest is observed
