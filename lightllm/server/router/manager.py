"""The router: continuous batching over one model worker, in its own process."""
import logging
import queue
import traceback
from dataclasses import dataclass
from typing import Dict, List

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate
from lightllm.server.router.req_queue import ReqQueue

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
class WorkerStats:
    """Sent with every batch of updates: the worker's load."""

    kv_used_tokens: int
    running_reqs: int
    waiting_reqs: int


@dataclass
class WorkerError:
    message: str


class RouterManager:
    def __init__(self, backend):
        self.backend = backend
        self.queue = ReqQueue(
            backend.mem_manager.size, backend.args.running_max_req_size, backend.mtp_step
        )
        self.running: List[InferReq] = []
        self.mean_tokens_per_step = 0.0
        self._steps = 0
        self._step_tokens = 0

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
        for req in self.queue.pop_admissible(len(self.running)):
            self.backend.add_req(req)
            self.running.append(req)
        if not self.running:
            return []
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
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue.waiting)


def build_backend(args, device: str, dtype: str):
    from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend

    return ChunkedPrefillBackend(args, device, dtype)


def router_worker_main(args, device: str, dtype: str, in_q, out_q) -> None:
    """Process entry: build the backend, report readiness, then loop forever."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s router: %(message)s")
    try:
        backend = build_backend(args, device, dtype)
        router = RouterManager(backend)
    except Exception as e:  # start-up failure: report it to the launcher with the cause
        out_q.put(WorkerError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    out_q.put(WorkerReady(backend.vocab_size, backend.mem_manager.size, device, dtype))
    log_every_steps = 200
    next_log = log_every_steps
    while True:
        msgs = []
        try:
            if not router.has_work:
                msgs.append(in_q.get(timeout=IDLE_POLL_S))
            while True:
                msgs.append(in_q.get_nowait())
        except queue.Empty:
            pass
        updates = []
        for m in msgs:
            if m is None:
                return
            if isinstance(m, AddReq):
                router.add_req(m)
            elif isinstance(m, AbortReq):
                updates.extend(router.abort(m.req_id))
        updates.extend(router.step())
        if updates:
            mem = backend.mem_manager
            out_q.put((updates, WorkerStats(mem.size - mem.can_use_mem_size, len(router.running), len(router.queue.waiting))))
        if backend.mtp_step and router._steps >= next_log:
            next_log += log_every_steps
            logger.info("mtp mean tokens per step %.3f", router.mean_tokens_per_step)
