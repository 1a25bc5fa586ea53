"""HTTP-side request manager: tokenize, send to the worker, stream updates back, detokenize."""
import asyncio
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional

from transformers import AutoTokenizer

from lightllm.server.core.objs.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.metrics import ServerMetrics
from lightllm.server.router.manager import AbortReq, AddReq

logger = logging.getLogger(__name__)


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
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    mtp_accepted_token_num: int = 0
    asd_relaxed_token_num: int = 0
    asd_regret_spent: float = 0.0
    text: str = ""


class HttpServerManager:
    def __init__(self, args, in_q, out_q, ready, worker=None):
        self.args = args
        self.in_q, self.out_q = in_q, out_q
        self.worker = worker
        self.vocab_size = ready.vocab_size
        self.max_total_token_num = ready.max_total_token_num
        self.model_dir = args.resolved_model_dir
        self.model_name = os.path.basename(os.path.normpath(self.model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.tokenizer)
        self.metrics = ServerMetrics()
        self._ids = itertools.count(1)
        self._streams: Dict[int, asyncio.Queue] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[threading.Thread] = None

    # ---- worker link ----
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = threading.Thread(target=self._read_worker, daemon=True)
        self._reader.start()

    def _read_worker(self) -> None:
        while True:
            msg = self.out_q.get()
            if msg is None:
                return
            self._loop.call_soon_threadsafe(self._dispatch, *msg)

    def _dispatch(self, updates, stats) -> None:
        self.metrics.observe_worker(stats)
        for u in updates:
            if u.accept_len:
                self.metrics.observe_step(u.accept_len)
            q = self._streams.get(u.req_id)
            if q is not None:
                q.put_nowait(u)

    def worker_alive(self) -> bool:
        return self.worker is None or self.worker.is_alive()

    # ---- requests ----
    def encode_prompt(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages) -> List[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_request(self, prompt_ids: List[int], params: SamplingParams) -> None:
        """Raise SamplingParamsError for anything the engine cannot serve."""
        if not prompt_ids:
            raise SamplingParamsError("inputs", "the prompt is empty")
        params.verify_vocab(self.vocab_size)
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.args.max_req_total_len:
            raise SamplingParamsError(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds --max_req_total_len {self.args.max_req_total_len}",
            )
        if params.asd_regret_budget is not None and not self.args.asd_enabled:
            raise SamplingParamsError(
                "asd_regret_budget",
                "this server runs without ASD; start it with --mtp_mode ... --mtp_asd_regret_budget B to enable "
                "per-request budgets",
            )
        params.stop_token_ids = [self.tokenizer.encode(s, add_special_tokens=False) for s in params.stop_sequences]

    def _asd_budget(self, params: SamplingParams) -> float:
        if not self.args.asd_enabled or not params.is_greedy:
            return 0.0  # sampled requests are verified strictly
        if params.asd_regret_budget is not None:
            return params.asd_regret_budget
        return self.args.mtp_asd_regret_budget

    async def generate(self, prompt_ids: List[int], params: SamplingParams, is_disconnected=None) -> AsyncIterator[ReqResult]:
        """Yield the growing result after each worker update; the last one has finish_reason set."""
        req_id = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[req_id] = q
        res = ReqResult(prompt_tokens=len(prompt_ids))
        start = time.time()
        first = True
        self.in_q.put(AddReq(req_id, prompt_ids, params, self.eos_token_ids, self._asd_budget(params)))
        try:
            while True:
                try:
                    u = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        raise asyncio.CancelledError()
                    if not self.worker_alive():
                        raise RuntimeError("model worker died")
                    continue
                if first and u.token_ids:
                    self.metrics.ttft.observe(time.time() - start)
                    first = False
                res.token_ids.extend(u.token_ids)
                res.logprobs.extend(u.logprobs)
                u.copy_totals_to(res)
                self._apply_stop_strings(res, params)
                if res.finish_reason is not None:
                    if u.finish_reason is None:  # a stop string the worker could not see in ids
                        self.in_q.put(AbortReq(req_id))
                    self._record_finished(res, time.time() - start)
                    yield res
                    return
                yield res
        except (asyncio.CancelledError, GeneratorExit):
            self.in_q.put(AbortReq(req_id))  # client went away: free its KV at once
            self.metrics.requests.labels(finish_reason="abort").inc()
            raise
        finally:
            self._streams.pop(req_id, None)

    def _apply_stop_strings(self, res: ReqResult, params: SamplingParams) -> None:
        res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        cut = min((i for i in (res.text.find(s) for s in params.stop_sequences) if i >= 0), default=-1)
        if cut >= 0:
            res.text = res.text[:cut]
            res.finish_reason = "stop"

    def _record_finished(self, res: ReqResult, latency: float) -> None:
        m = self.metrics
        m.requests.labels(finish_reason=res.finish_reason).inc()
        m.prompt_tokens.inc(res.prompt_tokens)
        m.generation_tokens.inc(len(res.token_ids))
        m.mtp_accepted.inc(res.mtp_accepted_token_num)
        m.asd_relaxed.inc(res.asd_relaxed_token_num)
        m.asd_regret.inc(res.asd_regret_spent)
        m.request_latency.observe(latency)

    def shutdown(self) -> None:
        try:
            self.in_q.put(None)
        except Exception:  # the worker may already be gone
            pass
