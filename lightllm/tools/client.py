"""The tools' and benchmarks' one way to run the engine and talk to it (docs/tools.md).

Closed-loop waves (``send_all``, ``send_timed``) run one thread per request in flight, each on its
own keep-alive ``http.client`` connection: a client must not be what limits the requests in
flight, and httpx's asyncio client spent ~6 ms of CPU per request at 64 in flight (0.4 ms here;
docs/decode_step.md). httpx (streams, the front-end benchmark) is imported only where used.
"""
import argparse
import asyncio
import gc
import http.client
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from lightllm.server.metrics import ServerMetrics
from lightllm.utils.server_launcher import SSE_DATA_PREFIX, Server, launch_server

REQUEST_TIMEOUT_S = 3600.0
WARMUP_REQUESTS = 32
WARMUP_MAX_NEW_TOKENS = 32
MAX_LEN_ROUND = 64  # an automatic --max_req_total_len is rounded up to a multiple of this
# A client's event loop sleeps this long, over and over, while it streams; the overshoot is its lag (a client
# whose loop lags stamps chunks late, so its own CPU would show up as the server's inter-token latency)
LAG_PROBE_S = 0.005
DEFAULT_BATCH_MAX_TOKENS = 4096  # prefill chunk: a few dozen GSM8K prompts per prefill step


