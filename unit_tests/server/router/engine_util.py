"""Helpers for engine tests on CPU (no HTTP)."""
from typing import Dict, List

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


def hold_rows(backend) -> Dict[str, torch.Tensor]:
    """Copies of the HOLD row of every req_idx-indexed table of ``backend`` (padding must never change them)."""
    hold = backend.req_manager.HOLD_REQUEST_ID
    pm = backend.params_manager
    tables = {
        "req_to_next_token_ids": backend.req_to_next_token_ids,
        "req_to_token_indexs": backend.req_manager.req_to_token_indexs,
        "req_to_temperature": pm.req_to_temperature,
        "req_to_top_k": pm.req_to_top_k,
        "req_to_top_p": pm.req_to_top_p,
        "req_to_repetition_penalty": pm.req_to_repetition_penalty,
        "req_to_out_token_counts": pm.req_to_out_token_counts,
        "req_to_token_seen": pm.req_to_token_seen,
        "req_to_asd_cum_regret": pm.req_to_asd_cum_regret,
        "req_to_asd_budget": pm.req_to_asd_budget,
    }
    return {name: t[hold].clone() for name, t in tables.items() if t is not None}


def changed_hold_rows(backend, before: Dict[str, torch.Tensor]) -> List[str]:
    """Names of the tables whose HOLD row differs from ``before``."""
    after = hold_rows(backend)
    return [name for name in before if not torch.equal(before[name], after[name])]


def mode_args(drafts: Dict[str, str], mode: str, k: int, asd_budget: float) -> dict:
    """Engine arguments of ``mode``: plain, or [dspark_]mtp / asd0 / asd (eagle unless dspark_), K = ``k``, the
    asd mode at ``asd_budget``; ``drafts``: each draft's directory by name (eagle, dspark)."""
    if mode == "plain":
        return {}
    draft, _, mode = mode.rpartition("_")
    draft = draft or "eagle"
    mtp = dict(mtp_mode={"eagle": "eagle_with_att", "dspark": "dspark"}[draft], mtp_step=k,
               mtp_draft_model_dir=[drafts[draft]])
    if mode == "mtp":
        return mtp
    return dict(mtp, mtp_asd_regret_budget={"asd0": 0.0, "asd": asd_budget}[mode])
