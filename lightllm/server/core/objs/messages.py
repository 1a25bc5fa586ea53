"""The messages between the HTTP process and the router worker (through two multiprocessing
queues), and nothing else: no torch, Triton, model or router code, so the HTTP process can
import them without importing the engine (``unit_tests/server/test_process_boundary.py``).

HTTP -> router (``in_q``): ``AddReq``, ``AbortReq``; ``None`` tells the worker to exit.
Router -> HTTP (``out_q``): ``WorkerReady`` or ``WorkerError`` once at start-up, then
``(List[ReqStepUpdate], WorkerStats)`` after every step (and gauge-only refreshes with no
updates).

With ``--httpserver_workers N`` the HTTP processes share ``in_q`` and each has its own ``out_q``:
process i numbers its requests i + N, i + 2N, ... (``first_request_id``), and a step's updates go to
the process that sent the request (``updates_by_http_worker``). Process 0 (the one that started the
worker) also gets the gauge-only refreshes and, should the worker die, tells the others
(``WorkerExited`` on their queues).

The router re-exports them (``lightllm.server.router.manager``, ``...base_backend``), so older
imports keep working.
"""
import operator
import time
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Protocol, Tuple

from lightllm.server.core.objs.sampling_params import SamplingParams


# ---- HTTP -> router ----
@dataclass
class AddReq:
    req_id: int
    prompt_ids: List[int]
    params: SamplingParams
    eos_token_ids: List[int]
    asd_budget: float


@dataclass
class AbortReq:
    req_id: int


# ---- several HTTP processes (--httpserver_workers) ----
def first_request_id(http_worker: int, http_workers: int) -> int:
    """The first id HTTP process ``http_worker`` of ``http_workers`` gives a request; its next ids
    follow ``http_workers`` apart, so ``req_id % http_workers`` names the process (one process: 1, 2, ...)."""
    return http_workers + http_worker


def updates_by_http_worker(updates: List["ReqStepUpdate"], http_workers: int) -> List[List["ReqStepUpdate"]]:
    """A step's updates split by the HTTP process that sent each request (first_request_id)."""
    if http_workers == 1:
        return [updates]
    parts: List[List[ReqStepUpdate]] = [[] for _ in range(http_workers)]
    for u in updates:
        parts[u.req_id % http_workers].append(u)
    return parts


def step_messages(updates: List["ReqStepUpdate"], http_workers: int) -> List[Tuple[int, List["ReqStepUpdate"]]]:
    """(HTTP process, its updates) for each message a step sends: to every process with updates, and
    always to process 0, which also reads the gauges."""
    return [(i, part) for i, part in enumerate(updates_by_http_worker(updates, http_workers)) if part or i == 0]


@dataclass
class WorkerExited:
    """HTTP process 0 -> the other HTTP processes, on their update queues: the model worker exited."""

    exit_code: Optional[int]


# ---- router -> HTTP: start-up ----
@dataclass
class WorkerReady:
    vocab_size: int
    max_total_token_num: int
    device: str
    data_type: str
    cuda_graphs: int = 0  # graphs rank 0 captured (decode ladder and step rows; 0: eager)


@dataclass
class WorkerError:
    message: str


# ---- router -> HTTP: after every step ----
@dataclass
class ReqStepUpdate:
    """What one step produced for one request (sent to the HTTP server)."""

    req_id: int
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: Optional[str]
    prompt_tokens: int
    mtp_accepted_token_num: int
    asd_relaxed_token_num: int
    asd_regret_spent: float
    accept_len: int = 0  # 0 for prefill steps
    draft_confidence: Optional[List[float]] = None  # [K] confidences of the drafts verified this step
    # Per token of token_ids: the request's top_logprobs most likely tokens of the row that chose
    # it, as (token id, log-prob) in descending order, under the same processed logits as
    # logprobs (ASD: the target's, also for a relaxed row's draft token). None when it asked 0.
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    error: Optional[str] = None  # set with finish_reason "error": why the worker failed the request
    # Seconds from the router receiving the request to its admission into the running batch (its
    # first scheduled step); set on every update once admitted, None before (a request refused or
    # failed before admission never has one). /metrics: lightllm_request_queue_time_seconds.
    queue_time_s: Optional[float] = field(default=None, compare=False)
    # Prompt tokens whose KV came from the prompt cache (not prefilled); 0 with the cache off.
    # The OpenAI responses' usage.prompt_tokens_details.cached_tokens.
    prompt_cached_tokens: int = 0

    def copy_totals_to(self, target) -> None:
        """The request's state after this step (finish reason, error, running totals) onto ``target``."""
        target.finish_reason = self.finish_reason
        target.error = self.error
        target.mtp_accepted_token_num = self.mtp_accepted_token_num
        target.asd_relaxed_token_num = self.asd_relaxed_token_num
        target.asd_regret_spent = self.asd_regret_spent

    def __reduce__(self):
        # pickled as its fields' values, rebuilt by the constructor: a step's updates cross to the
        # HTTP process in a quarter of the time a dataclass's __dict__ takes each way
        return ReqStepUpdate, _update_values(self)