def server_flags(**start_args) -> List[str]:
    """``--name value`` per StartArgs field that is not None (a list gives several values)."""
    flags = []
    for name, value in start_args.items():
        if value is not None:
            flags += [f"--{name}", *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return flags


@dataclass(frozen=True)
class AsdSetting:
    """ASD's budget B, local regret ratio g and block mismatch cap m (docs/asd.md)."""

    budget: float
    local_ratio: Optional[float] = None  # None: no local gate
    max_mismatch: Optional[int] = None  # None: no cap

    @classmethod
    def q25(cls, q: float) -> "AsdSetting":
        """The calibration recipe: B = g = q, m = 1."""
        return cls(q, q, 1)

    def start_args(self) -> Dict[str, object]:
        return dict(mtp_asd_regret_budget=self.budget, mtp_asd_local_regret_ratio=self.local_ratio,
                    mtp_asd_block_max_mismatch=self.max_mismatch)


USAGE = AsdSetting(2.0625, 0.25, 2)  # the usage setting of docs/asd.md


def engine_parser(max_new_tokens: int = 256, running_max_req_size: Optional[int] = None,
                  running_help: str = "requests decoded together") -> argparse.ArgumentParser:
    """The flags of the target, its MTP draft and the request lengths: a parent of the tools' parsers."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model_dir", type=os.path.abspath, default=None,
                   help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--mtp_draft_model_dir", type=os.path.abspath, nargs="+", default=None,
                   help="draft dir(s) (default: the packaged draft for the model)")
    p.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
    p.add_argument("--running_max_req_size", type=int, default=running_max_req_size, help=running_help)
    p.add_argument("--max_req_total_len", type=int, default=None,
                   help=f"default: longest prompt + max_new_tokens, rounded up to {MAX_LEN_ROUND}")
    return p


def model_dir_or_embedded(model_dir: Optional[str]) -> str:
    """``model_dir`` made absolute, or the embedded model's folder (converted on first use) when None."""
    if model_dir:
        return os.path.abspath(model_dir)
    from lightllm.utils.embedded_model import get_default_model_dir

    return get_default_model_dir()


def auto_max_req_total_len(prompt_lens: Sequence[int], max_new_tokens: int) -> int:
    """The longest prompt plus ``max_new_tokens``, rounded up to a multiple of MAX_LEN_ROUND."""
    need = max(prompt_lens) + max_new_tokens
    return -(-need // MAX_LEN_ROUND) * MAX_LEN_ROUND


def wave_server_flags(model_dir: Optional[str], running_max_req_size: int, max_req_total_len: int) -> List[str]:
    """A server for waves of requests (model_dir None: the embedded model); the prefill chunk
    holds at least one whole request."""
    return server_flags(model_dir=model_dir, running_max_req_size=running_max_req_size,
                        max_req_total_len=max_req_total_len,
                        batch_max_tokens=max(DEFAULT_BATCH_MAX_TOKENS, max_req_total_len))


def server_env() -> Dict[str, str]:
    """This process's environment, with Triton kernels in the interpreter when there is no GPU."""
    import torch

    env = dict(os.environ)
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)
    else:
        env.setdefault("TRITON_INTERPRET", "1")
    return env


@contextmanager
def serve(flags: Sequence[str], log_path: str) -> Iterator[Server]:
    """A running server with ``flags`` (its output in ``log_path``), stopped on leaving."""
    server = launch_server(list(flags), log_path, env=server_env())
    try:
        yield server
    finally:
        server.stop()


def generate_body(text: str, max_new_tokens: int, asd_regret_budget: Optional[float] = None,
                  **params) -> Dict:
    """A greedy ``/generate`` request; ``asd_regret_budget`` overrides the server's budget for it."""
    params = {"max_new_tokens": max_new_tokens, "do_sample": False, **params}
    if asd_regret_budget is not None:
        params["asd_regret_budget"] = asd_regret_budget
    return {"inputs": text, "parameters": params}


def warm_up(url: str, texts: Sequence[str], max_new_tokens: int, concurrency: int,
            requests: int = WARMUP_REQUESTS) -> None:
    """An untimed wave of short requests, so kernel compilation is not timed."""
    n = min(WARMUP_MAX_NEW_TOKENS, max_new_tokens)
    send_all(url, [generate_body(t, n) for t in texts[:requests]], concurrency)


class _Connection:
    """One thread's keep-alive connection to the server."""

    # a reused connection the server closed while it sat idle: open a new one and send again
    STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)

    def __init__(self, url: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.conn: Optional[http.client.HTTPConnection] = None

    def post(self, path: str, body: Dict) -> http.client.HTTPResponse:
        """Send ``body`` as JSON; the response with its body unread."""
        data = json.dumps(body).encode()
        reused = self.conn is not None
        try:
            return self._send(path, data)
        except self.STALE:
            self.close()
            if not reused:
                raise
        return self._send(path, data)

    def _send(self, path: str, data: bytes) -> http.client.HTTPResponse:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        return self.conn.getresponse()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _threaded(url: str, items: Sequence, concurrency: int, desc: Optional[str], call: Callable,
              on_last_start: Optional[Callable[[], None]] = None) -> List:
    """``call(connection, item)`` for every item on ``concurrency`` threads (a keep-alive
    connection each); results in order. ``on_last_start``: called once, on the thread that is about to
    send the last item (nothing is left to send from then on)."""
    from tqdm import tqdm

    local, opened, lock = threading.local(), [], threading.Lock()
    bar = tqdm(total=len(items), desc=desc, unit="req", disable=desc is None)

    def one(index: int):
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = _Connection(url)
            with lock:
                opened.append(conn)
        if on_last_start is not None and index == len(items) - 1:
            on_last_start()
        out = call(conn, items[index])
        bar.update(1)
        return out

    try:
        with ThreadPoolExecutor(max(1, min(concurrency, len(items))), thread_name_prefix="client") as pool:
            return list(pool.map(one, range(len(items))))
    finally:
        bar.close()
        for conn in opened:
            conn.close()


def _post_json(conn: _Connection, path: str, body: Dict) -> Dict:
    r = conn.post(path, body)
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{path} returned HTTP {r.status}: {data.decode(errors='replace')}")
    return json.loads(data)


async def _bounded(url: str, items: Sequence, concurrency: int, desc: Optional[str], call: Callable) -> List:
    """``await call(client, item)`` for every item, at most ``concurrency`` at once; results in order."""
    import httpx
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    bar = tqdm(total=len(items), desc=desc, unit="req", disable=desc is None)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def one(item):
            async with sem:
                out = await call(client, item)
            bar.update(1)
            return out

        try:
            return list(await asyncio.gather(*(one(x) for x in items)))
        finally:
            bar.close()


def send_all(url: str, bodies: Sequence[Dict], concurrency: int, desc: Optional[str] = None,
             path: str = "/generate") -> List[Dict]:
    """POST every body to ``path`` (``/generate``, ``/v1/completions``, ...), at most ``concurrency``
    in flight; the JSON responses in order."""
    return _threaded(url, bodies, concurrency, desc, lambda c, b: _post_json(c, path, b))


@dataclass
class Timed:
    """One request's response and its client-side times."""

    response: Dict  # the JSON response; streamed: the final event
    latency_s: float
    ttft_s: Optional[float] = None  # streamed only
    streamed_tokens: Optional[int] = None  # streamed only: events that carried a token
    sent_s: float = float("nan")  # time.perf_counter() when it was sent

    @property
    def done_s(self) -> float:
        return self.sent_s + self.latency_s


def _timed(conn: _Connection, body: Dict, stream: bool) -> Timed:
    t0 = time.perf_counter()
    if not stream:
        out = _post_json(conn, "/generate", body)
        return Timed(out, time.perf_counter() - t0, sent_s=t0)
    ttft, tokens, last = None, 0, None
    r = conn.post("/generate_stream", body)
    if r.status != 200:
        raise RuntimeError(f"/generate_stream returned HTTP {r.status}: {r.read().decode(errors='replace')}")
    prefix = SSE_DATA_PREFIX.encode()
    for line in iter(r.readline, b""):
        if not line.startswith(prefix):
            continue
        last = json.loads(line[len(prefix):])
        if last.get("token") is not None:
            tokens += 1
            ttft = time.perf_counter() - t0 if ttft is None else ttft
    if last is None or not last.get("finished"):
        raise RuntimeError(f"/generate_stream ended without a finished event (last: {last})")
    return Timed(last, time.perf_counter() - t0, ttft, tokens, sent_s=t0)


def send_timed(url: str, bodies: Sequence[Dict], concurrency: int, stream: bool = False,
               desc: Optional[str] = None,
               on_last_start: Optional[Callable[[], None]] = None) -> Tuple[List[Timed], float]:
    """``/generate`` (or ``/generate_stream``) for every body; the timed responses in order and the wall time.
    ``on_last_start``: as ``_threaded``'s (e.g. a /metrics snapshot where a wave's drain begins)."""
    t0 = time.perf_counter()
    out = _threaded(url, bodies, concurrency, desc, lambda c, b: _timed(c, b, stream), on_last_start)
    return out, time.perf_counter() - t0


# Streamed OpenAI completions with a client-side clock per chunk (the serving benchmark)
COMPLETIONS_PATH = "/v1/completions"
STREAM_START_TIMEOUT_S = 120.0  # client processes: the longest wait for all of them to be ready


def completion_stream_body(text: str, max_new_tokens: int, ignore_eos: bool = False, **params) -> Dict:
    """A greedy streamed ``/v1/completions`` request whose chunks list their tokens (``logprobs`` 0:
    the log-prob of each token sent, so a chunk says how many tokens it carries) and whose last
    event is the usage."""
    return {"prompt": text, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": ignore_eos,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}, **params}


@dataclass
class StreamTrace:
    """One streamed request on the client's clock (``time.perf_counter`` seconds: CLOCK_MONOTONIC
    on Linux, so the traces of several client processes share one clock)."""

    sent_s: float
    # (arrival, tokens): one entry per network read that brought tokens. The server sends one
    # chunk per result of the request (a decode step: 1 token, or up to K + 1 with MTP; every step
    # that waited, when the HTTP process is behind the worker); chunks a slow client reads together
    # count as one, their tokens summed
    chunks: List[Tuple[float, int]]
    done_s: float
    prompt_tokens: int = -1
    output_tokens: int = 0  # the usage's completion_tokens
    finish_reason: Optional[str] = None
    mtp_accepted_token_num: int = 0

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunks[0][0] - self.sent_s if self.chunks else None


def event_tokens(event: Dict) -> int:
    """Tokens a streamed completions event carries: each choice's log-prob tokens (``completion_stream_body``
    asks for them)."""
    return sum(len((c.get("logprobs") or {}).get("tokens") or ()) for c in event.get("choices", ()))


async def _streamed(client, body: Dict) -> StreamTrace:
    sent = time.perf_counter()
    chunks: List[Tuple[float, int]] = []
    trace = StreamTrace(sent, chunks, sent)
    buf = b""
    async with client.stream("POST", COMPLETIONS_PATH, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{COMPLETIONS_PATH} returned HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for data in r.aiter_bytes():
            now = time.perf_counter()  # before parsing: the parse's time is not the server's
            *events, buf = (buf + data).split(b"\n\n")
            tokens = 0
            for event in events:
                payload = event.strip()
                if not payload.startswith(SSE_DATA_PREFIX.encode()) or payload.endswith(b"[DONE]"):
                    continue
                obj = json.loads(payload[len(SSE_DATA_PREFIX):])
                if "error" in obj:
                    raise RuntimeError(f"{COMPLETIONS_PATH} stream failed: {obj['error']}")
                if obj.get("usage"):
                    trace.prompt_tokens = obj["usage"]["prompt_tokens"]
                    trace.output_tokens = obj["usage"]["completion_tokens"]
                tokens += event_tokens(obj)
                for choice in obj["choices"]:
                    if choice.get("finish_reason"):
                        trace.finish_reason = choice["finish_reason"]
                        trace.mtp_accepted_token_num = obj.get("mtp_accepted_token_num") or 0
            if tokens:
                chunks.append((now, tokens))
    trace.done_s = time.perf_counter()
    if trace.finish_reason is None:
        raise RuntimeError(f"{COMPLETIONS_PATH} stream ended without a finish reason")
    return trace


async def with_lag_probe(coro, lag: List[Tuple[float, float]]):
    """Await ``coro`` while sampling this event loop's lag into ``lag``: (time.time(), seconds late)."""
    async def probe():
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            lag.append((time.time(), loop.time() - t - LAG_PROBE_S))

    task = asyncio.ensure_future(probe())
    try:
        return await coro
    finally:
        task.cancel()


def _stream_worker(index: int, url: str, bodies: Sequence[Dict], concurrency: int, desc: Optional[str],
                   barrier, out_q) -> None:
    """One client process of ``send_streamed``: its share of the requests once every process is ready,
    and its loop's lag samples."""
    try:
        import httpx  # noqa: F401 (imported before the start: not timed)

        barrier.wait(STREAM_START_TIMEOUT_S)
        lag: List[Tuple[float, float]] = []
        traces = asyncio.run(with_lag_probe(_bounded(url, bodies, concurrency, desc, _streamed), lag))
        out_q.put((index, (traces, lag), None))
    except BaseException as e:  # the parent raises it
        out_q.put((index, None, f"{type(e).__name__}: {e}"))


def send_streamed(url: str, bodies: Sequence[Dict], concurrency: int, procs: int = 1,
                  desc: Optional[str] = None, lag: Optional[List[Tuple[float, float]]] = None) -> List[StreamTrace]:
    """Stream every body (``completion_stream_body``) closed-loop, at most ``concurrency`` in flight;
    the traces in order. ``procs`` > 1: that many client processes (so that one Python client's
    parsing does not delay the arrival times), process p sending bodies p, p + procs, ... closed-loop
    at its share of ``concurrency``, all starting together. ``lag`` gets every client process's loop
    lag samples (``with_lag_probe``)."""
    lag = [] if lag is None else lag
    procs = max(1, min(procs, concurrency, len(bodies)))
    if procs == 1:
        return asyncio.run(with_lag_probe(_bounded(url, bodies, concurrency, desc, _streamed), lag))
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    barrier, out_q = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_stream_worker, daemon=True,
                           args=(p, url, list(bodies[p::procs]), concurrency // procs + (p < concurrency % procs),
                                 desc if p == 0 else None, barrier, out_q)) for p in range(procs)]
    for w in workers:
        w.start()
    results: Dict[int, List[StreamTrace]] = {}
    try:
        barrier.wait(STREAM_START_TIMEOUT_S)
        while len(results) < procs:  # read before joining: a full pipe would block the writer
            try:
                index, traces, error = out_q.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p, w in enumerate(workers) if w.exitcode not in (None, 0) and p not in results]
                if dead:
                    raise RuntimeError(f"client process {dead[0]} exited with {workers[dead[0]].exitcode}")
                continue
            if error is not None:
                raise RuntimeError(f"client process {index}: {error}")
            results[index], their_lag = traces
            lag.extend(their_lag)
    finally:
        for w in workers:
            if w.is_alive() and len(results) < procs:
                w.terminate()
            w.join()
    out: List[Optional[StreamTrace]] = [None] * len(bodies)
    for p, traces in results.items():
        out[p::procs] = traces
    return out


