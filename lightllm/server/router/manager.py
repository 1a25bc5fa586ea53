"""The router: continuous batching over the model worker(s), in its own process(es).

With ``--tp N`` every rank runs this loop with its own RouterManager: rank 0 (the driver)
reads the HTTP process's messages and broadcasts them, so every rank admits, schedules
and steps identically (docs/parallel.md); only rank 0 sends updates back.

Failures stay with their requests: one the worker cannot serve, and every request of a
batch step that raised, finish with reason "error" and ``ReqStepUpdate.error`` saying why;
the loop goes on. Worker processes end with the process that started them.
"""
import logging
import multiprocessing
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from lightllm.common.req_manager import ReqParamsError
# the messages to and from the HTTP process (re-exported here for older imports)
from lightllm.server.core.objs.messages import (  # noqa: F401
    AbortReq, AddReq, BatchClock, PromptCacheStats, ReqStepUpdate, StepTiming, StepUpdates, WorkerError, WorkerReady,
    WorkerStats, decode_batch_bucket, step_messages,
)
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import StepResult
from lightllm.server.router.req_queue import ReqQueue
from lightllm.utils.dist_utils import NUM_OVERLAP_MICROBATCHES, ParallelContext, init_parallel, single_rank_context
from lightllm.utils.device_memory import StartupError
from lightllm.utils.gc_freeze import freeze_start_up_objects
# a worker process ends with its parent (re-exported here for older imports)
from lightllm.utils.process_lifetime import (  # noqa: F401
    ORPHAN_EXIT_CODE, PARENT_CHECK_INTERVAL_S, exit_orphan, exit_with_parent, set_parent_death_signal,
    start_parent_watchdog,
)

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how long an idle router waits for a new request
# A batch step that raises fails its requests and the router goes on; this many failed steps
# in a row mean the worker itself is broken (a poisoned CUDA context): it raises and exits.
MAX_CONSECUTIVE_STEP_FAILURES = 3
GAUGE_REFRESH_S = 0.25  # how often the driver re-sends its gauges while a step runs (when they changed)


@dataclass(frozen=True)
class Gauges:
    """The worker's load as /metrics shows it."""

    kv_used_tokens: int
    running_reqs: int
    waiting_reqs: int
    prompt_cache: Optional[PromptCacheStats] = None

    def stats(self, timing: StepTiming) -> WorkerStats:
        return WorkerStats(self.kv_used_tokens, self.running_reqs, self.waiting_reqs, timing, self.prompt_cache)

    def same_counts(self, other: Optional["Gauges"]) -> bool:
        return other is not None and (self.running_reqs, self.waiting_reqs) == (other.running_reqs, other.waiting_reqs)


