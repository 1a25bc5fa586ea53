"""The router and backend without HTTP: batch generation for tools and tests.

One rank (``--tp 1``): the router runs in this process. Several ranks: the same worker
processes as the server (``start_worker``), driven through rank 0's queues.
"""
import queue
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from tqdm import tqdm

from lightllm.server.api_start import resolve_device_and_dtype, start_worker, validate_start_args
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq, RouterManager, WorkerError, build_backend

MAX_IDLE_STEPS = 1000  # steps without any update before the engine is declared stuck
WORKER_IDLE_TIMEOUT_S = 600  # worker processes: seconds without any update before declaring them stuck


@dataclass
class GenResult:
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    # per token, its (id, log-prob) alternatives: only for a request with top_logprobs > 0
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    accept_lens: List[int] = field(default_factory=list)  # committed tokens per decode step
    # per decode step, the confidences of the K drafts it verified (drafts that report them)
    draft_confidences: List[List[float]] = field(default_factory=list)
    mtp_accepted_token_num: int = 0
    asd_relaxed_token_num: int = 0
    asd_regret_spent: float = 0.0
    error: Optional[str] = None  # set with finish_reason "error": why the worker failed the request
    prompt_cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache


class OfflineEngine:
    def __init__(self, args: StartArgs, device: Optional[str] = None, dtype: Optional[str] = None):
        self.args = validate_start_args(args)
        d, t = resolve_device_and_dtype(self.args)
        self.router: Optional[RouterManager] = None
        self.workers = None  # several ranks: this node's worker processes
        self.ready = None  # several ranks: what rank 0 reported at start-up (WorkerReady)
        if self.args.tp == 1:
            self.router = RouterManager(build_backend(self.args, device or d, dtype or t))
        else:
            if self.args.node_rank != 0:
                raise ValueError("OfflineEngine drives the ranks from node 0; start other nodes with the server CLI")
            self.workers, self._in_q, self._out_q, self.ready = start_worker(self.args, device or d, dtype or t)
        self._next_id = 0

    @property
    def backend(self):
        if self.router is None:
            raise AttributeError("the backend lives in the worker processes (--tp > 1)")
        return self.router.backend

    def close(self) -> None:
        """Stop the worker processes (several ranks); nothing to do in-process."""
        if self.workers is not None:
            self._in_q.put(None)
            self.workers.join(timeout=60)
            self.workers.kill()
            self.workers = None

    def __enter__(self) -> "OfflineEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def eos_token_ids(self) -> List[int]:
        from transformers import AutoTokenizer

        from lightllm.server.httpserver.manager import load_eos_token_ids

        d = self.args.resolved_model_dir
        return load_eos_token_ids(d, AutoTokenizer.from_pretrained(d))

    def generate(
        self,
        prompts: Sequence[List[int]],
        params: Sequence,  # dicts of request parameters, or SamplingParams
        eos_token_ids: Sequence[int] = (),
        asd_budgets: Optional[Sequence[float]] = None,
        progress: bool = False,
        on_step: Optional[Callable[[RouterManager], None]] = None,
    ) -> List[GenResult]:
        """Submit every prompt at once and step until all finish (results in prompt order).

        ``asd_budgets``: per-request ASD budget (default: ``SamplingParams.asd_budget``, the
        HTTP server's rule)."""
        if self.router is None and on_step is not None:
            raise ValueError("on_step needs the in-process router (--tp 1)")
        ids = {}
        msgs = []
        for i, (p, raw) in enumerate(zip(prompts, params)):
            sp = raw if isinstance(raw, SamplingParams) else SamplingParams.from_request(dict(raw))
            budget = asd_budgets[i] if asd_budgets is not None else sp.asd_budget(self.args.mtp_asd_regret_budget)
            rid = self._next_id
            self._next_id += 1
            ids[rid] = i
            msgs.append(AddReq(rid, list(p), sp, list(eos_token_ids), budget))
        results = [GenResult() for _ in prompts]
        bar = tqdm(total=len(prompts), disable=not progress, desc="generate")
        steps = self._local_steps(msgs) if self.router is not None else self._worker_steps(msgs)
        for updates in steps:
            for u in updates:
                r = results[ids[u.req_id]]
                r.token_ids.extend(u.token_ids)
                r.logprobs.extend(u.logprobs)
                if u.top_logprobs is not None:
                    r.top_logprobs.extend(u.top_logprobs)
                if u.accept_len:
                    r.accept_lens.append(u.accept_len)
                if u.draft_confidence is not None:
                    r.draft_confidences.append(u.draft_confidence)
                u.copy_totals_to(r)
                r.prompt_cached_tokens = u.prompt_cached_tokens
                if u.finish_reason is not None:
                    bar.update(1)
            if on_step is not None:
                on_step(self.router)
        bar.close()
        return results

    def _local_steps(self, msgs: List[AddReq]):
        """Step the in-process router until every request finished; yields each step's updates."""
        for m in msgs:
            self.router.add_req(m)
        idle = 0
        while self.router.has_work:
            updates = self.router.step()
            idle = 0 if updates else idle + 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError("engine made no progress (a request can never be admitted?)")
            yield updates

    def _worker_steps(self, msgs: List[AddReq]):
        """Send the requests to rank 0 and yield its updates until every request finished."""
        for m in msgs:
            self._in_q.put(m)
        unfinished = {m.req_id for m in msgs}
        waited = 0.0
        while unfinished:
            try:
                msg = self._out_q.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if not self.workers.is_alive():
                    raise RuntimeError(f"a worker process died (exit code {self.workers.exitcode})") from None
                if waited > WORKER_IDLE_TIMEOUT_S:
                    raise RuntimeError("worker processes made no progress") from None
                continue
            if isinstance(msg, WorkerError):
                raise RuntimeError(msg.message)
            waited = 0.0
            updates, _stats = msg
            unfinished -= {u.req_id for u in updates if u.finish_reason is not None}
            yield updates
