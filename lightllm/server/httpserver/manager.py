"""HTTP-side request manager: tokenize, send to the worker, stream updates back, detokenize."""
import asyncio
import collections
import functools
import itertools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

from jinja2 import TemplateError
from transformers import AutoTokenizer

from lightllm.server.core.objs.messages import AbortReq, AddReq, ReqStepUpdate, WorkerExited, first_request_id
from lightllm.server.core.objs.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.httpserver.detokenize import REPLACEMENT_CHAR, DetokenizerVocab, IncrementalDetokenizer
from lightllm.server.httpserver.prompt_encoder import PromptEncoder
from lightllm.server.metrics import RequestClock, ServerMetrics, SharedMetricsPage, ThroughputLog
from lightllm.utils.model_len import max_model_len

logger = logging.getLogger(__name__)

# How often a waiting request checks that its client is still connected and the worker alive
DISCONNECT_POLL_S = 0.5
# Threads that tokenize prompts, off the event loop (a large prompt takes a while)
TOKENIZER_THREADS = 4
# Prompts longer than this (characters) are "large": at most LARGE_PROMPT_TOKENIZERS of them
# tokenize at once, so the other tokenizer threads stay free for everyone else
LARGE_PROMPT_CHARS = 16384
LARGE_PROMPT_TOKENIZERS = 1
# Prompts up to this many characters tokenize on the event loop itself (tens of microseconds): a
# tokenizer thread's round trip waits twice for the loop, which under load is the longer wait
INLINE_PROMPT_CHARS = 1024
# A text the tokenizer must give back unchanged (decode(encode(text)) == text) for the prompt
# length bound to hold: runs of spaces, tabs and newlines, control and zero-width characters, a
# combining accent, a compatibility ligature, a full-width letter, an astral character
ROUND_TRIP_PROBE = "a  b\t\tc\n\n\n d   e\u0301 \u00e9 \x00 \x7f \u200b \ufb01 \uff21 \U0001d518 \r\n x"
# Seconds shutdown waits for the thread that reads the worker's queue
READER_EXIT_TIMEOUT_S = 2.0
# Put in every waiting request's queue when the worker died / when shutdown stops waiting
WORKER_DIED = object()
SHUTTING_DOWN = object()
# Put in every waiting request's queue every DISCONNECT_POLL_S (one timer for all requests): time
# to check that its client is still connected and the worker alive. A timeout on each wait instead
# (asyncio.wait_for) cost a task and a timer per worker update, per request.
POLL = object()
# Texts of single tokens kept (log-prob entries and stream token events decode one token each)
TOKEN_TEXT_CACHE_SIZE = 1 << 18
# Put in a request's queue when its held updates (HeldUpdates) are due: the task takes them all at once
HELD_DUE = object()


@dataclass
class HeldUpdates:
    """A request's worker updates kept off its task until they are due, so that the event loop wakes
    the task (and a stream writes a chunk) once for several steps: at the end only (a caller that
    reads only the final result), or once ``min_tokens`` tokens are held (--stream_interval). The
    first tokens are due at once (time to first token), and so is the last update."""

    min_tokens: Optional[int]  # None: due only at the end
    updates: List[ReqStepUpdate] = field(default_factory=list)
    tokens: int = 0  # tokens in updates
    signaled: bool = False  # HELD_DUE is in the queue
    sent_tokens: bool = False  # tokens were due before (the first ones are due at once)

    def add(self, u: ReqStepUpdate) -> bool:
        """Keep ``u``; True when the updates kept are now due (and were not signaled yet)."""
        self.updates.append(u)
        self.tokens += len(u.token_ids)
        due = (u.finish_reason is not None or u.error is not None
               or (self.min_tokens is not None and self.tokens > 0
                   and (not self.sent_tokens or self.tokens >= self.min_tokens)))
        if not due or self.signaled:
            return False
        self.signaled = True
        return True

    def take(self) -> List[ReqStepUpdate]:
        taken, self.updates = self.updates, []
        self.sent_tokens = self.sent_tokens or self.tokens > 0
        self.tokens, self.signaled = 0, False
        return taken