def _sample_name(metric) -> str:
    """The name of a ServerMetrics metric on the page (a counter's sample ends in _total)."""
    family = metric.describe()[0]
    return family.name + ("_total" if family.type == "counter" else "")


_NAMES = ServerMetrics()  # for the metric names only: never served
BATCH_STEP_SECONDS = _sample_name(_NAMES.batch_step_seconds)  # the router's time inside batch steps
BATCH_STEPS = _sample_name(_NAMES.batch_steps)
BATCH_STEP_REQUESTS = _sample_name(_NAMES.batch_step_requests)  # running requests summed over batch steps
DECODE_STEP_SECONDS = _sample_name(_NAMES.decode_step_seconds)  # the same, decode steps only
DECODE_STEPS = _sample_name(_NAMES.decode_steps)
DECODE_STEP_REQUESTS = _sample_name(_NAMES.decode_step_requests)
ENGINE_CLOCK = (BATCH_STEP_SECONDS, BATCH_STEPS, BATCH_STEP_REQUESTS)
DECODE_CLOCK = (DECODE_STEP_SECONDS, DECODE_STEPS, DECODE_STEP_REQUESTS)
# mixed steps (decode rows beside prompt chunks): seconds, steps, decoded requests
MIXED_CLOCK = tuple(_sample_name(m) for m in (_NAMES.mixed_step_seconds, _NAMES.mixed_steps,
                                              _NAMES.mixed_step_decode_requests))
