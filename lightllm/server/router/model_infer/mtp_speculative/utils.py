"""The shared decode flow: sample -> verify -> host copy -> draft -> scatter -> commit.

Glossary (see docs/asd.md):
- accept_len: committed tokens of one request in one verify step, counting the
  target's own token of the last committed row (1 .. K+1).
- relaxed token: a draft token committed although it differs from the target's
  greedy choice (ASD only).
- regret: z_j[t_j] - z_j[d_j] of a relaxed token; the budget bounds its sum per request.
- HOLD row: padding rows (DP) point at req_idx = HOLD; they are never committed.
  They sit after the real rows (``rows.num_real_rows``): the forwards and the draft run
  over them, sampling, verification and commit never see them.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from lightllm.common.basemodel.batch_objs import ModelOutput
from lightllm.common.basemodel.mtp_verify_torch import mtp_asd_verify_torch, mtp_verify_torch
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID, mtp_asd_verify, mtp_verify
from lightllm.common.req_manager import ReqSamplingParamsManager
from lightllm.server.router.model_infer.mode_backend.generic_post_process import token_logprobs


@dataclass
class VerifyStepRecord:
    """What one verify step saw, for observers (calibration, analysis); device tensors."""

    mtp_step: int  # K
    b_req_idx: torch.Tensor  # [rows] int32
    drafts: torch.Tensor  # [rows] int64, d_j checked at row j (NO_DRAFT_TOKEN_ID at the bonus row)
    target_ids: torch.Tensor  # [rows] int64, t_j before verification
    committed_ids: torch.Tensor  # [rows] int64, after verification (relaxed rows hold d_j)
    processed_logits: torch.Tensor  # [rows, vocab] fp32
    accept_len: torch.Tensor  # [num_reqs] int32


@dataclass(frozen=True)
class AsdConfig:
    local_regret_ratio: float  # g; math.inf when unset
    block_max_mismatch: int  # m; >= K when unset


def verify_mtp_tokens(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    next_token_ids: torch.Tensor,  # [rows] int64, updated in place by ASD
    b_req_idx: torch.Tensor,  # [rows] int32
    logits: torch.Tensor,  # [rows, vocab] processed logits that produced next_token_ids
    params_manager: ReqSamplingParamsManager,
    asd: Optional[AsdConfig],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The one dispatcher: strict when ASD is off, otherwise ASD with each request's budget.

    CUDA tensors run the Triton kernels; host tensors the vectorized PyTorch twins.

    Sampled requests have budget 0 in ``req_to_asd_budget``, so a mixed batch is
    verified row by row: strict for them, ASD for greedy ones.
    """
    on_gpu = next_token_ids.is_cuda
    if asd is None:
        verify = mtp_verify if on_gpu else mtp_verify_torch
        return verify(req_to_next_token_ids, b_req_mtp_start_loc, next_token_ids, b_req_idx)
    return (mtp_asd_verify if on_gpu else mtp_asd_verify_torch)(
        req_to_next_token_ids,
        b_req_mtp_start_loc,
        next_token_ids,
        b_req_idx,
        logits,
        params_manager.req_to_asd_cum_regret,
        params_manager.req_to_asd_budget,
        asd.local_regret_ratio,
        asd.block_max_mismatch,
    )


