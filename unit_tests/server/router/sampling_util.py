"""Sampling tables and requests for tests of sample() (no model)."""
import torch

from lightllm.common.req_manager import ReqSamplingParamsManager
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.infer_batch import InferReq


def sampling_setup(vocab: int, raw_params, prompts, outputs, bypass=None):
    """Tables and requests for rows i = 0..n-1 (req_idx i): ``raw_params[i]`` validated as a
    client's, then ``bypass[i]`` sets raw fields past validation; ``outputs[i]`` are counted
    as generated tokens for the penalties."""
    pm = ReqSamplingParamsManager(len(raw_params), vocab, "cpu", asd_enabled=False)
    reqs = []
    for i, (raw, prompt, out) in enumerate(zip(raw_params, prompts, outputs)):
        sp = SamplingParams.from_request(dict(raw))
        for name, value in ((bypass or {}).get(i) or {}).items():
            object.__setattr__(sp, name, value)  # SamplingParams is frozen
        req = InferReq(i, prompt, sp, [])
        req.req_idx = i
        pm.init_req_sampling_params(req)
        if out:
            pm.update_penalty_state(torch.full((len(out),), i, dtype=torch.int32), torch.tensor(out))
        reqs.append(req)
    return pm, reqs