class GaugePublisher:
    """Sends the driver's gauges (KV slots used, running and waiting requests) to the HTTP process,
    so that /metrics is at most one step old also during a long step: with each step's updates;
    before each step when admissions changed the request counts (they show before the step runs);
    and from a thread, every GAUGE_REFRESH_S when anything changed (a long prefill's KV shows as
    it is allocated). Gauge-only messages carry no updates and an empty StepTiming. One lock
    orders the reads with the sends, so an older reading never arrives after a newer one."""

    def __init__(self, router: "RouterManager", out_qs: Sequence, refresh_s: float = GAUGE_REFRESH_S):
        self.router = router
        self.out_qs = list(out_qs)  # one queue per HTTP process (--httpserver_workers); the gauges go to the first
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._sent: Optional[Gauges] = None  # the gauges last sent
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _gauges(self) -> Gauges:
        mem, router, cache = self.router.backend.mem_manager, self.router, self.router.backend.prompt_cache
        # KV in use: what requests hold (cached tokens nobody holds are evicted on demand; their own gauge)
        return Gauges(mem.size - mem.available_size, len(router.running), len(router.queue.waiting),
                      cache.stats() if cache is not None else None)

    def send(self, updates: List[ReqStepUpdate]) -> None:
        """A step's updates with the gauges now and the step timing since the last send."""
        with self._lock:
            self._sent = self._gauges()
            stats = self._sent.stats(self.router.take_timing())
            for i, part in step_messages(updates, len(self.out_qs)):
                self.out_qs[i].put((StepUpdates(part), stats))

    def refresh(self, counts_only: bool = False) -> None:
        """The gauges alone, if they changed since the last send (``counts_only``: if the request
        counts did; a decode step's KV comes with its updates anyway)."""
        with self._lock:
            gauges = self._gauges()
            if gauges.same_counts(self._sent) if counts_only else gauges == self._sent:
                return
            self._sent = gauges
            self.out_qs[0].put(([], gauges.stats(StepTiming())))

    def before_step(self) -> None:
        """After admission, before the step runs: the new request counts."""
        self.refresh(counts_only=True)

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(self.refresh_s):
                self.refresh()

        self._thread = threading.Thread(target=run, name="gauge-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class RouterManager:
    def __init__(self, backend):
        self.backend = backend
        self.queue = ReqQueue(
            backend.mem_manager.size, backend.args.running_max_req_size, backend.mtp_step, backend.parallel.dp_size,
            backend.prompt_cache,
        )
        self.running: List[InferReq] = []
        self.mean_tokens_per_step = 0.0
        self._steps = 0
        self._step_tokens = 0
        self.timing = StepTiming()
        self.last_result: Optional[StepResult] = None  # what the last batch step did (tests, logs)
        self._ladder = backend.decode_step.ladder  # decode batch sizes of the step clock (None: exact)
        self._failed: List[ReqStepUpdate] = []  # updates of refused requests, sent with the next step
        self._step_failures = 0  # batch steps that raised in a row
        self.max_wait_steps = backend.args.router_max_wait_tokens  # --router_max_wait_tokens
        self.admit_behind_step = backend.args.router_admit_behind_step  # --router_admit_behind_step
        self._steps_since_admit = 0  # decode-only forwards since requests were last admitted

    def take_timing(self) -> StepTiming:
        """The timing since the last call, and start a new one."""
        timing, self.timing = self.timing, StepTiming()
        return timing

    def add_req(self, msg: AddReq) -> None:
        """Queue a request; one the worker cannot serve fails at once (its update comes with
        the next ``step``). The verdict reads only the message, so every rank agrees."""
        req = InferReq(msg.req_id, msg.prompt_ids, msg.params, msg.eos_token_ids, asd_budget=msg.asd_budget)
        try:
            error = self._unservable(req)
        except Exception as e:  # a malformed message (wrong types): its request fails, the worker goes on
            error = f"malformed request: {type(e).__name__}: {e}"
        if error is not None:
            logger.warning("request %d refused: %s", req.req_id, error)
            self._failed.append(self._fail(req, error))
            return
        self.queue.append(req)

    def _unservable(self, req: InferReq) -> Optional[str]:
        """Why the worker cannot serve ``req``, or None (the HTTP edge checks the same and more)."""
        try:
            self.backend.params_manager.check_req(req)
        except ReqParamsError as e:
            return str(e)
        max_new = req.params.max_new_tokens
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            return f"max_new_tokens: must be an integer >= 1, got {max_new!r}"
        if not req.prompt_ids:
            return "inputs: the prompt is empty"
        limit = self.backend.args.max_req_total_len
        if req.prompt_len + max_new > limit:
            return f"prompt ({req.prompt_len} tokens) + max_new_tokens ({max_new}) exceeds --max_req_total_len {limit}"
        stops = req.params.stop_token_ids
        if not all(isinstance(s, list) and s and all(isinstance(t, int) for t in s) for s in stops):
            return "stop_token_ids: must be non-empty lists of token ids"
        return None

    def _fail(self, req: InferReq, error: str) -> ReqStepUpdate:
        """Finish ``req`` with an error (it holds no KV slot nor req_idx any more)."""
        req.finish_reason = FinishReason.ERROR
        req.error = error
        return self.backend._update(req, [], [], accept_len=0)

    def abort(self, req_id: int) -> List[ReqStepUpdate]:
        req = self.queue.remove(req_id)
        running = req is None
        if running:
            req = next((r for r in self.running if r.req_id == req_id), None)
            if req is None:
                return []
        req.finish_reason = FinishReason.ABORT
        updates = []
        if running:
            # a decode step in flight (overlap): commit it for the others, so this one's KV goes now
            updates = self.backend.flush_decode()
            self._reap_finished()  # this one, and any the flushed step finished
        return updates + [self.backend._update(req, [], [], accept_len=0)]

    def _reap_finished(self) -> None:
        """Free and drop the running requests that have finished."""
        done = [r for r in self.running if r.finish_reason is not None]
        if done:
            self._finish(done)
            self.running[:] = [r for r in self.running if r.finish_reason is None]

    def _finish(self, reqs: List[InferReq]) -> None:
        self.backend.free_reqs(reqs)
        for req in reqs:
            self.queue.release(req)

    def admission_due(self, steps_ahead: int = 0) -> bool:
        """Whether waiting requests may join at the step ``steps_ahead`` steps from now:
        ``--router_max_wait_tokens`` N > 0 holds them while requests decode, until N decode steps have run
        since the last admission (arrivals then share one mixed step, whose host work costs about as much
        for one prompt as for several); at once when nothing decodes or a prompt is being prefilled (the
        step is a mixed one anyway)."""
        if self.max_wait_steps <= 0 or self._steps_since_admit + steps_ahead >= self.max_wait_steps:
            return True
        return not self.running or any(r.in_prefill for r in self.running)

    def _admit(self) -> List[ReqStepUpdate]:
        """Move admissible requests into the running batch; returns the updates of those whose
        settings the backend could not store (they fail alone, their row goes back)."""
        if not self.queue.waiting or not self.admission_due():
            return []
        running_per_group = [0] * self.queue.dp_size
        for req in self.running:
            running_per_group[req.dp_rank] += 1
        admitted = self.queue.pop_admissible(running_per_group)
        if not admitted:
            return []
        refused = self.backend.add_reqs(admitted)
        self._finish([req for req, _ in refused])
        why = {id(req): e for req, e in refused}
        failed = []
        now = time.monotonic()
        for req in admitted:
            e = why.get(id(req))
            if e is not None:
                logger.error("request %d: the backend cannot store it", req.req_id, exc_info=e)
                failed.append(self._fail(req, f"the worker cannot serve this request: {type(e).__name__}: {e}"))
                continue
            req.queue_time_s = now - req.queued_at
            self.running.append(req)
            self._steps_since_admit = 0
        return failed

    def _fail_running(self, e: Exception) -> List[ReqStepUpdate]:
        """A batch step raised: fail every running request and take back all KV slots and
        req_idx rows (the step may have allocated some no request records yet). Waiting
        requests hold neither, so the pools are whole again."""
        failed, self.running = self.running, []
        self.backend.drop_inflight()
        for req in failed:
            req.slots, req.req_idx, req.prefix = [], -1, None
            self.queue.release(req)
        self.backend.reset_pools()
        error = f"the worker failed a batch step: {type(e).__name__}: {e}"
        return [self._fail(req, error) for req in failed]

    def step(self, before_run: Optional[Callable[[], None]] = None) -> List[ReqStepUpdate]:
        """Admit, then run one batch step; ``before_run()`` is called between the two."""
        t0 = time.perf_counter()
        updates, self._failed = self._failed, []
        updates.extend(self._admit())
        if not self.running:  # a step still in flight for requests that are all gone: take its slots back
            return updates + self.backend.flush_decode()
        if before_run is not None:
            before_run()
        batch_reqs = len(self.running)
        prefilling = [r for r in self.running if r.in_prefill]
        try:
            may_admit = bool(self.queue.waiting) and self.admission_due(1) and not self.admit_behind_step
            result = self.backend.run_step(self.running, may_admit=may_admit)
        except Exception as e:
            # Ranks run the same step on the same inputs, so an error that comes from them is
            # raised on every rank and all fail the same requests, in lock-step. An error on one
            # rank only (a device fault) leaves the others in a collective, as a crash would.
            self._step_failures += 1
            logger.exception("batch step failed (%d in a row): failing its %d requests", self._step_failures,
                             batch_reqs)
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            return updates + self._fail_running(e)
        self._step_failures = 0
        self.last_result = result
        if not result.prefilled:
            self._steps_since_admit += result.steps
        step_updates = result.updates
        for u in step_updates:
            if u.accept_len:
                self._steps += 1
                self._step_tokens += u.accept_len
        if self._steps:
            self.mean_tokens_per_step = self._step_tokens / self._steps
        for req in prefilling:
            if not req.in_prefill and req.finish_reason is None:  # its prompt is done: share it now
                self.queue.unreserve(req, self.backend.cache_prompt(req))
        self._reap_finished()
        self.timing.add(time.perf_counter() - t0, batch_reqs, not result.prefilled, result.decode_reqs, self._ladder,
                        result.steps)
        if result.launched_decode_reqs:  # a decode step launched after the committed one: its time comes at its commit
            self._steps_since_admit += 1
            self.timing.add(0.0, len(self.running), True, result.launched_decode_reqs, self._ladder)
        return updates + step_updates

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue.waiting or self._failed)


