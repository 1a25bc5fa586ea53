"""Vectorized PyTorch implementations of the MTP verify / scatter kernels, for host (CPU) serving.

Same signatures and semantics as ``triton_kernel/mtp_utils.py`` (the rule: docs/asd.md), for
batches where every request has the same K (what the engine builds). CUDA tensors
use the Triton kernels; this path keeps a CPU server fast without the Triton
interpreter. Tests compare both against the readable reference beside the tests.
"""
import math
from typing import Optional, Tuple

import torch

from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID


def _layout(b_req_mtp_start_loc, new_next_token_ids):
    num_reqs, rows = b_req_mtp_start_loc.numel(), new_next_token_ids.numel()
    if num_reqs == 0 or rows % num_reqs:
        raise ValueError(f"{rows} rows do not split evenly over {num_reqs} requests")
    return num_reqs, rows // num_reqs  # requests, K + 1


def _drafts(req_to_next_token_ids, b_req_idx, b_req_mtp_start_loc, k):
    req_idx = b_req_idx[b_req_mtp_start_loc.long()].long()  # [num_reqs]
    return req_idx, req_to_next_token_ids[req_idx, 1:k + 1]  # [num_reqs, K]


def _accepted_index(accept_len, k1):
    return (torch.arange(k1, device=accept_len.device)[None, :] < accept_len[:, None]).to(torch.int32).reshape(-1)


def mtp_verify_torch(req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx) -> Tuple[torch.Tensor, torch.Tensor]:
    num_reqs, k1 = _layout(b_req_mtp_start_loc, new_next_token_ids)
    _, drafts = _drafts(req_to_next_token_ids, b_req_idx, b_req_mtp_start_loc, k1 - 1)
    targets = new_next_token_ids.view(num_reqs, k1)[:, : k1 - 1]
    accepted = torch.cumprod((drafts == targets).to(torch.int32), dim=1).sum(dim=1)
    accept_len = (accepted + 1).to(torch.int32)
    return accept_len, _accepted_index(accept_len, k1)


def mtp_asd_verify_torch(
    req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx, logits,
    req_to_asd_cum_regret, req_to_asd_budget, local_regret_ratio: Optional[float], block_max_mismatch: Optional[int],
    relaxed_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    num_reqs, k1 = _layout(b_req_mtp_start_loc, new_next_token_ids)
    k, vocab = k1 - 1, logits.shape[1]
    g = math.inf if local_regret_ratio is None else float(local_regret_ratio)
    m = k if block_max_mismatch is None else int(block_max_mismatch)
    req_idx, drafts = _drafts(req_to_next_token_ids, b_req_idx, b_req_mtp_start_loc, k)
    rows = new_next_token_ids.view(num_reqs, k1)  # in-place view
    z = logits.view(num_reqs, k1, vocab)
    left = req_to_asd_budget[req_idx] - req_to_asd_cum_regret[req_idx]  # [num_reqs] budget not yet spent
    risk = torch.zeros(num_reqs, dtype=torch.float32, device=logits.device)
    relaxed = torch.zeros(num_reqs, dtype=torch.int64, device=logits.device)
    alive = torch.ones(num_reqs, dtype=torch.bool, device=logits.device)
    accepted = torch.zeros(num_reqs, dtype=torch.int64, device=logits.device)
    strict_only = m == 0 or g == 0.0
    relaxed_rows = torch.zeros((num_reqs, k1), dtype=torch.int32, device=logits.device)
    for j in range(k):
        d, t = drafts[:, j], rows[:, j]
        exact = d == t
        valid = (d != NO_DRAFT_TOKEN_ID) & (d >= 0) & (d < vocab)
        zt = z[:, j].gather(1, t.clamp(0, vocab - 1)[:, None]).squeeze(1).float()
        zd = z[:, j].gather(1, d.clamp(0, vocab - 1)[:, None]).squeeze(1).float()
        r = torch.clamp(zt - zd, min=0.0)  # NaN stays NaN and fails every gate
        new_risk = risk + r
        relax = (~exact) & valid & (r / float(k - j) <= g) & (risk < left) & (new_risk <= left) & (relaxed + 1 <= m)
        if strict_only:
            relax = torch.zeros_like(relax)
        acc = alive & (exact | relax)
        relaxed_now = acc & ~exact
        risk = torch.where(relaxed_now, new_risk, risk)
        relaxed += relaxed_now.to(torch.int64)
        relaxed_rows[:, j] = relaxed_now.to(torch.int32)
        rows[:, j] = torch.where(relaxed_now, d, t)
        accepted += acc.to(torch.int64)
        alive = acc
    charged = risk > 0
    if bool(charged.any()):
        idx = req_idx[charged]
        budget = req_to_asd_budget[idx]
        req_to_asd_cum_regret[idx] = torch.minimum(req_to_asd_cum_regret[idx] + risk[charged], budget)
    if relaxed_mask is not None:
        relaxed_mask.copy_(relaxed_rows.view(-1))
    accept_len = (accepted + 1).to(torch.int32)
    return accept_len, _accepted_index(accept_len, k1)


def mtp_scatter_next_token_ids_torch(req_to_next_token_ids, b_req_mtp_start_loc, all_next_token_ids, b_req_idx, mtp_accept_len) -> None:
    src = (b_req_mtp_start_loc.long() + mtp_accept_len.long() - 1)  # [num_reqs] last committed row
    cols = all_next_token_ids.shape[1]
    req_to_next_token_ids[b_req_idx[src].long(), :cols] = all_next_token_ids[src]