DECODE_CLOCK_BY_BATCH = tuple(_sample_name(m) for m in (  # the same by batch size (label DECODE_BATCH_LABEL)
    _NAMES.decode_step_seconds_by_batch, _NAMES.decode_steps_by_batch, _NAMES.decode_step_requests_by_batch))
MTP_ACCEPT_LEN = _sample_name(_NAMES.mtp_accept_len)  # a histogram
# histograms (their _sum / _count samples): receipt to last output, router queue, time to first token
LATENCY_METRICS = tuple(_sample_name(m) for m in (_NAMES.e2e_latency, _NAMES.queue_time, _NAMES.ttft))
REQUEST_COUNT = _sample_name(_NAMES.requests)  # label: finish_reason
RUNNING_REQUESTS = _sample_name(_NAMES.running_reqs)
KV_USED_TOKENS = _sample_name(_NAMES.kv_used_tokens)
# the prompt cache: tokens held now, hit / prefilled / evicted tokens since start, the worker's hit rate
PROMPT_CACHE_TOKENS = _sample_name(_NAMES.prompt_cache_tokens)
PROMPT_CACHE_HIT_TOKENS = _sample_name(_NAMES.prompt_cache_hit_tokens)
PROMPT_TOKENS_COMPUTED = _sample_name(_NAMES.prompt_tokens_computed)
PROMPT_CACHE_EVICTED_TOKENS = _sample_name(_NAMES.prompt_cache_evicted_tokens)
PROMPT_CACHE_HIT_RATE = _sample_name(_NAMES.prompt_cache_hit_rate)


def free_device_memory() -> None:
    """Give an engine's memory back once the last reference to it is gone."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_offline(start_args, prompts: Sequence[List[int]], params: Sequence, device: Optional[str] = None,
                     dtype: Optional[str] = None, eos_token_ids: Optional[Sequence[int]] = None,
                     verify_observer=None, progress: bool = True, on_step=None, warmup: int = 0) -> Tuple[List, float]:
    """One ``OfflineEngine`` run (``eos_token_ids`` None: the model's own): the results and the
    seconds they took, after ``warmup`` untimed requests of the same kind; the engine and its
    memory are gone when this returns."""
    from lightllm.server.offline_engine import OfflineEngine

    engine = OfflineEngine(start_args, device=device, dtype=dtype)
    try:
        if verify_observer is not None:
            engine.backend.verify_observer = verify_observer
        eos = engine.eos_token_ids() if eos_token_ids is None else list(eos_token_ids)
        if warmup:
            engine.generate(prompts[:warmup], params[:warmup], eos_token_ids=eos)  # kernel compiles
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, eos_token_ids=eos, progress=progress, on_step=on_step)
        return results, time.perf_counter() - t0
    finally:
        engine.close()
        del engine
        free_device_memory()