_update_values = operator.attrgetter(*(f.name for f in fields(ReqStepUpdate)))


class StepUpdates(list):
    """One step's updates (a list) on their way to the HTTP process: pickled as one tuple per field,
    which takes about a third less time under the router's GIL than one object per update (the
    queue's feeder thread pickles while the step loop runs); unpickled, a plain list again."""

    __slots__ = ()

    def __reduce__(self):
        return _updates_from_columns, (tuple(zip(*map(_update_values, self))),)


def _updates_from_columns(columns: tuple) -> List[ReqStepUpdate]:
    return [ReqStepUpdate(*values) for values in zip(*columns)]


class BatchLadder(Protocol):
    """What decode_batch_bucket needs of a CUDA graph ladder
    (``lightllm.common.basemodel.cuda_graph.GraphLadder``)."""

    def bucket_size(self, n: int) -> Optional[int]: ...


def decode_batch_bucket(decoded_reqs: int, ladder: Optional[BatchLadder]) -> int:
    """The decode batch size a step is filed under: the CUDA graph ladder size its requests pad
    to, or their exact count (no ladder: CPU; or more requests than the ladder's largest size)."""
    size = ladder.bucket_size(decoded_reqs) if ladder is not None else None
    return decoded_reqs if size is None else size


@dataclass
class BatchClock:
    """Decode steps of one decode batch size."""

    seconds: float = 0.0
    steps: int = 0
    reqs: int = 0  # decoded requests summed over those steps


@dataclass
class StepTiming:
    """Batch steps the driver ran since its last report: the engine's own clock."""

    seconds: float = 0.0  # wall time inside steps (admission, forward, verify, draft)
    steps: int = 0
    batch_reqs: int = 0  # sum over those steps of the running requests
    # the same for decode steps only (prefill steps alternate with them while prompts arrive)
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_batch_reqs: int = 0
    # decode steps by decode batch size (decode_batch_bucket of the requests they decoded)
    decode_by_batch: Dict[int, BatchClock] = field(default_factory=dict)
    # mixed steps: decode rows and prompt chunks in one forward (decoded requests summed)
    mixed_seconds: float = 0.0
    mixed_steps: int = 0
    mixed_decode_reqs: int = 0

    def add(self, seconds: float, batch_reqs: int, decode: bool, decoded_reqs: int = 0,
            ladder: Optional[BatchLadder] = None, steps: int = 1) -> None:
        """One step; a decode step that decoded ``decoded_reqs`` requests is also filed by batch size,
        a step that prefilled beside decoding is a mixed step. ``steps`` 0: a call that only finished
        a step launched by an earlier one (overlap): its time belongs to that step, counted already."""
        self.seconds += seconds
        self.steps += steps
        self.batch_reqs += batch_reqs * steps
        if decode:
            self.decode_seconds += seconds
            self.decode_steps += steps
            self.decode_batch_reqs += batch_reqs * steps
            if decoded_reqs:
                clock = self.decode_by_batch.setdefault(decode_batch_bucket(decoded_reqs, ladder), BatchClock())
                clock.seconds += seconds
                clock.steps += steps
                clock.reqs += decoded_reqs * steps
        elif decoded_reqs:
            self.mixed_seconds += seconds
            self.mixed_steps += steps
            self.mixed_decode_reqs += decoded_reqs * steps


@dataclass(frozen=True)
class PromptCacheStats:
    """The prompt cache (radix tree) of the driver rank: its size now and counts since start."""

    cached_tokens: int  # tokens the tree holds now (each shared slot once)
    hit_tokens_total: int  # prompt tokens admitted requests took from the tree
    computed_tokens_total: int  # prompt tokens admitted requests had to prefill
    evicted_tokens_total: int  # tokens evicted to make room in the KV pool

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the cache (0 before any admission)."""
        total = self.hit_tokens_total + self.computed_tokens_total
        return self.hit_tokens_total / total if total else 0.0


@dataclass
class WorkerStats:
    """Sent with every batch of updates: the worker's load."""

    kv_used_tokens: int
    running_reqs: int
    waiting_reqs: int
    timing: StepTiming
    prompt_cache: Optional[PromptCacheStats] = None  # None: --disable_dynamic_prompt_cache
    # The router's time.monotonic() when it sent the message (built right before it is put): the
    # engine-side timestamp of the updates' tokens. Only differences of two of them are used (the
    # inter-token latency of one request), never compared with the HTTP process's clock.
    sent_at: float = field(default_factory=time.monotonic)
