"""Admission's table writes in one kernel: each admitted request's sampling parameters, its ASD budget and
ledger, and its next-token row, for all requests admitted at once.

Written one scalar at a time, a request cost nine small launches (~0.3 ms of host time on the H200's
host, docs/decode_step.md); here the requests' values travel as one packed int32 table (``pack_req_rows``:
a row per request, float fields as their float32 bits) and one program per row stores them.
"""
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID

# Columns of a packed row (int32; float fields hold their float32 bits)
REQ_IDX_COL = tl.constexpr(0)
TOP_K_COL = tl.constexpr(1)
TEMPERATURE_COL = tl.constexpr(2)
TOP_P_COL = tl.constexpr(3)
REPETITION_PENALTY_COL = tl.constexpr(4)
PRESENCE_PENALTY_COL = tl.constexpr(5)
FREQUENCY_PENALTY_COL = tl.constexpr(6)
ASD_BUDGET_COL = tl.constexpr(7)
ROW_COLS = tl.constexpr(8)
_NO_DRAFT = tl.constexpr(NO_DRAFT_TOKEN_ID)


def pack_req_rows(req_idx: Sequence[int], top_k: Sequence[int], temperature: Sequence[float],
                  top_p: Sequence[float], repetition_penalty: Sequence[float], presence_penalty: Sequence[float],
                  frequency_penalty: Sequence[float], asd_budget: Sequence[float]) -> np.ndarray:
    """The requests' values as [n, ROW_COLS] int32 rows (values already checked to fit int32 / float32)."""
    n = len(req_idx)
    rows = np.empty((n, int(ROW_COLS)), dtype=np.int32)
    floats = rows.view(np.float32)
    rows[:, REQ_IDX_COL] = req_idx
    rows[:, TOP_K_COL] = top_k
    floats[:, TEMPERATURE_COL] = temperature
    floats[:, TOP_P_COL] = top_p
    floats[:, REPETITION_PENALTY_COL] = repetition_penalty
    floats[:, PRESENCE_PENALTY_COL] = presence_penalty
    floats[:, FREQUENCY_PENALTY_COL] = frequency_penalty
    floats[:, ASD_BUDGET_COL] = asd_budget
    return rows


@triton.jit
def _init_req_rows_kernel(rows_ptr, temperature_ptr, top_k_ptr, top_p_ptr, repetition_ptr, presence_ptr,
                          frequency_ptr, asd_budget_ptr, asd_regret_ptr, next_ptr, next_stride,
                          NEXT_WIDTH: tl.constexpr, NEXT_BLOCK: tl.constexpr, HAS_ASD: tl.constexpr,
                          HAS_NEXT: tl.constexpr):
    row = rows_ptr + tl.program_id(0) * ROW_COLS
    idx = tl.load(row + REQ_IDX_COL).to(tl.int64)
    tl.store(top_k_ptr + idx, tl.load(row + TOP_K_COL))
    tl.store(temperature_ptr + idx, tl.load(row + TEMPERATURE_COL).to(tl.float32, bitcast=True))
    tl.store(top_p_ptr + idx, tl.load(row + TOP_P_COL).to(tl.float32, bitcast=True))
    tl.store(repetition_ptr + idx, tl.load(row + REPETITION_PENALTY_COL).to(tl.float32, bitcast=True))
    tl.store(presence_ptr + idx, tl.load(row + PRESENCE_PENALTY_COL).to(tl.float32, bitcast=True))
    tl.store(frequency_ptr + idx, tl.load(row + FREQUENCY_PENALTY_COL).to(tl.float32, bitcast=True))
    if HAS_ASD:
        tl.store(asd_budget_ptr + idx, tl.load(row + ASD_BUDGET_COL).to(tl.float32, bitcast=True))
        tl.store(asd_regret_ptr + idx, 0.0)
    if HAS_NEXT:
        cols = tl.arange(0, NEXT_BLOCK)
        no_draft = tl.full([NEXT_BLOCK], _NO_DRAFT, dtype=next_ptr.dtype.element_ty)
        tl.store(next_ptr + idx * next_stride + cols, no_draft, mask=cols < NEXT_WIDTH)


def init_req_rows_triton(rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         repetition_penalty: torch.Tensor, presence_penalty: torch.Tensor,
                         frequency_penalty: torch.Tensor, next_token_ids: Optional[torch.Tensor] = None,
                         asd_budget: Optional[torch.Tensor] = None,
                         asd_cum_regret: Optional[torch.Tensor] = None) -> None:
    """Store ``rows`` ([n, ROW_COLS] int32 on the tables' device, ``pack_req_rows``) in the per-request tables
    ([max_req + 1] each; ``next_token_ids`` [max_req + 1, W], if given: the row set to NO_DRAFT_TOKEN_ID) and,
    with the ASD tables, each request's budget and a ledger of 0."""
    if rows.dim() != 2 or rows.shape[1] != ROW_COLS or rows.dtype != torch.int32:
        raise ValueError(f"rows must be [n, {ROW_COLS}] int32, got {tuple(rows.shape)} {rows.dtype}")
    if (asd_budget is None) != (asd_cum_regret is None):
        raise ValueError("asd_budget and asd_cum_regret go together")
    has_next = next_token_ids is not None
    if has_next and (next_token_ids.dim() != 2 or next_token_ids.stride(1) != 1):
        raise ValueError("next_token_ids must be [rows, W] with contiguous rows")
    n = rows.shape[0]
    if not n:
        return
    has_asd = asd_budget is not None
    width = next_token_ids.shape[1] if has_next else 1
    _init_req_rows_kernel[(n,)](
        rows.contiguous(), temperature, top_k, top_p, repetition_penalty, presence_penalty, frequency_penalty,
        asd_budget if has_asd else temperature, asd_cum_regret if has_asd else temperature,
        next_token_ids if has_next else top_k, next_token_ids.stride(0) if has_next else 0,
        NEXT_WIDTH=width, NEXT_BLOCK=triton.next_power_of_2(width), HAS_ASD=has_asd, HAS_NEXT=has_next,
        num_warps=1,
    )