def build_backend(args, device: str, dtype: str, parallel: Optional[ParallelContext] = None):
    """The DP backend for --dp > 1 or --enable_decode_microbatch_overlap, else chunked prefill."""
    from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend
    from lightllm.server.router.model_infer.mode_backend.dp_backend.impl import DPBackend

    parallel = parallel if parallel is not None else single_rank_context(device)
    if args.dp > 1 or args.enable_decode_microbatch_overlap:
        return DPBackend(args, device, dtype, parallel)
    return ChunkedPrefillBackend(args, device, dtype, parallel)


class MessageInbox:
    """The driver's messages from the HTTP process, read by a thread: the step loop's check for
    new ones is a SimpleQueue's (microseconds), not a poll of the pipe (a selector per call, ~5%
    of a loaded router's time). A None (shut down) ends the thread; so does a broken pipe; a message
    that cannot be read is logged and skipped."""

    def __init__(self, in_q):
        self._msgs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(in_q,), name="router-inbox", daemon=True)
        self._thread.start()

    def _read(self, in_q) -> None:
        while True:
            try:
                msg = in_q.get()
            except (EOFError, OSError):  # the HTTP process is gone
                msg = None
            except Exception:  # a message that does not unpickle: the others still come through
                logger.exception("the router could not read a message from the HTTP process")
                continue
            self._msgs.put(msg)
            if msg is None:
                return

    def poll(self, block: bool) -> list:
        """Messages waiting now (``block``: wait up to IDLE_POLL_S for the first); a None
        (shut down) once the HTTP process is gone."""
        msgs = []
        try:
            if block:
                msgs.append(self._msgs.get(timeout=IDLE_POLL_S))
            while True:
                msgs.append(self._msgs.get_nowait())
        except queue.Empty:
            parent = multiprocessing.parent_process()
            if block and parent is not None and not parent.is_alive():
                msgs.append(None)  # the server was killed: do not linger as an orphan
        return msgs


