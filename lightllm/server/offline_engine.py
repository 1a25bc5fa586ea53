"""The router and backend in-process, without HTTP: batch generation for tools and tests."""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from tqdm import tqdm

from lightllm.server.api_start import resolve_device_and_dtype, validate_start_args
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq, RouterManager, build_backend

MAX_IDLE_STEPS = 1000  # steps without any update before the engine is declared stuck


@dataclass
class GenResult:
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    accept_lens: List[int] = field(default_factory=list)  # committed tokens per decode step
    mtp_accepted_token_num: int = 0
    asd_relaxed_token_num: int = 0
    asd_regret_spent: float = 0.0


class OfflineEngine:
    def __init__(self, args: StartArgs, device: Optional[str] = None, dtype: Optional[str] = None):
        self.args = validate_start_args(args)
        d, t = resolve_device_and_dtype(self.args)
        self.router = RouterManager(build_backend(self.args, device or d, dtype or t))
        self._next_id = 0

    @property
    def backend(self):
        return self.router.backend

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

        ``asd_budgets``: per-request ASD budget (default: the server flag for greedy
        requests, 0 for sampled ones, as the HTTP server does)."""
        ids = {}
        for i, (p, raw) in enumerate(zip(prompts, params)):
            sp = raw if isinstance(raw, SamplingParams) else SamplingParams.from_request(dict(raw))
            if asd_budgets is not None:
                budget = asd_budgets[i]
            elif self.args.asd_enabled and sp.is_greedy:
                budget = sp.asd_regret_budget if sp.asd_regret_budget is not None else self.args.mtp_asd_regret_budget
            else:
                budget = 0.0
            rid = self._next_id
            self._next_id += 1
            ids[rid] = i
            self.router.add_req(AddReq(rid, list(p), sp, list(eos_token_ids), budget))
        results = [GenResult() for _ in prompts]
        bar = tqdm(total=len(prompts), disable=not progress, desc="generate")
        idle = 0
        while self.router.has_work:
            updates = self.router.step()
            idle = 0 if updates else idle + 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError("engine made no progress (a request can never be admitted?)")
            for u in updates:
                r = results[ids[u.req_id]]
                r.token_ids.extend(u.token_ids)
                r.logprobs.extend(u.logprobs)
                if u.accept_len:
                    r.accept_lens.append(u.accept_len)
                r.finish_reason = u.finish_reason
                r.mtp_accepted_token_num = u.mtp_accepted_token_num
                r.asd_relaxed_token_num = u.asd_relaxed_token_num
                r.asd_regret_spent = u.asd_regret_spent
                if u.finish_reason is not None:
                    bar.update(1)
            if on_step is not None:
                on_step(self.router)
        bar.close()
        return results