def verify_draft_commit(backend, rows, out: ModelOutput):
    """Run the shared flow for one decode forward's rows; returns per-request updates."""
    k1 = rows.rows_per_req
    pm = backend.params_manager
    real = rows.num_real_rows  # padding rows (after these) are never sampled nor verified
    b_req_idx = rows.b_req_idx[:real]
    row_reqs = [r for r in rows.reqs for _ in range(k1)]
    seeds = [backend._seed(r, j) for r in rows.reqs for j in range(k1)]
    s = backend.sample_rows(out.logits[:real], b_req_idx, row_reqs, seeds)
    next_ids = s.next_token_ids
    asd = backend.asd_config
    observer = backend.verify_observer
    if rows.mtp_step > 0 and rows.reqs:
        target_ids = next_ids.clone() if asd is not None or observer is not None else None
        accept_len, _ = verify_mtp_tokens(
            backend.req_to_next_token_ids, rows.b_req_mtp_start_loc, next_ids, b_req_idx,
            s.processed_logits, pm, asd,
        )
    else:
        target_ids = next_ids  # nothing verified (K = 0, or a DP rank with only padding)
        accept_len = torch.ones(len(rows.reqs), dtype=torch.int32, device=next_ids.device)
    if observer is not None and rows.mtp_step > 0 and rows.reqs:
        observer(_verify_record(backend, rows, target_ids, next_ids, s.processed_logits, accept_len))
    # Log-probs after verification: a relaxed row reports the token it commits.
    logprobs = token_logprobs(s.processed_logits, next_ids)
    # Host copies only now: verification may have rewritten next_ids in place.
    ids_cpu = next_ids.tolist()
    lp_cpu = logprobs.tolist()
    acc_cpu = accept_len.tolist()
    relaxed_cpu = (next_ids != target_ids).tolist() if rows.mtp_step > 0 and asd is not None else None
    spent_cpu = None
    if asd is not None:
        spent_cpu = pm.req_to_asd_cum_regret[rows.b_req_idx[rows.b_req_mtp_start_loc.long()].long()].tolist()
    if rows.mtp_step > 0:
        backend.draft.propose_after_verify(backend, rows, out, next_ids, accept_len)
    else:
        backend.req_to_next_token_ids[b_req_idx.long(), 0] = next_ids
    return commit_rows(backend, rows, ids_cpu, lp_cpu, acc_cpu, relaxed_cpu, spent_cpu)


def _verify_record(backend, rows, target_ids, next_ids, logits, accept_len) -> VerifyStepRecord:
    k, real = rows.mtp_step, rows.num_real_rows
    b_req_idx, b_mtp_index = rows.b_req_idx[:real], rows.b_mtp_index[:real]
    col = torch.clamp(b_mtp_index.long() + 1, max=k)  # bonus row: any column, masked below
    drafts = backend.req_to_next_token_ids[b_req_idx.long(), col]
    drafts = torch.where(b_mtp_index == k, torch.full_like(drafts, NO_DRAFT_TOKEN_ID), drafts)
    return VerifyStepRecord(k, b_req_idx, drafts, target_ids, next_ids.clone(), logits, accept_len.clone())


def commit_rows(backend, rows, ids_cpu, lp_cpu, acc_cpu, relaxed_cpu, spent_cpu) -> List:
    """Commit accepted rows on the host, stop at EOS / stop / length, free rejected slots."""
    k1 = rows.rows_per_req
    updates, committed, free_slots = [], [], []
    slots_cpu = rows.mem_indexes_cpu.tolist()
    for r, req in enumerate(rows.reqs):
        start, a = r * k1, acc_cpu[r]
        kept = 0
        for j in range(a):
            kept += 1
            if req.append_token(ids_cpu[start + j], lp_cpu[start + j]):
                break
        req.decode_steps += 1
        req.mtp_accepted_token_num += min(kept, a - 1)
        if relaxed_cpu is not None:
            req.asd_relaxed_token_num += sum(relaxed_cpu[start + j] for j in range(min(kept, a - 1)))
        if spent_cpu is not None:
            req.asd_regret_spent = spent_cpu[r]
        req.kv_len += kept
        req.slots.extend(slots_cpu[start:start + kept])
        free_slots.extend(slots_cpu[start + kept:start + k1])
        toks = ids_cpu[start:start + kept]
        committed.append(toks)
        updates.append(backend._update(req, toks, lp_cpu[start:start + kept], accept_len=kept))
    if free_slots:
        backend.mem_manager.free(free_slots)
    backend._update_penalties(rows.reqs, committed)
    return updates
