"""Verification of one decode step: strict or ASD, Triton kernels on CUDA, PyTorch twins elsewhere.

The step around it (sample -> verify -> draft -> scatter -> commit) is ``decode_step.DecodeStep``.

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
from typing import Optional, Tuple

import torch

from lightllm.common.basemodel.mtp_verify_torch import mtp_asd_verify_torch, mtp_verify_torch
from lightllm.common.basemodel.triton_kernel.mtp_utils import mtp_asd_verify, mtp_verify
from lightllm.common.req_manager import ReqSamplingParamsManager


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
    relaxed_mask: Optional[torch.Tensor] = None,  # [rows] int32, out (ASD only): 1 on relaxed rows
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
        relaxed_mask,
    )
