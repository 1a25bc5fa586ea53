"""The HTTP front end under load, without a GPU or a model: where do requests wait outside the steps?

Three processes, wired as the real server is:

- the HTTP process (``--_serve``, started by this script as ``python -m``-like child): the REAL
  app (``create_app``) and ``HttpServerManager`` served by uvicorn through ``serving.make_server``,
  as ``api_start._launch_subprocesses`` does; it spawns
- a FAKE worker process over multiprocessing queues (``fake_worker_main``): the driver loop of
  ``router.manager.serve_steps`` without a model. It drains ``in_q`` with the real
  ``MessageInbox`` (blocking only while idle), admits AddReq between steps (at most
  ``--running_max_req_size`` running), sends the gauges before a step whose request counts changed
  (``GaugePublisher.before_step``), and every ``--step_ms`` gives each running request
  ``--tokens_per_step`` tokens (its first step, the prefill, gives 1), sending
  ``([ReqStepUpdate...], WorkerStats(..., StepTiming))`` after the step; a request finishes with
  "length" at max_new_tokens. Token ids are GSM8K answers, so detokenization does real work;
- the client (this process, plus ``--client_procs`` processes for the stream arm): closed loop,
  ``--concurrency`` in flight over ``--num_requests`` GSM8K chat prompts (~150 tokens),
  ``--max_new_tokens`` each, ``/generate`` (arm ``generate``, on ``send_all``'s threads, as the
  budget benchmark sends them) and streamed ``/v1/completions`` with log-probs and usage as the
  serving benchmark sends them (arm ``stream``).

Every request carries its index as ``seed``, so each side's clock (``time.time()``) can be joined
per request: client send -> AddReq put by the HTTP process -> AddReq drained by the worker ->
the worker's first update; the worker's last update put -> read by the HTTP process's reader
thread -> dispatched on its event loop -> received by the client. The HTTP process also samples
its event loop's lag (a 5 ms sleep's overshoot) and the CPU of each of its threads (psutil).

``--profile ARM`` adds a run of that arm with every thread of the HTTP process under cProfile
(per-thread CPU clock by default: time waiting for the GIL or for I/O is not charged), counted
over the timed window only, and prints the top functions by tottime.

Absolute numbers depend on the host's cores (the client shares them): read the ratios
(achieved / ideal tok/s), the latency splits and the profile.

    python benchmarks/bench_http_frontend.py                       # both arms, plain decoding
    python benchmarks/bench_http_frontend.py --tokens_per_step 3   # MTP-like updates
    python benchmarks/bench_http_frontend.py --arms stream --profile stream --num_requests 256
"""
import argparse
import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.common.constants import HTTP_IMPLEMENTATIONS, LOOP_IMPLEMENTATIONS  # noqa: E402
from lightllm.server.core.objs.messages import (  # noqa: E402 (after the path set-up)
    AbortReq, AddReq, ReqStepUpdate, StepTiming, StepUpdates, WorkerReady, WorkerStats, step_messages)
from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402
from lightllm.tools.client import event_tokens, with_lag_probe  # noqa: E402 (the clients' probe and token count)
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

DEFAULT_STREAM_INTERVAL = StartArgs().stream_interval

DEFAULT_OUT = os.path.join("docs", "data", "perf", "http_frontend.json")
ARMS = ("generate", "stream")
PERCENTILES = (50, 99)
DEFAULT_STEP_MS = 2.7
DEFAULT_CONCURRENCY = 64
DEFAULT_NUM_REQUESTS = 1024
DEFAULT_MAX_NEW_TOKENS = 200
WARMUP_MAX_NEW_TOKENS = 16
DEFAULT_LONG_TOKENS = 3000  # --long_tokens: the serving mix's long prompts are 2000-4000 tokens
LONG_START_STRIDE = 7  # long prompt j starts at question 7 j
WARMUP_SEED_BASE = 1 << 40  # seeds of the warm-up requests (timed requests: their index)
VOCAB_SIZE = 49152  # the embedded model's (its tokenizer serves the fake worker's ids)
FAKE_KV_TOKENS = 1 << 20
READY_TIMEOUT_S = 300.0
DUMP_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
PROFILE_TOP = 35
ARM_ATTEMPTS = 2
FALLBACK_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                   "How many clips did Natalia sell altogether in April and May?")
FALLBACK_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                   "altogether in April and May.\n#### 72")

DEFINITIONS = {
    "clock": "time.time() of each process (client, HTTP process, fake worker), joined per request by its seed",
    "ideal_tok_s": "concurrency x tokens_per_step / step_ms: every request in the worker at every step",
    "output_tok_s": "tokens of the timed requests / (last response received - first request sent)",
    "worker_mean_running": "the worker's running requests averaged over its steps in the timed window",
    "worker_time_mean_running": "the same weighted by time over the window (idle time counts 0)",
    "intake_ms": "client send -> AddReq drained by the worker; split into http (client send -> AddReq put by "
                 "the HTTP process: body, validation, tokenizer thread) and in_q (put -> drained between steps); "
                 "http is reach (client send -> the endpoint's receipt, its arrival) + prep (-> manager.generate: "
                 "body read, validated, tokenized) + the put",
    "admit_ms": "AddReq drained -> the worker's put of the request's first update (one step)",
    "egress_ms": "the worker's put of the request's last update -> the client has the response; split into "
                 "out_q (put -> returned by the HTTP reader thread's get), handover (-> its _dispatch runs on "
                 "the event loop), loop_to_client (-> the client's receipt)",
    "first_egress_ms": "stream: the worker's put of the first update -> the client's first chunk with a token",
    "itl_ms": "stream: per token after the first chunk, a chunk of n tokens g ms after the previous gives n "
              "samples of g / n (as the serving benchmark)",
    "server_itl_ms": "itl_ms where the HTTP process's app handed each body part to the socket (process 0's "
                     "streams): the server's own gaps, without the network and the client's stamping",
    "loop_lag_ms": "how late the HTTP process's event loop woke from a 5 ms sleep",
    "client_loop_lag_ms": "the same for the clients' event loops (every client process); a client that lags "
                          "holds pooled connections idle, which the server then closes (keep-alive, 5 s)",
    "cpu_cores": "CPU seconds / wall seconds over the timed window (psutil): the HTTP process in all, each of "
                 "its threads, the worker process, the client processes",
    "http_cpu_us_per_token": "the HTTP process's CPU microseconds per output token (all threads; main: the event "
                             "loop's thread): what caps tok/s at one core per GIL",
    "httpserver_workers": "HTTP processes (the server's flag); the probe (intake, egress's splits, loop lag) and the "
                          "CPU columns watch process 0 only, the client's columns (tok/s, TTFT, ITL) all of them",
}


# ---------------------------------------------------------------- pure parts

def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile of ``xs``, linearly interpolated (numpy's default); None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def percentiles(name: str, xs: Sequence[float], qs: Sequence[float] = PERCENTILES,
                scale: float = 1.0) -> Dict[str, Optional[float]]:
    """{name_pQ: value x scale} for each q (None when ``xs`` is empty)."""
    out = {}
    for q in qs:
        v = percentile(xs, q)
        out[f"{name}_p{q:g}"] = None if v is None else v * scale
    return out