class UpdateBox:
    """One request's inbox on the event loop: the worker's updates and the signals (POLL, HELD_DUE,
    ...) in arrival order, read by the request's one task. asyncio.Queue's put and get (its getter
    deque, a future per get) cost about twice this per token on the HTTP process's hot path."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> object:
        return self._items.popleft()

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass(eq=False)
class InFlight:
    """What the HTTP process keeps for one request in flight, found by its id on every update."""

    box: UpdateBox
    clock: RequestClock  # its serving latencies
    # its updates wait here until due (HeldUpdates): callers that read only the final result, and
    # streams under --stream_interval (one wake-up of the task for several steps); None: none wait
    held: Optional[HeldUpdates] = None


class ClientDisconnected(Exception):
    """The client of a request hung up; the request was aborted."""


class Unavailable(Exception):
    """The server cannot serve requests any more (HTTP 503)."""


class WorkerDied(Unavailable):
    """The model worker is gone: no request can be served any more."""


class ShuttingDown(Unavailable):
    """The server is shutting down: it reads no more request bodies, and in-flight requests that
    did not finish within --timeout_graceful_shutdown fail."""


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for: the longer of its vocabulary
    string (byte-level BPE: one character per byte) and its decoded text."""
    ids = list(range(len(tokenizer)))
    pieces = tokenizer.convert_ids_to_tokens(ids)
    texts = tokenizer.batch_decode([[i] for i in ids])
    return max(max(len(p) for p in pieces if p is not None), max(len(t) for t in texts))


def keeps_text(tokenizer) -> bool:
    """Whether the tokenizer gives ROUND_TRIP_PROBE back unchanged. Then a prompt of n tokens has
    at most n x longest_token_chars characters; a tokenizer that normalizes or drops characters
    (collapsed spaces, composed accents) keeps no such bound."""
    ids = tokenizer.encode(ROUND_TRIP_PROBE, add_special_tokens=False)
    return tokenizer.decode(ids) == ROUND_TRIP_PROBE


def load_eos_token_ids(model_dir: str, tokenizer) -> List[int]:
    """eos ids from generation_config.json / config.json, plus the tokenizer's."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


@dataclass
class ReqResult:
    """Everything a finished (or streaming) request has produced so far."""

    prompt_tokens: int
    # prompt tokens whose KV came from the prompt cache, as the latest update says (0 before
    # admission and with the cache off)
    prompt_cached_tokens: int = 0
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    # per token, its (id, log-prob) alternatives, most likely first: only when the request asked
    # for top_logprobs > 0 (else empty)
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    mtp_accepted_token_num: int = 0
    asd_relaxed_token_num: int = 0
    asd_regret_spent: float = 0.0
    text: str = ""  # cut before the first stop string
    error: Optional[str] = None  # why the worker failed the request (finish_reason "error")
    # What a stream may show now: text that cannot turn out to be the start of a stop string
    # (nor an incomplete UTF-8 sequence), and the tokens whose text lies within it. Once
    # finished, all of text and token_ids.
    stream_text_len: int = 0
    stream_token_num: int = 0


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a stop string."""
    held = 0
    for s in stops:
        tail = text[max(0, len(text) - (len(s) - 1)):]  # a proper beginning is shorter than s
        for i in range(len(tail) - held):  # only longer matches than the one found
            if s.startswith(tail[i:]):
                held = len(tail) - i
                break
    return held


def stop_search_start(unchanged_len: int, stops: Sequence[str]) -> int:
    """Where a new stop string can begin in a text whose first ``unchanged_len`` characters were
    already searched: a match must end in the changed part."""
    longest = max((len(s) for s in stops), default=0)
    return max(0, unchanged_len - max(longest - 1, 0))


def visible_len_without_open_char(text: str, visible: int) -> int:
    """len(text[:visible].rstrip(REPLACEMENT_CHAR)) without copying the text."""
    while visible > 0 and text[visible - 1] == REPLACEMENT_CHAR:
        visible -= 1
    return visible


