"""The router: continuous batching over the model worker(s), in its own process(es).

With ``--tp N`` every rank runs this loop with its own RouterManager: rank 0 (the driver)
reads the HTTP process's messages and broadcasts them, so every rank admits, schedules
and steps identically (docs/parallel.md); only rank 0 sends updates back.
"""
import logging
import multiprocessing
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate
from lightllm.server.router.req_queue import ReqQueue
from lightllm.utils.dist_utils import NUM_OVERLAP_MICROBATCHES, ParallelContext, init_parallel, single_rank_context

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how long an idle router waits for a new request


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


@dataclass
class WorkerReady:
    vocab_size: int
    max_total_token_num: int
    device: str
    data_type: str


@dataclass
class StepTiming:
    """Batch steps the driver ran since its last report: the engine's own clock."""

    seconds: float = 0.0  # wall time inside steps (admission, forward, verify, draft)
    steps: int = 0
    batch_reqs: int = 0  # sum over those steps of the running requests

    def add(self, seconds: float, batch_reqs: int) -> None:
        self.seconds += seconds
        self.steps += 1
        self.batch_reqs += batch_reqs


@dataclass
class WorkerStats:
    """Sent with every batch of updates: the worker's load."""

    kv_used_tokens: int
    running_reqs: int
    waiting_reqs: int
    timing: StepTiming


@dataclass
class WorkerError:
    message: str


class RouterManager:
    def __init__(self, backend):
        self.backend = backend
        self.queue = ReqQueue(
            backend.mem_manager.size, backend.args.running_max_req_size, backend.mtp_step, backend.parallel.dp_size
        )
        self.running: List[InferReq] = []
        self.mean_tokens_per_step = 0.0
        self._steps = 0
        self._step_tokens = 0
        self.timing = StepTiming()

    def take_timing(self) -> StepTiming:
        """The timing since the last call, and start a new one."""
        timing, self.timing = self.timing, StepTiming()
        return timing

    def add_req(self, msg: AddReq) -> None:
        self.queue.append(
            InferReq(msg.req_id, msg.prompt_ids, msg.params, msg.eos_token_ids, asd_budget=msg.asd_budget)
        )

    def abort(self, req_id: int) -> List[ReqStepUpdate]:
        req = self.queue.remove(req_id)
        if req is None:
            req = next((r for r in self.running if r.req_id == req_id), None)
            if req is None:
                return []
            self._finish(req)
            self.running.remove(req)
        req.finish_reason = FinishReason.ABORT
        return [self.backend._update(req, [], [], accept_len=0)]

    def _finish(self, req: InferReq) -> None:
        self.backend.free_req(req)
        self.queue.release(req)

    def step(self) -> List[ReqStepUpdate]:
        t0 = time.perf_counter()
        running_per_group = [0] * self.queue.dp_size
        for req in self.running:
            running_per_group[req.dp_rank] += 1
        for req in self.queue.pop_admissible(running_per_group):
            self.backend.add_req(req)
            self.running.append(req)
        if not self.running:
            return []
        batch_reqs = len(self.running)
        updates = self.backend.run_step(self.running)
        for u in updates:
            if u.accept_len:
                self._steps += 1
                self._step_tokens += u.accept_len
        if self._steps:
            self.mean_tokens_per_step = self._step_tokens / self._steps
        done = [r for r in self.running if r.finish_reason is not None]
        for req in done:
            self._finish(req)
            self.running.remove(req)
        self.timing.add(time.perf_counter() - t0, batch_reqs)
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue.waiting)


def build_backend(args, device: str, dtype: str, parallel: Optional[ParallelContext] = None):
    """The DP backend for --dp > 1 or --enable_decode_microbatch_overlap, else chunked prefill."""
    from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend
    from lightllm.server.router.model_infer.mode_backend.dp_backend.impl import DPBackend

    parallel = parallel if parallel is not None else single_rank_context(device)
    if args.dp > 1 or args.enable_decode_microbatch_overlap:
        return DPBackend(args, device, dtype, parallel)
    return ChunkedPrefillBackend(args, device, dtype, parallel)


def _poll_messages(in_q, block: bool) -> list:
    """Messages waiting for the driver; a None (shut down) once the HTTP process is gone."""
    msgs = []
    try:
        if block:
            msgs.append(in_q.get(timeout=IDLE_POLL_S))
        while True:
            msgs.append(in_q.get_nowait())
    except queue.Empty:
        parent = multiprocessing.parent_process()
        if block and parent is not None and not parent.is_alive():
            msgs.append(None)  # the server was killed: do not linger as an orphan
    return msgs


def _format_error(rank: int, e: Exception) -> str:
    return f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"


def router_worker_main(args, device: str, dtype: str, in_q, out_q, rank: int = 0) -> None:
    """Process entry of one rank: join the ranks, build the backend, report readiness
    (rank 0), then loop forever. ``in_q`` / ``out_q`` are None except on rank 0."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s router[{rank}]: %(message)s")
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
    if parallel.is_driver:
        out_q.put(WorkerReady(backend.vocab_size, backend.mem_manager.size, device, dtype))
    serve_steps(router, parallel, in_q, out_q)
    parallel.destroy()


def serve_steps(router: RouterManager, parallel: ParallelContext, in_q, out_q) -> None:
    """The step loop of every rank until the driver receives None."""
    backend = router.backend
    log_every_steps = 200
    next_log = log_every_steps
    while True:
        msgs = _poll_messages(in_q, block=not router.has_work) if parallel.is_driver else None
        msgs = parallel.broadcast_from_driver(msgs)
        updates = []
        for m in msgs:
            if m is None:
                return
            if isinstance(m, AddReq):
                router.add_req(m)
            elif isinstance(m, AbortReq):
                updates.extend(router.abort(m.req_id))
        updates.extend(router.step())
        if updates and parallel.is_driver:
            mem = backend.mem_manager
            stats = WorkerStats(mem.size - mem.can_use_mem_size, len(router.running), len(router.queue.waiting),
                                router.take_timing())
            out_q.put((updates, stats))
        if backend.mtp_step and router._steps >= next_log and parallel.is_driver:
            next_log += log_every_steps
            logger.info("mtp mean tokens per step %.3f", router.mean_tokens_per_step)