def _format_error(rank: int, e: Exception) -> str:
    """What the launcher prints for a rank's start-up failure: the error, and where it came from unless its
    message says all (``StartupError``: a flag asked for more than the device has)."""
    if isinstance(e, StartupError):
        return f"rank {rank}: {e}"
    return f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"


def router_worker_main(args, device: str, dtype: str, in_q, out_qs: Optional[Sequence], rank: int = 0) -> None:
    """Process entry of one rank: join the ranks, build the backend, report readiness
    (rank 0), then loop forever. ``in_q`` and ``out_qs`` (one queue per HTTP process,
    --httpserver_workers; start-up reports go to the first) are None except on rank 0."""
    out_q = out_qs[0] if out_qs is not None else None
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s router[{rank}]: %(message)s")
    exit_with_parent()
    if device == "cpu":  # ranks share the host's cores
        from lightllm.utils.cpu_threads import configure_cpu_threads

        configure_cpu_threads(ranks_on_host=max(1, args.tp // args.nnodes))
    try:
        parallel = init_parallel(
            args.tp, args.dp, rank, args.nnodes, args.node_rank, args.nccl_host, args.nccl_port, device,
            num_microbatches=NUM_OVERLAP_MICROBATCHES if args.enable_decode_microbatch_overlap else 1,
        )
    except Exception as e:  # no process group: report what we can
        if out_q is not None:
            out_q.put(WorkerError(_format_error(rank, e)))
        return
    error = None
    try:
        backend = build_backend(args, parallel.device, dtype, parallel)
        router = RouterManager(backend)
    except Exception as e:  # start-up failure: report it to the launcher with the cause
        error = _format_error(rank, e)
    errors = [err for err in parallel.all_gather_objects(error) if err is not None]
    if errors:
        if out_q is not None:
            out_q.put(WorkerError(errors[0]))
        parallel.destroy()
        return
    freeze_start_up_objects()
    if parallel.is_driver:
        out_q.put(WorkerReady(backend.vocab_size, backend.mem_manager.size, device, dtype, backend.captured_graphs()))
        # From here on, exiting never waits for the queue's feeder thread to flush into a pipe
        # whose reader may be dead (updates for a server that is gone are worthless).
        for q in out_qs:
            q.cancel_join_thread()
    serve_steps(router, parallel, in_q, out_qs)
    parallel.destroy()


def serve_steps(router: RouterManager, parallel: ParallelContext, in_q, out_qs: Optional[Sequence]) -> None:
    """The step loop of every rank until the driver receives None."""
    backend = router.backend
    log_every_steps = 200
    next_log = log_every_steps
    gauges = GaugePublisher(router, out_qs) if parallel.is_driver else None
    inbox = MessageInbox(in_q) if parallel.is_driver else None
    if gauges is not None:
        gauges.start()
    try:
        while True:
            msgs = inbox.poll(block=not router.has_work) if parallel.is_driver else None
            msgs = parallel.broadcast_from_driver(msgs)
            updates = []
            for m in msgs:
                if m is None:
                    return
                if isinstance(m, AddReq):
                    router.add_req(m)
                elif isinstance(m, AbortReq):
                    updates.extend(router.abort(m.req_id))
            updates.extend(router.step(before_run=gauges.before_step if gauges is not None else None))
            if updates and gauges is not None:
                gauges.send(updates)
            if backend.mtp_step and router._steps >= next_log and parallel.is_driver:
                next_log += log_every_steps
                logger.info("mtp mean tokens per step %.3f", router.mean_tokens_per_step)
    finally:
        if gauges is not None:
            gauges.stop()
