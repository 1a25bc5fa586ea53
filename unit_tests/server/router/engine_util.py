"""Drive the router + backend in-process on CPU (no HTTP): tests of batching, stops, abort, KV."""
import dataclasses
from typing import Dict, List, Optional

import torch

from lightllm.server.api_start import validate_start_args
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq, RouterManager, build_backend

MAX_STEPS = 10_000


def make_router(model_dir: str, **kw) -> RouterManager:
    args = validate_start_args(StartArgs(model_dir=model_dir, **kw))
    return RouterManager(build_backend(args, "cpu", "float32"))


def run_to_completion(router: RouterManager, prompts: List[List[int]], params: List[dict],
                      eos: Optional[List[int]] = None, asd_budgets: Optional[List[float]] = None,
                      on_step=None) -> Dict[int, dict]:
    """Submit every prompt at once, step until all finish; returns req_id -> result."""
    results = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        s = SamplingParams.from_request(dict(sp))
        budget = asd_budgets[i] if asd_budgets else 0.0
        router.add_req(AddReq(i, list(p), s, list(eos or []), budget))
        results[i] = {"tokens": [], "finish_reason": None, "accept_lens": []}
    for _ in range(MAX_STEPS):
        if not router.has_work:
            break
        for u in router.step():
            r = results[u.req_id]
            r["tokens"].extend(u.token_ids)
            if u.accept_len:
                r["accept_lens"].append(u.accept_len)
            r.update(finish_reason=u.finish_reason, mtp_accepted_token_num=u.mtp_accepted_token_num,
                     asd_relaxed_token_num=u.asd_relaxed_token_num, asd_regret_spent=u.asd_regret_spent)
        if on_step is not None:
            on_step(router)
    assert not router.has_work, "engine did not finish"
    return results


def hf_greedy(hf_model, prompt: List[int], max_new_tokens: int) -> List[int]:
    """transformers' own greedy generation: the independent reference."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