def ratio_or_none(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def itl_samples(chunks: Sequence[Tuple[float, int]]) -> List[float]:
    """Seconds per token after a request's first chunk: a chunk of n tokens g s after the previous
    chunk gives n samples of g / n."""
    out: List[float] = []
    for (a, _), (b, n) in zip(chunks, chunks[1:]):
        out += [(b - a) / n] * n
    return out


@dataclass
class FakeReq:
    msg: AddReq
    arrival: float  # time.time() when the worker drained its AddReq
    out_tokens: int = 0
    mtp_accepted: int = 0


@dataclass
class FakeStep:
    """One step of the fake engine."""

    updates: List[ReqStepUpdate]
    batch_reqs: int  # running requests it served
    prefilled: int  # of which it gave their first token
    decoded: int  # of which it decoded (they had a token already)


class FakeEngine:
    """The fake worker's requests: admission, steps, aborts and what it records per request.
    ``token_ids`` are cycled as every request's output; a request's first step (its prefill)
    gives 1 token with accept_len 0, later steps ``tokens_per_step`` each (accept_len that many,
    the extra ones counted as accepted drafts), up to max_new_tokens ("length")."""

    def __init__(self, tokens_per_step: int, token_ids: Sequence[int], running_max_req_size: int = 64):
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
        if not token_ids:
            raise ValueError("no token ids to send")
        self.tokens_per_step = tokens_per_step
        self.token_ids = list(token_ids)
        self.running_max_req_size = running_max_req_size
        self.waiting: deque = deque()
        self.running: Dict[int, FakeReq] = {}
        self.records: Dict[int, dict] = {}  # req_id -> what the worker saw of it

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def counts(self) -> Tuple[int, int]:
        return len(self.running), len(self.waiting)

    def kv_used(self) -> int:
        return sum(len(r.msg.prompt_ids) + r.out_tokens for r in self.running.values())

    def add(self, msg: AddReq, now: float) -> None:
        self.waiting.append(FakeReq(msg, now))
        self.records[msg.req_id] = {"req_id": msg.req_id, "seed": msg.params.seed, "arrival": now,
                                    "prompt_tokens": len(msg.prompt_ids), "max_new_tokens": msg.params.max_new_tokens,
                                    "first_put": None, "last_put": None, "first_msg": None, "last_msg": None,
                                    "tokens": 0, "finish_reason": None}

    def admit(self) -> int:
        """Move waiting requests into the running batch (up to running_max_req_size); how many moved."""
        n = 0
        while self.waiting and len(self.running) < self.running_max_req_size:
            req = self.waiting.popleft()
            self.running[req.msg.req_id] = req
            n += 1
        return n

    def _update(self, req: FakeReq, toks: List[int], finish: Optional[str], accept_len: int) -> ReqStepUpdate:
        return ReqStepUpdate(req_id=req.msg.req_id, token_ids=toks, logprobs=[-0.25] * len(toks),
                             finish_reason=finish, prompt_tokens=len(req.msg.prompt_ids),
                             mtp_accepted_token_num=req.mtp_accepted, asd_relaxed_token_num=0, asd_regret_spent=0.0,
                             accept_len=accept_len)

    def abort(self, req_id: int) -> List[ReqStepUpdate]:
        req = self.running.pop(req_id, None)
        if req is None:
            req = next((r for r in self.waiting if r.msg.req_id == req_id), None)
            if req is None:
                return []
            self.waiting.remove(req)
        self.records[req_id]["finish_reason"] = "abort"
        return [self._update(req, [], "abort", 0)]

    def step(self) -> FakeStep:
        updates, prefilled, decoded = [], 0, 0
        n_ids = len(self.token_ids)
        batch = len(self.running)
        for req in list(self.running.values()):
            first = req.out_tokens == 0
            n = 1 if first else self.tokens_per_step
            n = min(n, req.msg.params.max_new_tokens - req.out_tokens)
            start = req.out_tokens
            toks = [self.token_ids[(start + j) % n_ids] for j in range(n)]
            req.out_tokens += n
            if first:
                prefilled += 1
            else:
                decoded += 1
                req.mtp_accepted += n - 1
            finish = "length" if req.out_tokens >= req.msg.params.max_new_tokens else None
            updates.append(self._update(req, toks, finish, 0 if first else n))
            if finish is not None:
                del self.running[req.msg.req_id]
        return FakeStep(updates, batch, prefilled, decoded)

    def mark_sent(self, updates: Sequence[ReqStepUpdate], put_time: float, msg_index: int) -> None:
        """The updates went out in message ``msg_index`` at ``put_time``."""
        for u in updates:
            rec = self.records.get(u.req_id)
            if rec is None:
                continue
            rec["tokens"] += len(u.token_ids)
            if u.token_ids and rec["first_put"] is None:
                rec["first_put"], rec["first_msg"] = put_time, msg_index
            if u.finish_reason is not None:
                rec["last_put"], rec["last_msg"] = put_time, msg_index
                rec["finish_reason"] = u.finish_reason


def step_timing(seconds: float, step: FakeStep) -> StepTiming:
    """The StepTiming the real router files for such a step (a mixed step when it prefilled beside decoding)."""
    timing = StepTiming()
    timing.add(seconds, step.batch_reqs, decode=not step.prefilled, decoded_reqs=step.decoded)
    return timing


def merge_timing(into: StepTiming, t: StepTiming) -> None:
    into.seconds += t.seconds
    into.steps += t.steps
    into.batch_reqs += t.batch_reqs
    into.decode_seconds += t.decode_seconds
    into.decode_steps += t.decode_steps
    into.decode_batch_reqs += t.decode_batch_reqs
    for b, c in t.decode_by_batch.items():
        mine = into.decode_by_batch.setdefault(b, type(c)())
        mine.seconds += c.seconds
        mine.steps += c.steps
        mine.reqs += c.reqs
    into.mixed_seconds += t.mixed_seconds
    into.mixed_steps += t.mixed_steps
    into.mixed_decode_reqs += t.mixed_decode_reqs


def window_running(steps: Sequence[Sequence[float]], t0: float, t1: float) -> Dict[str, Optional[float]]:
    """From the worker's steps [start, seconds, running] (time.time() starts): the mean running
    requests over the steps that began in [t0, t1], the same weighted by time over the window
    (idle time counts 0), the steps' mean duration and the busy share of the window."""
    inside = [s for s in steps if t0 <= s[0] <= t1]
    wall = max(t1 - t0, 1e-9)
    if not inside:
        return {"worker_steps": 0, "worker_mean_running": None, "worker_time_mean_running": None,
                "worker_step_ms": None, "worker_busy_share": None}
    busy = sum(s[1] for s in inside)
    return {"worker_steps": len(inside),
            "worker_mean_running": sum(s[2] for s in inside) / len(inside),
            "worker_time_mean_running": sum(s[1] * s[2] for s in inside) / wall,
            "worker_step_ms": 1e3 * busy / len(inside),
            "worker_busy_share": busy / wall}


# ---------------------------------------------------------------- the fake worker process

@dataclass
class WorkerConfig:
    step_ms: float
    tokens_per_step: int
    token_ids: List[int]
    running_max_req_size: int
    record_path: str


def fake_worker_main(cfg: WorkerConfig, in_q, out_qs: Sequence, watch_parent: bool = True) -> None:
    """The driver loop of router.manager.serve_steps over a FakeEngine (no model): messages
    between steps, a step of ``step_ms``, its updates and gauges sent after it; on None, the
    records go to ``cfg.record_path``. ``watch_parent``: exit with the HTTP process (as the real
    worker; tests run this in a thread over queue.Queue without it). ``out_qs``: one queue per HTTP
    process (--httpserver_workers): each gets its requests' updates, the first also the gauges, as
    GaugePublisher sends them."""
    out_q = out_qs[0]
    from lightllm.server.router.manager import MessageInbox, exit_with_parent

    if watch_parent:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s fake-worker: %(message)s")
        exit_with_parent()
    engine = FakeEngine(cfg.tokens_per_step, cfg.token_ids, cfg.running_max_req_size)
    out_q.put(WorkerReady(VOCAB_SIZE, FAKE_KV_TOKENS, "fake", "none"))
    for q in out_qs:
        if hasattr(q, "cancel_join_thread"):
            q.cancel_join_thread()
    step_s = cfg.step_ms / 1e3
    messages: List[Tuple[float, int, int]] = []  # per message sent: (put time, updates in it, HTTP process)
    steps: List[Tuple[float, float, int]] = []  # per step: (start time.time(), seconds, running requests)
    sent_counts: Optional[Tuple[int, int]] = None
    timing = StepTiming()

    def put(updates: List[ReqStepUpdate], t: StepTiming) -> None:
        nonlocal sent_counts
        sent_counts = engine.counts()
        stats = WorkerStats(engine.kv_used(), *sent_counts, t)
        for dest, part in step_messages(updates, len(out_qs)):
            now = time.time()
            engine.mark_sent(part, now, len(messages))
            messages.append((now, len(part), dest))
            out_qs[dest].put((StepUpdates(part), stats))

    inbox = MessageInbox(in_q)
    while True:
        msgs = inbox.poll(block=not engine.has_work)
        now = time.time()
        updates: List[ReqStepUpdate] = []
        for m in msgs:
            if m is None:
                write_json(cfg.record_path, {"reqs": list(engine.records.values()), "messages": messages,
                                             "steps": steps})
                return
            if isinstance(m, AddReq):
                engine.add(m, now)
            elif isinstance(m, AbortReq):
                updates.extend(engine.abort(m.req_id))
        t0, start = time.perf_counter(), time.time()
        engine.admit()
        if engine.running:
            if engine.counts() != sent_counts:  # GaugePublisher.before_step: the new counts show first
                put([], StepTiming())
            step = engine.step()
            left = t0 + step_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
            seconds = time.perf_counter() - t0
            merge_timing(timing, step_timing(seconds, step))
            steps.append((start, seconds, step.batch_reqs))
            updates.extend(step.updates)
        if updates:
            put(updates, timing)
            timing = StepTiming()


# ---------------------------------------------------------------- the HTTP process

class Probe:
    """What the HTTP process records: AddReq puts (by seed), the reader thread's gets and the
    event loop's dispatches (by message index), the loop's lag, the names of its threads."""

    def __init__(self):
        self.puts: Dict[int, float] = {}
        self.arrivals: Dict[int, float] = {}  # by seed: the endpoint's receipt (its ``arrival``), as time.time()
        self.generate_calls: Dict[int, float] = {}  # by seed: manager.generate called (body read, tokenized)
        self.gets: List[float] = []
        self.dispatches: List[Tuple[float, float]] = []  # (start, seconds)
        self.lag: List[Tuple[float, float]] = []  # (time, seconds late)
        self.threads: Dict[int, str] = {}
        # per streamed response since begin(): (time.time() its body part left the app, the part)
        self.sends: List[List[Tuple[float, bytes]]] = []

    def begin(self) -> None:
        self.note_threads()
        self.sends = []

    def note_threads(self) -> None:
        import threading

        for t in threading.enumerate():
            if t.native_id is not None:
                self.threads[t.native_id] = t.name

    def dump(self) -> dict:
        self.note_threads()
        return {"puts": self.puts, "arrivals": self.arrivals, "generate_calls": self.generate_calls,
                "gets": self.gets, "dispatches": self.dispatches, "lag": self.lag,
                "threads": self.threads, "send_chunks": [sent_chunks(parts) for parts in self.sends]}


def sse_tokens(part: bytes) -> int:
    """Tokens in a streamed completions response's body part, as the client counts them (each choice's
    log-prob tokens)."""
    n = 0
    for event in part.split(b"\n\n"):
        payload = event.strip()
        if payload.startswith(b"data: {"):
            n += event_tokens(json.loads(payload[len(b"data: "):]))
    return n


def sent_chunks(parts: Sequence[Tuple[float, bytes]]) -> List[Tuple[float, int]]:
    """A response's body parts that carried tokens: (when the part left the app, its tokens)."""
    return [(t, n) for t, n in ((t, sse_tokens(b)) for t, b in parts) if n]


class SendStamps:
    """ASGI middleware of the bench's HTTP process: when each body part of a streamed completion left the
    app (uvicorn writes it to the socket within that send), so the server's own inter-token gaps can be
    set beside the client's. The parts are parsed after the run (``Probe.dump``), not on the loop."""

    def __init__(self, app, probe: Probe):
        self.app = app
        self.probe = probe

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        parts: List[Tuple[float, bytes]] = []
        self.probe.sends.append(parts)

        async def stamped(message):
            await send(message)
            if message["type"] == "http.response.body" and message.get("body"):
                parts.append((time.time(), message["body"]))

        return await self.app(scope, receive, stamped)


class TimedInQueue:
    """The manager's in_q: notes when each AddReq is put (by its seed)."""

    def __init__(self, q, probe: Probe):
        self._q, self._probe = q, probe

    def put(self, msg, *a, **kw):
        if isinstance(msg, AddReq) and msg.params.seed is not None:
            self._probe.puts[msg.params.seed] = time.time()
        return self._q.put(msg, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._q, name)


class TimedOutQueue:
    """The manager's out_q: notes when the reader thread's get returns each message."""

    def __init__(self, q, probe: Probe):
        self._q, self._probe = q, probe

    def get(self, *a, **kw):
        msg = self._q.get(*a, **kw)
        if msg is not None:
            self._probe.gets.append(time.time())
        return msg

    def __getattr__(self, name):
        return getattr(self._q, name)


class ThreadProfiles:
    """cProfile in every thread of the process (the main thread's and each later Thread.run's),
    counted between ``begin`` and ``end`` (snapshots subtracted)."""

    def __init__(self, cpu_clock: bool):
        import cProfile
        import threading

        self._cprofile = cProfile
        self.timer = time.thread_time if cpu_clock else time.perf_counter
        self.profiles: List[Tuple[str, object]] = []
        self._base: List[dict] = []
        main = cProfile.Profile(self.timer)
        self.profiles.append(("MainThread", main))
        main.enable()
        original = threading.Thread.run
        profiles = self

        def run(thread):
            p = cProfile.Profile(profiles.timer)
            profiles.profiles.append((thread.name, p))
            p.enable()
            try:
                original(thread)
            finally:
                p.disable()

        threading.Thread.run = run

    @staticmethod
    def _snapshot(p) -> dict:
        p.snapshot_stats()
        return {k: v[:4] for k, v in p.stats.items()}

    def begin(self) -> None:
        self._base = [self._snapshot(p) for _, p in self.profiles]

    def end(self) -> Tuple[object, Dict[str, float]]:
        """(pstats.Stats of the window over all threads, tottime seconds by thread name)."""
        import pstats

        class Snapshot:
            def __init__(self, stats):
                self.stats = stats

            def create_stats(self):
                pass

        merged, by_thread = None, {}
        for i, (name, p) in enumerate(self.profiles):
            base = self._base[i] if i < len(self._base) else {}
            diff = {}
            for k, (cc, nc, tt, ct) in self._snapshot(p).items():
                b = base.get(k, (0, 0, 0.0, 0.0))
                if nc - b[1] > 0 or tt - b[2] > 1e-6:
                    diff[k] = (cc - b[0], nc - b[1], tt - b[2], ct - b[3], {})
            if not diff:
                continue
            by_thread[name] = by_thread.get(name, 0.0) + sum(v[2] for v in diff.values())
            stats = pstats.Stats(Snapshot(diff))
            merged = stats if merged is None else merged.add(stats)
        return merged, by_thread


def top_functions(stats, n: int = PROFILE_TOP) -> List[dict]:
    """The ``n`` functions of most tottime: calls, tottime, cumtime, where."""
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        if path.endswith("cProfile.py") or "_lsprof" in name or path == os.path.abspath(__file__):
            continue  # the profiler's own snapshot, this file's probes
        where = f"{os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT) else path}:{line}({name})"
        rows.append({"function": where, "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def _log_server_closes(log) -> None:
    """Log each connection the server closes on a timer (header deadline, keep-alive), and whether a
    request was in flight on it then (a client would see a ReadError)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from lightllm.server.httpserver.serving import HeaderDeadline, HttpToolsProtocol

    def wrap(cls, name: str, what: str) -> None:
        original = getattr(cls, name)

        def closing(self, *a, **kw):
            cycle = getattr(self, "cycle", None)
            busy = cycle is not None and not cycle.response_complete
            log.warning("server closes a connection: %s (a request in flight: %s, %s)", what, busy,
                        getattr(self, "client", None))
            return original(self, *a, **kw)

        setattr(cls, name, closing)

    wrap(HeaderDeadline, "_header_deadline_passed", "header deadline")
    for protocol in (H11Protocol, HttpToolsProtocol):
        if protocol is not None:
            wrap(protocol, "timeout_keep_alive_handler", "keep-alive timeout")


def serve_main(config_path: str) -> None:
    """The HTTP process: api_start._launch_subprocesses with the fake worker."""
    with open(config_path) as f:
        cfg = json.load(f)
    profiles = ThreadProfiles(cfg["profile_cpu_clock"]) if cfg["profile"] else None
    import multiprocessing as mp
    import atexit

    from lightllm.server.api_http import create_app
    from lightllm.server.api_start import (LOG_FORMAT, WORKER_IGNORED_SIGNALS, WorkerProcesses, _http_worker,
                                           _signals_ignored)
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.httpserver.peers import HttpPeers
    from lightllm.server.httpserver.serving import bind_socket, make_server, tune_http_process
    from uvicorn.server import asyncio_run

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    log = logging.getLogger("bench_http_frontend")
    args = replace(StartArgs(), resolved_model_dir=cfg["model_dir"], port=cfg["port"],
                   max_req_total_len=cfg["max_req_total_len"], running_max_req_size=cfg["running_max_req_size"],
                   mtp_mode="eagle_with_att" if cfg["tokens_per_step"] > 1 else None,
                   mtp_step=max(0, cfg["tokens_per_step"] - 1))
    for flag in ("timeout_request_header", "timeout_keep_alive", "http", "loop", "stream_interval",
                 "httpserver_workers"):
        if cfg.get(flag):
            args = replace(args, **{flag: cfg[flag]})
    sock = bind_socket(args.host, args.port, args.backlog, reuse_port=args.httpserver_workers > 1)
    ctx = mp.get_context("spawn")
    in_q = ctx.Queue()
    out_qs = [ctx.Queue() for _ in range(args.httpserver_workers)]  # one per HTTP process
    out_q = out_qs[0]
    in_q.cancel_join_thread()
    wcfg = WorkerConfig(cfg["step_ms"], cfg["tokens_per_step"], cfg["token_ids"], cfg["running_max_req_size"],
                        cfg["worker_record_path"])
    with _signals_ignored(WORKER_IGNORED_SIGNALS):
        proc = ctx.Process(target=fake_worker_main, args=(wcfg, in_q, out_qs), daemon=True)
        proc.start()
    workers = WorkerProcesses([proc], out_qs)
    atexit.register(workers.kill)
    ready = out_q.get(timeout=READY_TIMEOUT_S)
    peers = None
    if args.httpserver_workers > 1:  # as api_start starts them; the probe watches process 0 only
        peers = HttpPeers.start(_http_worker, args, in_q, out_qs[1:], ready, workers)
    probe = Probe()

    class TimedManager(HttpServerManager):
        def generate(self, prompt_ids, params, is_disconnected=None, arrival=None, final_only=False):
            if params.seed is not None:
                now = time.time()
                probe.generate_calls[params.seed] = now
                probe.arrivals[params.seed] = now if arrival is None else now - (time.monotonic() - arrival)
            return super().generate(prompt_ids, params, is_disconnected, arrival, final_only)

        def _dispatch(self, updates, stats, received=None) -> None:
            t0 = time.time()
            super()._dispatch(updates, stats, received)
            probe.dispatches.append((t0, time.time() - t0))

    _log_server_closes(log)
    manager = TimedManager(args, TimedInQueue(in_q, probe), TimedOutQueue(out_q, probe), ready, worker=workers,
                           peers=peers)
    app = SendStamps(create_app(manager), probe)
    tune_http_process()  # as serve_http does
    def all_serving() -> None:  # the others serve once this one does; the client starts once they all do
        if peers is not None:
            peers.release()
            peers.wait_started()

    server = make_server(app, manager, args, on_started=all_serving)

    def begin(*_):
        probe.begin()
        if profiles is not None:
            profiles.begin()

    def end(*_):
        out = probe.dump()
        if profiles is not None:
            stats, by_thread = profiles.end()
            out["profile"] = {"clock": "thread cpu" if cfg["profile_cpu_clock"] else "wall",
                              "by_thread_tottime_s": by_thread, "total_tottime_s": sum(by_thread.values()),
                              "top": top_functions(stats) if stats is not None else []}
            if stats is not None and cfg.get("pstats_path"):
                stats.dump_stats(cfg["pstats_path"])
        tmp = cfg["probe_path"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, cfg["probe_path"])

    signal.signal(signal.SIGUSR1, begin)
    signal.signal(signal.SIGUSR2, end)

    async def serve():
        await with_lag_probe(server.serve(sockets=[sock]), probe.lag)

    factory = server.config.get_loop_factory()
    loop_name = "asyncio" if factory is None else getattr(factory, "__module__", None) or repr(factory)
    with open(cfg["ready_path"], "w") as f:
        json.dump({"worker_pid": proc.pid, "loop": loop_name, "http": server.config.http.__name__}, f)
    log.info("bench HTTP process on port %d, fake worker pid %d", args.port, proc.pid)
    try:
        asyncio_run(serve(), loop_factory=server.config.get_loop_factory())
    finally:
        if peers is not None:
            peers.join()
        manager.shutdown()
        workers.stop()
        manager.close()
        if peers is not None:
            peers.close()


# ---------------------------------------------------------------- the client (this process)

@dataclass
class Workload:
    prompts: List[str]  # /generate and /v1/completions text
    token_ids: List[int]  # the fake worker's output ids
    max_req_total_len: int
    prompt_tokens_mean: float


def is_long(i: int, long_fraction: float) -> bool:
    """Whether request i has a long prompt: every 1 / long_fraction-th request, spread evenly."""
    return math.floor((i + 1) * long_fraction) > math.floor(i * long_fraction)


def long_prompt_text(tok, questions: Sequence[str], tokens: int, start: int) -> str:
    """A chat prompt of GSM8K questions from ``start`` on (cyclic) that holds about ``tokens`` tokens: each long
    prompt starts elsewhere, so none is the prompt encoder's cached chunks of another."""
    from lightllm.tools.prompts import chat_prompt_texts

    parts, n, i = [], 0, start
    while n < tokens:
        q = questions[i % len(questions)]
        parts.append(q)
        n += len(tok.encode(q, add_special_tokens=False)) + 1
        i += 1
    return chat_prompt_texts(tok, ["\n".join(parts)])[0]


def build_workload(model_dir: str, n: int, max_new_tokens: int, gsm8k: Optional[str], long_fraction: float = 0.0,
                   long_tokens: int = DEFAULT_LONG_TOKENS) -> Workload:
    """GSM8K chat prompts; with ``long_fraction`` > 0 that share of them (evenly spread) long prompts of about
    ``long_tokens`` tokens, as the serving benchmark's mix sends (the fake worker prefills any prompt in one step:
    what the long ones add is the HTTP process's work on them)."""
    from transformers import AutoTokenizer

    from lightllm.tools.prompts import chat_prompt_texts, gsm8k_path, load_gsm8k, solve_turns, take_cyclic

    tok = AutoTokenizer.from_pretrained(model_dir)
    path = gsm8k_path("test", gsm8k)
    if os.path.isfile(path):
        questions = load_gsm8k(path, 512)
        turns = solve_turns(questions)
        with open(path) as f:
            answers = [json.loads(line)["answer"] for _, line in zip(range(64), f) if line.strip()]
    else:
        turns, answers = [FALLBACK_PROMPT], [FALLBACK_ANSWER]
    texts = chat_prompt_texts(tok, turns)
    prompts = take_cyclic(texts, n)
    if long_fraction > 0:
        prompts = [long_prompt_text(tok, turns, long_tokens, i * LONG_START_STRIDE) if is_long(i, long_fraction)
                   else p for i, p in enumerate(prompts)]
    lens = [len(ids) for ids in tok(prompts, add_special_tokens=True)["input_ids"]]  # as the server counts
    ids = tok.encode("\n\n".join(answers), add_special_tokens=False)
    need = max(lens) + max_new_tokens + 1
    return Workload(prompts, ids, -(-need // 64) * 64, sum(lens) / len(lens))


@dataclass
class HttpStack:
    proc: subprocess.Popen
    port: int
    worker_pid: int
    loop: str
    http: str  # the server's HTTP protocol class
    tmp: str
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_stack(args, workload: Workload, profile: bool, tmp: str, name: str) -> HttpStack:
    from lightllm.utils.server_launcher import free_port

    port = free_port()
    cfg = {"model_dir": args.model_dir, "port": port, "max_req_total_len": workload.max_req_total_len,
           "running_max_req_size": args.running_max_req_size, "step_ms": args.step_ms,
           "tokens_per_step": args.tokens_per_step, "token_ids": workload.token_ids,
           "worker_record_path": os.path.join(tmp, f"{name}.worker.json"),
           "probe_path": os.path.join(tmp, f"{name}.probe.json"),
           "ready_path": os.path.join(tmp, f"{name}.ready.json"),
           "timeout_request_header": args.timeout_request_header, "timeout_keep_alive": args.timeout_keep_alive,
           "http": args.http, "loop": args.loop, "stream_interval": args.stream_interval,
           "httpserver_workers": args.httpserver_workers,
           "profile": profile, "profile_cpu_clock": args.profile_clock == "cpu",
           "pstats_path": os.path.abspath(args.profile_pstats) if profile and args.profile_pstats else None}
    cfg_path = os.path.join(tmp, f"{name}.config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    log_path = os.path.join(tmp, f"{name}.http.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_serve", cfg_path], stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    log.close()
    import httpx

    deadline = time.time() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP process exited with {proc.returncode}: see {log_path}:\n"
                               + open(log_path).read()[-4000:])
        if os.path.isfile(cfg["ready_path"]):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the HTTP process did not start in {READY_TIMEOUT_S} s: see {log_path}")
        time.sleep(0.1)
    with open(cfg["ready_path"]) as f:
        ready = json.load(f)
    return HttpStack(proc, port, ready["worker_pid"], ready["loop"], ready["http"], tmp, log_path)


def _wait_file(path: str, proc: Optional[subprocess.Popen], timeout: float) -> dict:
    deadline = time.time() + timeout
    while not os.path.isfile(path):
        if time.time() > deadline or (proc is not None and proc.poll() is not None and not os.path.isfile(path)):
            raise RuntimeError(f"{path} was not written")
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def stop_stack(stack: HttpStack) -> None:
    stack.proc.send_signal(signal.SIGTERM)
    try:
        stack.proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stack.proc.kill()
        stack.proc.wait()


class CpuClock:
    """CPU seconds of the HTTP process (and each of its threads), the worker and the client."""

    def __init__(self, http_pid: int, worker_pid: int):
        import psutil

        self.http = psutil.Process(http_pid)
        self.worker = psutil.Process(worker_pid)

    def read(self) -> dict:
        t = self.http.cpu_times()
        w = self.worker.cpu_times()
        own = os.times()
        return {"wall": time.time(), "http": t.user + t.system, "worker": w.user + w.system,
                "client": own.user + own.system + own.children_user + own.children_system,
                "threads": {th.id: th.user_time + th.system_time for th in self.http.threads()}}

    @staticmethod
    def cores(a: dict, b: dict, names: Dict[int, str]) -> dict:
        wall = max(b["wall"] - a["wall"], 1e-9)
        by_name: Dict[str, float] = {}
        for tid, s in b["threads"].items():
            name = names.get(tid, "other (not a Python thread)")
            by_name[name] = by_name.get(name, 0.0) + (s - a["threads"].get(tid, 0.0)) / wall
        return {"http": (b["http"] - a["http"]) / wall, "worker": (b["worker"] - a["worker"]) / wall,
                "client": (b["client"] - a["client"]) / wall,
                "http_threads": dict(sorted(by_name.items(), key=lambda kv: -kv[1]))}


def thread_group(name: str) -> str:
    """ThreadPoolExecutor names its threads tokenize_0, tokenize_1, ...: one group per pool."""
    if name.startswith("tokenize"):
        return "tokenize (pool)"
    return name


def _generate_one(conn, item) -> dict:
    from lightllm.tools.client import _post_json

    i, body = item
    sent = time.time()
    out = _post_json(conn, "/generate", body)
    return {"i": i, "sent": sent, "done": time.time(), "tokens": out["count_output_tokens"], "chunks": None}


def run_client(arm: str, url: str, workload: Workload, n: int, concurrency: int, max_new_tokens: int,
               seed_base: int, client_procs: int, lag: Optional[List[Tuple[float, float]]] = None,
               details: bool = False) -> List[dict]:
    """n requests closed-loop at ``concurrency``; per request (by index): sent, done, tokens,
    chunks [(time, tokens)] (stream), all on time.time(). ``lag``: the client loops' lag samples (every
    client process's; the generate arm's client is send_all's threads, without an event loop)."""
    from lightllm.tools.client import _threaded, completion_stream_body, generate_body, send_streamed

    lag = [] if lag is None else lag
    texts = workload.prompts[:n] if len(workload.prompts) >= n else [workload.prompts[i % len(workload.prompts)]
                                                                     for i in range(n)]
    if arm == "generate":
        extra = {"return_details": True} if details else {}  # bench_asd_budgets' requests ask for them
        bodies = [generate_body(t, max_new_tokens, seed=seed_base + i, **extra) for i, t in enumerate(texts)]
        return _threaded(url, list(enumerate(bodies)), concurrency, None, _generate_one)
    bodies = [completion_stream_body(t, max_new_tokens, seed=seed_base + i) for i, t in enumerate(texts)]
    offset = time.time() - time.perf_counter()  # perf_counter is CLOCK_MONOTONIC, one clock for all processes
    traces = send_streamed(url, bodies, concurrency, procs=client_procs, lag=lag)
    return [{"i": i, "sent": tr.sent_s + offset, "done": tr.done_s + offset, "tokens": tr.output_tokens,
             "chunks": [(a + offset, k) for a, k in tr.chunks]} for i, tr in enumerate(traces)]


def summarize(arm: str, args, client: List[dict], worker: dict, probe: dict, cpu: Optional[dict]) -> dict:
    """The arm's row: throughput vs ideal, the worker's batch, the latency splits, CPU."""
    t0 = min(r["sent"] for r in client)
    t1 = max(r["done"] for r in client)
    wall = t1 - t0
    tokens = sum(r["tokens"] for r in client)
    by_seed = {w["seed"]: w for w in worker["reqs"] if w["seed"] is not None}
    puts = {int(k): v for k, v in probe["puts"].items()}
    arrivals = {int(k): v for k, v in probe.get("arrivals", {}).items()}
    calls = {int(k): v for k, v in probe.get("generate_calls", {}).items()}
    msgs = worker["messages"]
    gets, disp = probe["gets"], probe["dispatches"]
    # the probe watches HTTP process 0: its gets and dispatches follow the messages sent to it
    to_first = [k for k, m in enumerate(msgs) if len(m) < 3 or m[2] == 0]
    first_ordinal = {k: j for j, k in enumerate(to_first)}
    http_ms, inq_ms, intake_ms, admit_ms, reach_ms, prep_ms = [], [], [], [], [], []
    out_ms, hand_ms, to_client_ms, egress_ms, first_egress_ms = [], [], [], [], []
    for r in client:
        w = by_seed.get(r["i"])
        if w is None:
            continue
        put = puts.get(r["i"])
        intake_ms.append(w["arrival"] - r["sent"])
        if put is not None:
            http_ms.append(put - r["sent"])
            inq_ms.append(w["arrival"] - put)
        if r["i"] in arrivals and r["i"] in calls:
            reach_ms.append(arrivals[r["i"]] - r["sent"])
            prep_ms.append(calls[r["i"]] - arrivals[r["i"]])
        if w["first_put"] is not None:
            admit_ms.append(w["first_put"] - w["arrival"])
        k = w["last_msg"]
        if k is not None:
            egress_ms.append(r["done"] - w["last_put"])
            j = first_ordinal.get(k)
            if j is not None and j < len(gets) and j < len(disp):
                out_ms.append(gets[j] - msgs[k][0])
                hand_ms.append(disp[j][0] - gets[j])
                to_client_ms.append(r["done"] - disp[j][0])
        if r["chunks"] and w["first_put"] is not None:
            first_egress_ms.append(r["chunks"][0][0] - w["first_put"])
    ideal = args.concurrency * args.tokens_per_step / (args.step_ms / 1e3)
    row = {"arm": arm, "tokens_per_step": args.tokens_per_step, "step_ms": args.step_ms,
           "concurrency": args.concurrency, "requests": len(client), "output_tokens": tokens, "wall_s": wall,
           "output_tok_s": tokens / wall, "ideal_tok_s": ideal, "achieved_over_ideal": tokens / wall / ideal}
    row.update(window_running(worker["steps"], t0, t1))
    if row["worker_step_ms"]:
        row["ideal_tok_s_at_worker_step"] = args.concurrency * args.tokens_per_step / (row["worker_step_ms"] / 1e3)
        row["achieved_over_ideal_at_worker_step"] = row["output_tok_s"] / row["ideal_tok_s_at_worker_step"]
    row["latency_s_mean"] = sum(r["done"] - r["sent"] for r in client) / len(client)
    ideal_latency = args.step_ms / 1e3 * (1 + math.ceil((args.max_new_tokens - 1) / args.tokens_per_step))
    row["ideal_latency_s"] = ideal_latency
    for name, xs in (("intake_ms", intake_ms), ("intake_http_ms", http_ms), ("intake_in_q_ms", inq_ms),
                     ("intake_reach_ms", reach_ms), ("intake_prep_ms", prep_ms),
                     ("admit_ms", admit_ms), ("egress_ms", egress_ms), ("egress_out_q_ms", out_ms),
                     ("egress_handover_ms", hand_ms), ("egress_loop_to_client_ms", to_client_ms)):
        row.update(percentiles(name, xs, scale=1e3))
    if arm == "stream":
        ttft = [r["chunks"][0][0] - r["sent"] for r in client if r["chunks"]]
        itl = [x for r in client if r["chunks"] for x in itl_samples(r["chunks"])]
        row.update(percentiles("ttft_ms", ttft, scale=1e3))
        row.update(percentiles("first_egress_ms", first_egress_ms, scale=1e3))
        row.update(percentiles("itl_ms", itl, scale=1e3))
        # the same gaps where the server's app handed each part to the socket (the probe's process)
        sent = [x for chunks in probe.get("send_chunks", ()) for x in itl_samples(chunks)]
        row.update(percentiles("server_itl_ms", sent, scale=1e3))
        row["itl_p99_over_p50"] = ratio_or_none(row["itl_ms_p99"], row["itl_ms_p50"])
        row["server_itl_p99_over_p50"] = ratio_or_none(row["server_itl_ms_p99"], row["server_itl_ms_p50"])
        row["ideal_itl_ms"] = args.step_ms / args.tokens_per_step
        chunks = sum(len(r["chunks"]) for r in client)
        row["tokens_per_chunk"] = tokens / chunks if chunks else None
    lag = [s for t, s in probe["lag"] if t0 <= t <= t1]
    row.update(percentiles("loop_lag_ms", lag, (50, 99, 100), scale=1e3))
    in_window = [i for i, m in enumerate(msgs) if t0 <= m[0] <= t1]
    row["worker_messages_per_s"] = len(in_window) / wall
    row["updates_per_message"] = (sum(msgs[i][1] for i in in_window) / len(in_window)) if in_window else None
    d = [disp[i][1] for i in in_window if i < len(disp)]
    row["dispatch_us_mean"] = 1e6 * sum(d) / len(d) if d else None
    row["dispatch_loop_share"] = sum(d) / wall
    if cpu is not None:
        row["cpu_cores"] = cpu
        row["http_cpu_us_per_token"] = 1e6 * cpu["http"] * wall / tokens if tokens else None
        row["http_main_cpu_us_per_token"] = (1e6 * cpu["http_threads"].get("MainThread", 0.0) * wall / tokens
                                             if tokens else None)
    if probe.get("profile"):
        row["profile"] = probe["profile"]
    return row


def run_arm(arm: str, args, workload: Workload, tmp: str, profile: bool = False) -> dict:
    name = f"{arm}{'_profile' if profile else ''}"
    os.makedirs(tmp, exist_ok=True)
    stack = start_stack(args, workload, profile, tmp, name)
    ok = False
    try:
        warm = min(args.concurrency * 2, args.num_requests)
        run_client(arm, stack.url, workload, warm, args.concurrency, WARMUP_MAX_NEW_TOKENS, WARMUP_SEED_BASE,
                   args.client_procs, details=args.return_details)
        clock = CpuClock(stack.proc.pid, stack.worker_pid)
        stack.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)  # the handler runs (and the profiles' base snapshot is taken) before the run
        before = clock.read()
        client_lag: List[Tuple[float, float]] = []
        client = run_client(arm, stack.url, workload, args.num_requests, args.concurrency, args.max_new_tokens, 0,
                            args.client_procs, client_lag, details=args.return_details)
        after = clock.read()
        probe_path = os.path.join(tmp, f"{name}.probe.json")
        stack.proc.send_signal(signal.SIGUSR2)
        probe = _wait_file(probe_path, stack.proc, DUMP_TIMEOUT_S)
        ok = True
    finally:
        stop_stack(stack)
        if not ok:
            with open(stack.log_path) as f:
                print(f"--- the HTTP process's log ({stack.log_path}), its end:\n{f.read()[-6000:]}", file=sys.stderr)
    worker = _wait_file(os.path.join(tmp, f"{name}.worker.json"), None, DUMP_TIMEOUT_S)
    names = {int(k): v for k, v in probe["threads"].items()}
    names.setdefault(stack.proc.pid, "MainThread")
    names = {k: thread_group(v) for k, v in names.items()}
    cpu = CpuClock.cores(before, after, names)
    row = summarize(arm, args, client, worker, probe, cpu)
    row.update(percentiles("client_loop_lag_ms", [x for _, x in client_lag], (50, 99, 100), scale=1e3))
    row["loop"] = stack.loop
    row["httpserver_workers"] = args.httpserver_workers
    row["http"] = stack.http
    row["stream_interval"] = args.stream_interval or DEFAULT_STREAM_INTERVAL
    row["profiled"] = profile
    return row


def run_arm_retrying(arm: str, args, workload: Workload, tmp: str, profile: bool = False) -> dict:
    """run_arm, once more after a connection error (seen now and then on a saturated 2-core host:
    a client read of response headers fails; the row's ``attempts`` says it happened)."""
    import httpx

    for attempt in range(1, ARM_ATTEMPTS + 1):
        try:
            row = run_arm(arm, args, workload, os.path.join(tmp, f"attempt{attempt}"), profile)
            row["attempts"] = attempt
            return row
        except (httpx.TransportError, RuntimeError) as e:
            if attempt == ARM_ATTEMPTS:
                raise
            print(f"arm {arm}: attempt {attempt} failed ({type(e).__name__}: {e}); once more", file=sys.stderr,
                  flush=True)


# ---------------------------------------------------------------- report

COLUMNS = [
    Column("arm", "arm"),
    Column("output_tok_s", "tok/s", ".0f"),
    Column("ideal_tok_s", "ideal", ".0f"),
    Column("achieved_over_ideal", "ratio", ".3f"),
    Column("worker_mean_running", "running", ".1f"),
    Column("worker_step_ms", "step ms", ".2f"),
    Column("intake_ms_p50", "intake p50", ".1f"),
    Column("intake_ms_p99", "p99", ".1f"),
    Column("intake_http_ms_p50", "http p50", ".1f"),
    Column("intake_reach_ms_p50", "reach p50", ".1f"),
    Column("intake_prep_ms_p50", "prep p50", ".1f"),
    Column("intake_in_q_ms_p50", "in_q p50", ".2f"),
    Column("admit_ms_p50", "admit p50", ".2f"),
    Column("egress_ms_p50", "egress p50", ".1f"),
    Column("egress_ms_p99", "p99", ".1f"),
    Column("egress_out_q_ms_p50", "out_q p50", ".2f"),
    Column("egress_handover_ms_p50", "handover p50", ".2f"),
    Column("egress_loop_to_client_ms_p50", "loop->client p50", ".1f"),
    Column("itl_p99_over_p50", "itl p99/p50", ".2f"),
    Column("server_itl_p99_over_p50", "server p99/p50", ".2f"),
    Column("loop_lag_ms_p99", "lag p99", ".1f"),
    Column("client_loop_lag_ms_p99", "client lag p99", ".1f"),
    Column("client_loop_lag_ms_p100", "max", ".0f"),
    Column("http_cores", "HTTP cores", ".2f"),
    Column("http_cpu_us_per_token", "HTTP us/tok", ".0f"),
    Column("http_main_cpu_us_per_token", "loop us/tok", ".0f"),
    Column("client_cores", "client cores", ".2f"),
]
STREAM_COLUMNS = [
    Column("arm", "arm"),
    Column("ttft_ms_p50", "ttft p50", ".1f"),
    Column("ttft_ms_p99", "ttft p99", ".1f"),
    Column("first_egress_ms_p50", "first egress p50", ".1f"),
    Column("itl_ms_p50", "itl p50", ".2f"),
    Column("itl_ms_p99", "itl p99", ".1f"),
    Column("ideal_itl_ms", "ideal itl", ".2f"),
    Column("tokens_per_chunk", "tok/chunk", ".2f"),
]


def table_rows(rows: Sequence[dict]) -> List[dict]:
    out = []
    for r in rows:
        cpu = r.get("cpu_cores") or {}
        out.append({**r, "arm": r["arm"] + (" (profiled)" if r.get("profiled") else ""),
                    "http_cores": cpu.get("http"), "client_cores": cpu.get("client")})
    return out


def print_report(rows: Sequence[dict]) -> None:
    shown = table_rows(rows)
    print(render_table(shown, COLUMNS))
    streams = [r for r in shown if r["arm"].startswith("stream")]
    if streams:
        print()
        print(render_table(streams, STREAM_COLUMNS))
    for r in rows:
        cpu = r.get("cpu_cores")
        if cpu:
            threads = ", ".join(f"{k} {v:.2f}" for k, v in cpu["http_threads"].items() if v >= 0.005)
            print(f"\n{r['arm']}{' (profiled)' if r.get('profiled') else ''}: HTTP process {cpu['http']:.2f} cores "
                  f"({threads}); worker {cpu['worker']:.2f}; client {cpu['client']:.2f}")
        prof = r.get("profile")
        if prof:
            print(f"\nprofile of the HTTP process, arm {r['arm']} ({prof['clock']} clock; tottime by thread: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(prof["by_thread_tottime_s"].items(),
                                                                   key=lambda kv: -kv[1])) + ")")
            print(render_table(prof["top"], [Column("tottime_s", "tottime s", ".3f"),
                                             Column("cumtime_s", "cumtime s", ".3f"),
                                             Column("calls", "calls", "d"), Column("function", "function")]))


def _git_commit() -> str:
    """HEAD, with "-dirty" when lightllm/ or this file differ from it."""
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip()  # noqa: E731
    head = run("rev-parse", "--short", "HEAD")
    dirty = run("status", "--porcelain", "--", "lightllm", os.path.relpath(os.path.abspath(__file__), REPO_ROOT))
    return head + ("-dirty" if dirty else "")


class _Kept:
    """A folder used as TemporaryDirectory is, but kept (--keep_tmp)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc) -> None:
        pass


def default_client_procs() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step_ms", type=float, default=DEFAULT_STEP_MS, help="the fake worker's step time")
    p.add_argument("--tokens_per_step", type=int, default=1, help="tokens per running request per step (3: MTP-like)")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    p.add_argument("--num_requests", type=int, default=DEFAULT_NUM_REQUESTS)
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--running_max_req_size", type=int, default=64)
    p.add_argument("--return_details", action="store_true",
                   help="generate arm: every request asks for per-token details (as bench_asd_budgets' do)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--profile", choices=ARMS + ("none",), default="none",
                   help="also run this arm with the HTTP process under cProfile (all threads)")
    p.add_argument("--profile_clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: each thread's CPU time (time waiting for the GIL or I/O is not charged); wall")
    p.add_argument("--profile_pstats", default=None, help="also write the profile's pstats here")
    p.add_argument("--profile_requests", type=int, default=256,
                   help="requests of the profiled run (it runs a few times slower)")
    p.add_argument("--client_procs", type=int, default=default_client_procs(),
                   help="client processes of the stream arm (default: cores / 4, 1..4)")
    p.add_argument("--http", choices=HTTP_IMPLEMENTATIONS, default=None,
                   help="the server's --http (default: its default, auto)")
    p.add_argument("--long_fraction", type=float, default=0.0,
                   help="share of requests with a long prompt (the serving mix: 0.2), evenly spread")
    p.add_argument("--long_tokens", type=int, default=DEFAULT_LONG_TOKENS, help="tokens of a long prompt (about)")
    p.add_argument("--loop", choices=LOOP_IMPLEMENTATIONS, default=None,
                   help="the server's --loop (default: its default, auto)")
    p.add_argument("--stream_interval", type=int, default=None,
                   help="the server's --stream_interval (default: its default, 1)")
    p.add_argument("--httpserver_workers", type=int, default=1,
                   help="HTTP processes (the server's flag); the probe and its CPU columns watch process 0 only")
    p.add_argument("--model_dir", default=None,
                   help="the tokenizer and config the HTTP process loads (default: the embedded model's)")
    p.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl (default: the shared copy; else a built-in prompt)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--keep_tmp", default=None, help="keep the processes' logs and records in this folder")
    p.add_argument("--timeout_request_header", type=float, default=None,
                   help="the HTTP process's --timeout_request_header (default: StartArgs')")
    p.add_argument("--timeout_keep_alive", type=float, default=None,
                   help="the HTTP process's --timeout_keep_alive (default: StartArgs')")
    p.add_argument("--_serve", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._serve:
        serve_main(args._serve)
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"--arms: unknown arm {a!r} (valid: {', '.join(ARMS)})")
    if args.model_dir is None:
        from lightllm.utils.embedded_model import get_default_model_dir
        args.model_dir = get_default_model_dir()
    if not 0.0 <= args.long_fraction <= 1.0 or args.long_tokens < 1:
        raise SystemExit(f"--long_fraction must be in [0, 1] and --long_tokens >= 1, got {args.long_fraction} "
                         f"and {args.long_tokens}")
    workload = build_workload(args.model_dir, args.num_requests, args.max_new_tokens, args.gsm8k, args.long_fraction,
                              args.long_tokens)
    rows = []
    keep = args.keep_tmp is not None
    if keep:
        os.makedirs(args.keep_tmp, exist_ok=True)
    with (tempfile.TemporaryDirectory(prefix="bench_http_frontend_") if not keep else _Kept(args.keep_tmp)) as tmp:
        for arm in arms:
            print(f"arm {arm}: {args.num_requests} requests, concurrency {args.concurrency}, "
                  f"{args.max_new_tokens} new tokens, step {args.step_ms} ms x {args.tokens_per_step} tokens",
                  flush=True)
            rows.append(run_arm_retrying(arm, args, workload, tmp))
        if args.profile != "none":
            print(f"arm {args.profile} under cProfile", flush=True)
            profiled = argparse.Namespace(**{**vars(args), "num_requests": min(args.num_requests, args.profile_requests)})
            rows.append(run_arm_retrying(args.profile, profiled, workload, tmp, profile=True))
    print()
    print_report(rows)
    meta = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "prompt_tokens_mean": workload.prompt_tokens_mean, "client_procs": args.client_procs}
    args_out = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    write_json(args.out, {"commit": _git_commit(), "args": args_out, "meta": meta, "definitions": DEFINITIONS,
                          "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
