"""Helpers for engine tests on CPU (no HTTP)."""
from typing import List

import torch

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine


def make_engine(model_dir: str, **kw) -> OfflineEngine:
    return OfflineEngine(StartArgs(model_dir=model_dir, **kw), device="cpu", dtype="float32")


def hf_greedy(hf_model, prompt: List[int], max_new_tokens: int) -> List[int]:
    """transformers' own greedy generation: the independent reference."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