class HttpServerManager:
    """One HTTP process's side of the worker link. With --httpserver_workers N, process
    ``http_worker`` (0..N-1) numbers its requests apart from the others' (first_request_id) and reads
    its own update queue; process 0 owns the worker (stops it, reads its gauges) and the others learn
    from it that the worker died (WorkerExited). ``metrics_dir``: where the processes share their
    /metrics pages (None: one process); ``peers``: process 0's HttpPeers, whose directory that is."""

    def __init__(self, args, in_q, out_q, ready, worker=None, http_worker: int = 0, metrics_dir: Optional[str] = None,
                 peers=None):
        self.args = args
        self.in_q, self.out_q = in_q, out_q
        self.worker = worker
        self.http_worker = http_worker
        self.owns_worker = http_worker == 0
        # the other HTTP processes (HttpPeers; process 0 only): shutdown waits for them before the worker stops
        self.peers = peers
        self.vocab_size = ready.vocab_size
        self.max_total_token_num = ready.max_total_token_num
        self.model_dir = args.resolved_model_dir
        # The name clients send as OpenAI's ``model`` (LightLLM's --model_name; default: the dir's name)
        self.model_name = args.model_name or os.path.basename(os.path.normpath(self.model_dir))
        # Most prompt + new tokens of one request: --max_req_total_len, or less when the model's
        # positions end sooner (/v1/models' max_model_len)
        self.max_model_len = max_model_len(args.max_req_total_len, self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.tokenizer)
        # Prompts as the tokenizer encodes them, resent pieces from a cache of chunks
        self.prompt_encoder = PromptEncoder.of(self.tokenizer)
        self.detokenizer_vocab = DetokenizerVocab.of(self.tokenizer)
        # A prompt of more characters than this cannot fit in --max_req_total_len tokens (None: no
        # such bound for this tokenizer; prompts are then only bounded by the body size)
        self.max_token_chars = longest_token_chars(self.tokenizer) if keeps_text(self.tokenizer) else None
        if self.max_token_chars is None:
            logger.info("the tokenizer normalizes text: prompts are refused by their length only once tokenized")
        self.metrics = ServerMetrics()
        if peers is not None:
            metrics_dir = peers.metrics_dir
        self.shared_metrics = None if metrics_dir is None else SharedMetricsPage(self.metrics, metrics_dir, http_worker)
        # The periodic throughput line (None: --disable_log_stats)
        n = args.httpserver_workers
        source = f"HTTP worker {http_worker} of {n}" if n > 1 else ""
        self.throughput = None if args.disable_log_stats else ThroughputLog(
            self.max_total_token_num, mtp=args.mtp_mode is not None, source=source)
        self._ids = itertools.count(first_request_id(http_worker, n), n)
        self._streams: Dict[int, InFlight] = {}  # the requests in flight, by id
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[threading.Thread] = None
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._large_prompt_slots = asyncio.Semaphore(LARGE_PROMPT_TOKENIZERS)
        # Shutdown: resolved when it begins; the timer that then fails what is still in flight
        self.stopping: Optional[asyncio.Future] = None
        self._fail_timer: Optional[asyncio.TimerHandle] = None
        self._refusing = False  # past the shutdown bound: new requests fail at once
        self._shut_down = False
        # The timer that puts POLL in every waiting request's queue, and its event loop
        self._poll_timer: Optional[asyncio.TimerHandle] = None
        self._poll_loop: Optional[asyncio.AbstractEventLoop] = None
        # The text of one token id on its own (tokenizer.decode([id])): decoded once per id
        self.token_text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(self._decode_one)

    # ---- worker link ----
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stopping = loop.create_future()
        self._reader = threading.Thread(target=self._read_worker, name="worker-reader", daemon=True)
        self._reader.start()

    def _read_worker(self) -> None:
        while True:
            msg = self.out_q.get()
            if msg is None:
                return
            if isinstance(msg, WorkerExited):  # from process 0: the worker is gone (the app's watch acts on it)
                self.worker.exited(msg.exit_code)
                continue
            # when the tokens reached this process (time to first token), not when the loop gets to them
            self._loop.call_soon_threadsafe(self._dispatch, *msg, time.monotonic())

    def _dispatch(self, updates, stats, received: Optional[float] = None) -> None:
        now = time.monotonic()
        received = now if received is None else received
        self.metrics.update_delivery.observe(max(now - stats.sent_at, 0.0))
        if self.owns_worker:  # the worker's own series: one process reports them
            self.metrics.observe_worker(stats)
        if self.throughput is not None:
            self.throughput.observe(updates, stats)
        streams = self._streams
        for u in updates:
            if u.accept_len:
                self.metrics.observe_step(u.accept_len, u.draft_confidence)
            r = streams.get(u.req_id)
            if r is None:
                continue
            r.clock.on_update(u, stats.sent_at, received)
            if r.held is None:
                r.box.put_nowait(u)
            elif r.held.add(u):
                r.box.put_nowait(HELD_DUE)

    def worker_alive(self) -> bool:
        return self.worker is None or self.worker.is_alive()

    def worker_exit_code(self) -> Optional[int]:
        return None if self.worker is None else self.worker.exitcode

    def _worker_died(self) -> "WorkerDied":
        return WorkerDied(f"the model worker exited (code {self.worker_exit_code()})")

    def _schedule_poll(self) -> None:
        """Make sure the POLL timer runs on this event loop (started by the first request, again
        after an idle spell or on a new loop)."""
        loop = asyncio.get_running_loop()
        if self._poll_timer is not None and self._poll_loop is loop:
            return
        self._poll_loop = loop
        self._poll_timer = loop.call_later(DISCONNECT_POLL_S, self._poll_tick, loop)

    def _poll_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._poll_loop:  # a timer of a loop this manager no longer serves
            return
        self._poll_timer = None
        if not self._streams:  # idle: the next request starts the timer again
            return
        for r in self._streams.values():
            r.box.put_nowait(POLL)
        self._poll_timer = loop.call_later(DISCONNECT_POLL_S, self._poll_tick, loop)

    def fail_pending(self, reason: object = WORKER_DIED) -> int:
        """Wake every waiting request with ``reason`` (WORKER_DIED: WorkerDied, SHUTTING_DOWN:
        ShuttingDown); returns how many there were."""
        for r in self._streams.values():
            r.box.put_nowait(reason)
        return len(self._streams)

    # ---- shutdown ----
    def begin_shutdown(self, grace_s: float) -> None:
        """Shutdown began (on the event loop): stop reading request bodies now, and fail the
        requests still in flight after ``grace_s`` seconds."""
        if self.stopping is None or self.stopping.done():
            return
        self.stopping.set_result(None)
        logger.info("shutting down: %d requests in flight get %g s to finish", len(self._streams), grace_s)
        self._fail_timer = self._loop.call_later(grace_s, self.hurry_shutdown)

    def hurry_shutdown(self) -> None:
        """Fail the requests still in flight now (503), and any that come later."""
        if self._fail_timer is not None:
            self._fail_timer.cancel()
            self._fail_timer = None
        self._refusing = True
        failed = self.fail_pending(SHUTTING_DOWN)
        if failed:
            logger.warning("shutting down: failed %d requests still in flight", failed)

    def stop_worker(self) -> None:
        """Kill what is left of the worker processes (the API server is about to exit)."""
        kill = getattr(self.worker, "kill", None)
        if kill is not None:
            kill()

    # ---- requests ----
    def encode_prompt(self, text: str) -> List[int]:
        return self.prompt_encoder.encode(text, add_special_tokens=True)

    def render_chat(self, messages) -> str:
        """The prompt text of a chat conversation (the model's template)."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:  # the model's template refuses this conversation
            raise SamplingParamsError("messages", f"the chat template refused them: {e}") from None

    def apply_chat_template(self, messages) -> List[int]:
        return self.prompt_encoder.encode(self.render_chat(messages), add_special_tokens=False)

    def limit_text(self) -> str:
        """How error messages name the request length limit (max_model_len)."""
        if self.max_model_len == self.args.max_req_total_len:
            return f"--max_req_total_len {self.max_model_len}"
        return (f"max_model_len {self.max_model_len} (the model's max_position_embeddings; "
                f"--max_req_total_len is {self.args.max_req_total_len})")

    def check_prompt_chars(self, text: str) -> None:
        """Refuse a prompt that has more characters than max_model_len tokens can hold, before
        it is tokenized (SamplingParamsError naming ``inputs``). Every prompt that passes
        tokenizes in bounded time."""
        limit = self.max_model_len
        if self.max_token_chars is not None and len(text) > (limit - 1) * self.max_token_chars:
            raise SamplingParamsError(
                "inputs", f"the prompt has {len(text)} characters: more than {self.limit_text()} tokens "
                f"can hold (a token is at most {self.max_token_chars} characters)")

    async def _tokenize(self, fn, arg, chars: int) -> List[int]:
        """``fn(arg)`` on a tokenizer thread, so the event loop (and /health) never waits for it
        (short prompts, INLINE_PROMPT_CHARS, on the loop); large prompts take turns on
        LARGE_PROMPT_TOKENIZERS of the threads."""
        if chars <= INLINE_PROMPT_CHARS:
            return fn(arg)
        loop = asyncio.get_running_loop()
        if chars <= LARGE_PROMPT_CHARS:
            return await loop.run_in_executor(self._tokenizer_pool, fn, arg)
        async with self._large_prompt_slots:
            return await loop.run_in_executor(self._tokenizer_pool, fn, arg)

    async def encode_prompt_async(self, text: str) -> List[int]:
        """check_prompt_chars, then encode_prompt on a tokenizer thread."""
        self.check_prompt_chars(text)
        return await self._tokenize(self.encode_prompt, text, len(text))

    async def apply_chat_template_async(self, messages) -> List[int]:
        """The conversation's prompt ids: render the template, check_prompt_chars, then encode."""
        loop = asyncio.get_running_loop()
        chars = sum(len(m.get("content", "")) for m in messages)
        text = (self.render_chat(messages) if chars <= LARGE_PROMPT_CHARS
                else await loop.run_in_executor(self._tokenizer_pool, self.render_chat, messages))
        self.check_prompt_chars(text)
        return await self._tokenize(partial(self.prompt_encoder.encode, add_special_tokens=False), text, len(text))

    def check_request(self, prompt_ids: List[int], params: SamplingParams) -> None:
        """Raise SamplingParamsError for anything the engine cannot serve."""
        if not prompt_ids:
            raise SamplingParamsError("inputs", "the prompt is empty")
        params.verify_vocab(self.vocab_size)
        limit = self.max_model_len
        if len(prompt_ids) >= limit:  # too long even for one new token: the prompt's fault
            raise SamplingParamsError(
                "inputs", f"the prompt has {len(prompt_ids)} tokens: {self.limit_text()} leaves room for "
                f"at most {limit - 1} (and one new token)")
        total = len(prompt_ids) + params.max_new_tokens
        if total > limit:
            raise SamplingParamsError(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds {self.limit_text()}",
            )
        if params.asd_regret_budget is not None and not self.args.asd_enabled:
            raise SamplingParamsError(
                "asd_regret_budget",
                "this server runs without ASD; start it with --mtp_mode ... --mtp_asd_regret_budget B to enable "
                "per-request budgets",
            )

    def _worker_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the token ids of its stop sequences, which the worker matches."""
        stops = [self.tokenizer.encode(s, add_special_tokens=False) for s in params.stop_sequences]
        return replace(params, stop_token_ids=stops)

    async def generate(self, prompt_ids: List[int], params: SamplingParams, is_disconnected=None,
                       arrival: Optional[float] = None, final_only: bool = False) -> AsyncIterator[ReqResult]:
        """Yield the growing result after each worker update; the last one has finish_reason set.
        ``final_only``: the caller reads only the last result; without stop strings (which end a
        request as soon as its text shows one) the updates are then taken together at the end.
        Otherwise, with --stream_interval N > 1, a result comes once N tokens arrived since the last
        one (the first tokens and the end at once), as SGLang's flag streams.

        ``is_disconnected`` (an async callable) is polled every DISCONNECT_POLL_S (at each POLL),
        also while tokens flow: when it says so the request is aborted and ClientDisconnected
        raised. Streams pass None: Starlette cancels their generator when the client goes.
        ``arrival``: the ``time.monotonic()`` the HTTP server received the request (before its body
        was read and tokenized), where its time to first token and end-to-end latency start; now
        when None."""
        if not self.worker_alive():
            raise self._worker_died()
        if self._refusing:
            raise ShuttingDown("the server is shutting down")
        req_id = next(self._ids)
        clock = RequestClock(self.metrics, time.monotonic() if arrival is None else arrival)
        held = None
        if final_only and not params.stop_sequences:
            held = HeldUpdates(min_tokens=None)
        elif not final_only and self.args.stream_interval > 1:
            held = HeldUpdates(min_tokens=self.args.stream_interval)
        q = UpdateBox()
        self._streams[req_id] = InFlight(q, clock, held)
        res = ReqResult(prompt_tokens=len(prompt_ids))
        detok = IncrementalDetokenizer(self.detokenizer_vocab)
        finished = False
        budget = params.asd_budget(self.args.mtp_asd_regret_budget)
        self.in_q.put(AddReq(req_id, prompt_ids, self._worker_params(params), self.eos_token_ids, budget))
        if self.throughput is not None:
            self.throughput.add_prompt(len(prompt_ids))
        self._schedule_poll()
        pending: List[object] = []  # a signal taken while catching up: handled after that result
        try:
            while True:
                u = pending.pop() if pending else await q.get()
                if u is WORKER_DIED:
                    raise self._worker_died()
                if u is SHUTTING_DOWN:
                    raise ShuttingDown(f"the server is shutting down: this request did not finish in time "
                                       f"(--timeout_graceful_shutdown {self.args.timeout_graceful_shutdown:g} s)")
                if u is POLL:
                    if is_disconnected is not None and await is_disconnected():
                        raise ClientDisconnected()
                    if not self.worker_alive():
                        raise self._worker_died()
                    continue
                if u is HELD_DUE:  # signaled only after an add(): never empty
                    steps = held.take()
                    u = steps[-1]
                else:
                    steps = [u]
                # Behind the worker (a loaded loop): every update already here makes one result, so a
                # stream writes one chunk of several steps' tokens rather than a burst of chunks.
                while u.finish_reason is None and u.error is None and not q.empty():
                    nxt = q.get_nowait()
                    if not isinstance(nxt, ReqStepUpdate):
                        pending.append(nxt)
                        break
                    steps.append(nxt)
                    u = nxt
                for v in steps:
                    res.token_ids.extend(v.token_ids)
                    res.logprobs.extend(v.logprobs)
                    if params.top_logprobs:
                        tops = v.top_logprobs if v.top_logprobs is not None else [[] for _ in v.token_ids]
                        res.top_logprobs.extend(tops)
                u.copy_totals_to(res)
                res.prompt_cached_tokens = u.prompt_cached_tokens
                self._update_text(res, params, detok)
                if res.finish_reason is not None:
                    finished = True
                    if u.finish_reason is None:  # a stop string the worker could not see in ids
                        self.in_q.put(AbortReq(req_id))
                    clock.finished(time.monotonic())
                    self._record_finished(res)
                    yield res
                    return
                yield res
        except (ClientDisconnected, asyncio.CancelledError, GeneratorExit):
            if not finished:  # the client went away: free its KV at once
                self.in_q.put(AbortReq(req_id))
                self.metrics.requests.labels(finish_reason="abort").inc()
                logger.info("request %d: client disconnected after %d tokens, aborted", req_id, len(res.token_ids))
            raise
        except ShuttingDown:
            self.in_q.put(AbortReq(req_id))  # the worker stops soon; its KV is free until then
            self.metrics.requests.labels(finish_reason="abort").inc()
            raise
        finally:
            self._streams.pop(req_id, None)

    def _decode(self, token_ids: List[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _update_text(self, res: ReqResult, params: SamplingParams, detok: IncrementalDetokenizer) -> None:
        """Decode the new tokens, cut at the first stop string and end the tokens there; set what a
        stream may show."""
        text = detok.update(res.token_ids)
        start = stop_search_start(detok.unchanged_len, params.stop_sequences)
        cut = min((i for i in (text.find(s, start) for s in params.stop_sequences) if i >= 0), default=-1)
        if cut >= 0:
            res.text = text[:cut]
            res.finish_reason = "stop"
            keep = self._tokens_covering(res.token_ids, res.text)
            del res.token_ids[keep:], res.logprobs[keep:], res.top_logprobs[keep:]
        else:
            res.text = text
        if res.finish_reason is not None:
            res.stream_text_len, res.stream_token_num = len(res.text), len(res.token_ids)
            return
        visible = len(text) - stop_prefix_len(text, params.stop_sequences)
        if visible < len(text):
            res.stream_token_num = self._tokens_within(detok, res.token_ids, visible, res.stream_token_num)
        else:
            res.stream_token_num = len(res.token_ids)
        res.stream_text_len = visible_len_without_open_char(text, visible)

    def _tokens_covering(self, token_ids: List[int], kept: str) -> int:
        """The fewest leading tokens whose text begins with ``kept`` (so counts end at a stop
        string however the tokens were grouped into updates)."""
        lo, hi = 0, len(token_ids)  # the text of all of them begins with kept
        while lo < hi:
            mid = (lo + hi) // 2
            if self._decode(token_ids[:mid]).startswith(kept):
                hi = mid
            else:
                lo = mid + 1
        return lo

    @staticmethod
    def _tokens_within(detok: IncrementalDetokenizer, token_ids: List[int], text_len: int, at_least: int) -> int:
        """The most leading tokens (>= at_least, already streamed) whose text fits in text_len characters
        (each probe decodes one window, not all the tokens)."""
        lo, hi = at_least, len(token_ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if detok.prefix_text_len(token_ids, mid) <= text_len:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _record_finished(self, res: ReqResult) -> None:
        m = self.metrics
        m.requests.labels(finish_reason=res.finish_reason).inc()
        m.prompt_tokens.inc(res.prompt_tokens)
        m.generation_tokens.inc(len(res.token_ids))
        m.mtp_accepted.inc(res.mtp_accepted_token_num)
        m.asd_relaxed.inc(res.asd_relaxed_token_num)
        m.asd_regret.inc(res.asd_regret_spent)

    def shutdown(self) -> None:
        """Tell the worker to exit and stop reading its queue (once; the worker may be gone)."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._poll_timer is not None:
            self._poll_timer.cancel()
            self._poll_timer = None
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        # the worker's stop (process 0 only: the others share its queue), our reader's
        for q in (self.in_q, self.out_q) if self.owns_worker else (self.out_q,):
            try:
                q.put(None)
            except (OSError, ValueError):  # a closed queue
                pass
        if self._reader is not None:
            self._reader.join(READER_EXIT_TIMEOUT_S)

    def render_metrics(self) -> bytes:
        """The /metrics page: this process's, or with --httpserver_workers every process's merged."""
        return self.metrics.render() if self.shared_metrics is None else self.shared_metrics.render()

    def close(self) -> None:
        """Close the worker queues (after the worker exited): exiting then never waits to flush
        them into a pipe nobody reads."""
        for q in (self.in_q, self.out_q):
            if hasattr(q, "cancel_join_thread"):  # a multiprocessing queue; tests pass queue.Queue
                q.cancel_join_thread()
                q.close()
