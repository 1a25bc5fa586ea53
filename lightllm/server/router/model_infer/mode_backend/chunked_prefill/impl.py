"""Chunked-prefill backend: each step either prefills prompt chunks or decodes every running request."""
from typing import List, Tuple

from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ModeBackend, ReqStepUpdate


class ChunkedPrefillBackend(ModeBackend):
    def __init__(self, args, device, dtype, parallel=None):
        super().__init__(args, device, dtype, parallel)
        self.batch_max_tokens = args.batch_max_tokens
        self.last_step_prefilled = False  # what run_step did last: prefill chunks or a decode step
        self.last_decode_reqs = 0  # requests the last decode step decoded (the router's step clock)

    def run_step(self, running: List[InferReq]) -> List[ReqStepUpdate]:
        """One engine step. Prefill and decode alternate while both have work,
        so a stream of long prompts never starves running decodes."""
        prefilling = [r for r in running if r.in_prefill]
        decoding = [r for r in running if not r.in_prefill and r.finish_reason is None]
        if prefilling and (not decoding or not self.last_step_prefilled):
            self.last_step_prefilled = True
            return self.prefill_chunks(prefilling)
        self.last_step_prefilled = False
        self.last_decode_reqs = len(decoding)
        return self.decode(decoding) if decoding else []

    def prefill_chunks(self, reqs: List[InferReq]) -> List[ReqStepUpdate]:
        return self.prefill(*self.chunk_plan(reqs))

    def chunk_plan(self, reqs: List[InferReq]) -> Tuple[List[InferReq], List[int]]:
        """The requests to prefill this step, in order, and their chunk lengths (within --batch_max_tokens)."""
        budget = self.batch_max_tokens
        picked, chunk_lens = [], []
        for req in reqs:
            if budget <= 0:
                break
            n = min(req.prompt_len - req.kv_len, budget)
            picked.append(req)
            chunk_lens.append(n)
            budget -= n
        return picked, chunk_lens
