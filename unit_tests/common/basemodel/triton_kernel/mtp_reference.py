"""Slow, readable PyTorch references for the MTP verify kernels, written from the strict
rule and the ASD rule of docs/asd.md ("The rule"). Inputs are never mutated.

All fp32 arithmetic is done on 0-d float32 tensors so the rounding is the one the
kernel sees (the rule's quantities are fp32).
"""
from typing import List, Tuple

import torch


def _request_rows(b_req_mtp_start_loc: torch.Tensor, batch_size: int) -> List[Tuple[int, int]]:
    """(start, end) rows of each request: a request ends where the next one starts."""
    starts = [int(s) for s in b_req_mtp_start_loc.tolist()]
    ends = starts[1:] + [batch_size]
    return list(zip(starts, ends))


def ref_mtp_verify(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    new_next_token_ids: torch.Tensor,  # [batch] int64
    b_req_idx: torch.Tensor,  # [batch] int32
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Strict: accept_len = (first j with d_j != t_j) + 1, or K + 1 if none."""
    batch_size = b_req_idx.shape[0]
    rows = _request_rows(b_req_mtp_start_loc, batch_size)
    accept_lens = []
    accepted_index = torch.zeros(batch_size, dtype=torch.int32)
    for start, end in rows:
        num_drafts = end - start - 1
        req_idx = int(b_req_idx[start])
        accepted = 0
        for j in range(num_drafts):
            draft = int(req_to_next_token_ids[req_idx, j + 1])
            target = int(new_next_token_ids[start + j])
            if draft != target:
                break
            accepted += 1
        accept_len = accepted + 1
        accept_lens.append(accept_len)
        accepted_index[start : start + accept_len] = 1
    device = req_to_next_token_ids.device
    return torch.tensor(accept_lens, dtype=torch.int32, device=device), accepted_index.to(device)


def ref_mtp_asd_verify(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    new_next_token_ids: torch.Tensor,  # [batch] int64
    b_req_idx: torch.Tensor,  # [batch] int32
    logits: torch.Tensor,  # [batch, vocab]
    req_to_asd_cum_regret: torch.Tensor,  # [max_req + 1] fp32
    req_to_asd_budget: torch.Tensor,  # [max_req + 1] fp32
    local_regret_ratio: float,  # g, math.inf = unset
    block_max_mismatch: int,  # m, >= K = unset
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ASD rule of docs/asd.md.

    Returns (mtp_accept_len [num_reqs], accepted_index [batch],
    new_next_token_ids [batch] with relaxed rows committed, updated ledger [max_req + 1]).
    """
    device = req_to_next_token_ids.device
    table = req_to_next_token_ids.cpu()
    targets = new_next_token_ids.cpu()
    committed = targets.clone()
    z = logits.cpu().float()
    ledger = req_to_asd_cum_regret.cpu().clone()
    budgets = req_to_asd_budget.cpu()
    batch_size, vocab_size = z.shape
    g = torch.tensor(local_regret_ratio, dtype=torch.float32)
    m = block_max_mismatch

    accept_lens = []
    accepted_index = torch.zeros(batch_size, dtype=torch.int32)
    for start, end in _request_rows(b_req_mtp_start_loc.cpu(), batch_size):
        num_drafts = end - start - 1  # K
        req_idx = int(b_req_idx[start])
        budget = budgets[req_idx]
        spent = ledger[req_idx]
        budget_left = budget - spent  # B - spent, fp32
        risk = torch.zeros((), dtype=torch.float32)
        relaxed = 0
        accepted = 0
        for j in range(num_drafts):
            row = start + j
            draft = int(table[req_idx, j + 1])
            target = int(targets[row])
            if draft == target:
                accepted += 1  # exact match: free
                continue
            if m == 0 or bool(g == 0):
                break  # strict identity, even on ties
            if not (0 <= draft < vocab_size and 0 <= target < vocab_size):
                break  # no proposal / padding: never read the logits
            regret = torch.clamp(z[row, target] - z[row, draft], min=0.0)
            suffix_value = torch.tensor(num_drafts - j, dtype=torch.float32)
            risk_before = risk
            risk = risk + regret
            relaxed += 1
            if (
                bool(regret / suffix_value <= g)
                and bool(risk_before < budget_left)
                and bool(risk <= budget_left)
                and relaxed <= m
            ):
                accepted += 1
                committed[row] = draft  # the relaxed row commits the draft token
            else:
                risk = risk_before  # the rejected mismatch is not charged
                break
        accept_len = accepted + 1
        accept_lens.append(accept_len)
        accepted_index[start : start + accept_len] = 1
        if bool(risk > 0):
            # spent += accepted risk; spent <= B is kept against fp32 rounding.
            ledger[req_idx] = torch.minimum(spent + risk, budget)

    return (
        torch.tensor(accept_lens, dtype=torch.int32, device=device),
        accepted_index.to(device),
        committed.to(device),
        ledger.to(device),
    )


def ref_mtp_scatter(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    all_next_token_ids: torch.Tensor,  # [batch, K + 1] int64
    b_req_idx: torch.Tensor,  # [batch] int32
    mtp_accept_len: torch.Tensor,  # [num_reqs] int32
) -> torch.Tensor:
    """Returns the updated table: each request's last committed row of
    ``all_next_token_ids`` goes to columns 0..K of its table row."""
    table = req_to_next_token_ids.clone()
    num_cols = all_next_token_ids.shape[1]
    for r, start in enumerate(b_req_mtp_start_loc.tolist()):
        src = start + int(mtp_accept_len[r]) - 1
        req_idx = int(b_req_idx[src])
        table[req_idx, :num_cols] = all_next_token_ids[src]
    return table

