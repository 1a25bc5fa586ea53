"""Greedy MTP verification kernels: strict and ASD (approximate, budgeted).

Vocabulary (the rule: docs/asd.md):

- row: one target-model position of a verify step. A request with ``K`` drafts
  owns ``K + 1`` contiguous rows, starting at ``b_req_mtp_start_loc[r]``.
- draft token ``d_j``: ``req_to_next_token_ids[req_idx, j + 1]``, ``j = 0..K-1``.
  ``NO_DRAFT_TOKEN_ID`` marks a column with no real proposal this step.
- target token ``t_j``: ``new_next_token_ids[start + j]``, what sampling chose for row ``j``.
- accept_len: committed tokens of the step, ``accepted drafts + 1``. Row 0 is always
  committed; the last committed row is the correction, or the bonus token when all
  ``K`` drafts were accepted.
- regret: ``r_j = max(0, z_j[t_j] - z_j[d_j])`` in fp32, over the processed logits ``z_j``
  of row ``j`` (``z_j[t_j]`` is the row maximum for greedy requests).
- relaxed token: a mismatched draft (``d_j != t_j``) that ASD accepts anyway. Its row's
  ``new_next_token_ids`` entry is overwritten with ``d_j`` in place.
- budget ``B``: ``req_to_asd_budget[req_idx]``, the total regret a request may spend over
  its life. ``spent``: ``req_to_asd_cum_regret[req_idx]``, the ledger; it grows only by
  the regret of accepted (relaxed) tokens.
- HOLD row: the padding ``req_idx`` (``ReqManager.HOLD_REQUEST_ID``). Its budget is 0, so
  it is verified strictly and its ledger entry is never written.
"""
import math
import os
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from lightllm.common.constants import MTP_TABLE_WIDTH

# Draft column that holds no proposal for this step: it never matches a target
# token and is never relaxed.
NO_DRAFT_TOKEN_ID = -1
_NO_DRAFT_TOKEN_ID_CONST = tl.constexpr(NO_DRAFT_TOKEN_ID)  # the same, usable inside kernels
# Widest next-token table the kernels support (W = K + 1 columns at least); the
# engine's table (MTP_TABLE_WIDTH) is narrower, kernel tests go up to this bound.
MAX_MTP_BLOCK = 16
assert MTP_TABLE_WIDTH <= MAX_MTP_BLOCK, "the engine's next-token table must fit the kernels"
# Verification is a few dozen scalars per request: one warp, no pipelining.
VERIFY_NUM_WARPS = 1
VERIFY_NUM_STAGES = 1
# Value of an unset ``block_max_mismatch`` inside the kernel (>= any K).
UNSET_BLOCK_MAX_MISMATCH = MAX_MTP_BLOCK
# Value of an unset ``local_regret_ratio``.
UNSET_LOCAL_REGRET_RATIO = math.inf

# Kernels are defined under the interpreter when this is set (see conftest.py).
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _request_rows(req_to_next_token_ids, req_to_next_token_ids_stride, table_width, b_req_mtp_start_loc,
                  new_next_token_ids, b_req_idx, batch_size, BLOCK_SIZE: tl.constexpr):
    """This program's request: its index, first row, rows, drafts (K) and slot, the lanes, which lanes hold a draft, the
    drafts d_j and the target's tokens t_j (lanes past K: no draft)."""
    cur_req = tl.program_id(0)
    num_reqs = tl.num_programs(0)
    start = tl.load(b_req_mtp_start_loc + cur_req)
    end = tl.load(b_req_mtp_start_loc + cur_req + 1, mask=cur_req + 1 < num_reqs, other=batch_size)
    num_rows = end - start
    # K; a request with more rows than table columns only has W - 1 drafts.
    num_drafts = tl.minimum(num_rows - 1, table_width - 1)
    req_idx = tl.load(b_req_idx + start).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    is_draft = offs < num_drafts  # [BLOCK_SIZE]
    draft = tl.load(  # [BLOCK_SIZE] d_j
        req_to_next_token_ids + req_idx * req_to_next_token_ids_stride + offs + 1,
        mask=is_draft,
        other=_NO_DRAFT_TOKEN_ID_CONST,
    )
    # [BLOCK_SIZE] t_j
    target = tl.load(new_next_token_ids + start + offs, mask=is_draft, other=_NO_DRAFT_TOKEN_ID_CONST)
    return cur_req, start, num_rows, num_drafts, req_idx, offs, is_draft, draft, target


@triton.jit
def _fwd_kernel_mtp_verify(
    req_to_next_token_ids,  # [max_req + 1, W] int64
    req_to_next_token_ids_stride,
    table_width,  # W
    b_req_mtp_start_loc,  # [num_reqs] int32
    new_next_token_ids,  # [batch] int64
    b_req_idx,  # [batch] int32
    mtp_accept_len,  # [num_reqs] int32, out
    accepted_index,  # [batch] int32, out
    batch_size,
    BLOCK_SIZE: tl.constexpr,
):
    cur_req, start, num_rows, num_drafts, req_idx, offs, is_draft, draft, target = _request_rows(
        req_to_next_token_ids, req_to_next_token_ids_stride, table_width, b_req_mtp_start_loc, new_next_token_ids,
        b_req_idx, batch_size, BLOCK_SIZE)
    # The first mismatch stops; lanes past K always stop, so accept_len <= K + 1.
    stop = (~is_draft) | (draft != target)
    accepted = tl.min(tl.where(stop, offs, BLOCK_SIZE), axis=0)
    accept_len = accepted + 1
    tl.store(mtp_accept_len + cur_req, accept_len)
    tl.store(accepted_index + start + offs, (offs < accept_len).to(tl.int32), mask=offs < num_rows)


@triton.jit
def _fwd_kernel_mtp_asd_verify(
    req_to_next_token_ids,  # [max_req + 1, W] int64
    req_to_next_token_ids_stride,
    table_width,  # W
    b_req_mtp_start_loc,  # [num_reqs] int32
    new_next_token_ids,  # [batch] int64, relaxed rows rewritten in place
    b_req_idx,  # [batch] int32
    logits,  # [batch, vocab] fp32 / bf16 / fp16, processed logits
    logits_stride,
    req_to_asd_cum_regret,  # [max_req + 1] fp32, ledger, updated in place
    req_to_asd_budget,  # [max_req + 1] fp32
    mtp_accept_len,  # [num_reqs] int32, out
    accepted_index,  # [batch] int32, out
    relaxed_mask,  # [batch] int32, out (1 on relaxed rows) when HAS_RELAXED_MASK
    batch_size,
    vocab_size,
    local_regret_ratio,  # fp32 g, inf = unset
    block_max_mismatch,  # int32 m, >= K = unset
    BLOCK_SIZE: tl.constexpr,
    HAS_RELAXED_MASK: tl.constexpr,
):
    cur_req, start, num_rows, num_drafts, req_idx, offs, is_draft, draft, target = _request_rows(
        req_to_next_token_ids, req_to_next_token_ids_stride, table_width, b_req_mtp_start_loc, new_next_token_ids,
        b_req_idx, batch_size, BLOCK_SIZE)
    # m == 0 or g == 0: strict identity, even on ties.
    strict = (block_max_mismatch == 0) | (local_regret_ratio == 0.0)
    mismatch = is_draft & (draft != target)  # [BLOCK_SIZE]
    # Only in-vocabulary ids of a mismatched row are ever read (t_j is checked too,
    # defensively: sampling never yields an id outside the vocabulary).
    in_vocab = (draft >= 0) & (draft < vocab_size) & (target >= 0) & (target < vocab_size)
    readable = mismatch & in_vocab & (~strict)  # [BLOCK_SIZE]

    # Two loads per row: z_j[t_j] and z_j[d_j], in fp32. Unread lanes give regret 0.
    row_ptr = logits + (start + offs).to(tl.int64) * logits_stride
    z_target = tl.load(row_ptr + target, mask=readable, other=0.0).to(tl.float32)
    z_draft = tl.load(row_ptr + draft, mask=readable, other=0.0).to(tl.float32)
    # A NaN regret stays NaN and fails every gate below.
    regret = tl.maximum(z_target - z_draft, 0.0, propagate_nan=tl.PropagateNan.ALL)  # [BLOCK_SIZE]

    budget = tl.load(req_to_asd_budget + req_idx)
    spent = tl.load(req_to_asd_cum_regret + req_idx)
    budget_left = budget - spent

    # Sequential walk over j = 0..K-1: fp32 sums in the order of the spec. The bound is
    # static (K <= W - 1 < BLOCK_SIZE); lanes past K stop the walk.
    risk = tl.zeros((), dtype=tl.float32)
    relaxed = tl.zeros((), dtype=tl.int32)
    accepted = tl.zeros((), dtype=tl.int32)
    alive = tl.full((), 1, dtype=tl.int32)
    for j in range(0, BLOCK_SIZE - 1):
        lane = offs == j
        row_mismatch = tl.sum(tl.where(lane & mismatch, 1, 0), axis=0) > 0
        row_readable = tl.sum(tl.where(lane & readable, 1, 0), axis=0) > 0
        r_j = tl.sum(tl.where(lane, regret, 0.0), axis=0)
        suffix_value = tl.maximum(num_drafts - j, 1).to(tl.float32)  # K - j (>= 1 while walking)
        new_risk = risk + r_j
        can_relax = (
            row_readable
            & (tl.div_rn(r_j, suffix_value) <= local_regret_ratio)
            & (risk < budget_left)
            & (new_risk <= budget_left)
            & (relaxed + 1 <= block_max_mismatch)
        )
        row_accepted = (alive != 0) & (j < num_drafts) & ((~row_mismatch) | can_relax)
        accepted += row_accepted.to(tl.int32)
        is_relaxed = row_accepted & row_mismatch
        risk = tl.where(is_relaxed, new_risk, risk)
        relaxed += is_relaxed.to(tl.int32)
        alive = row_accepted.to(tl.int32)

    accept_len = accepted + 1
    tl.store(mtp_accept_len + cur_req, accept_len)
    tl.store(accepted_index + start + offs, (offs < accept_len).to(tl.int32), mask=offs < num_rows)
    # Relaxed rows commit the draft token.
    is_relaxed_row = mismatch & (offs < accepted)
    tl.store(new_next_token_ids + start + offs, draft, mask=is_relaxed_row)
    if HAS_RELAXED_MASK:
        tl.store(relaxed_mask + start + offs, is_relaxed_row.to(tl.int32), mask=offs < num_rows)
    # Charge only the accepted prefix; keep spent <= B against fp32 rounding.
    # No store at zero risk: HOLD/padding rows (budget 0) never touch the ledger.
    tl.store(req_to_asd_cum_regret + req_idx, tl.minimum(spent + risk, budget), mask=risk > 0.0)


@triton.jit
def _fwd_kernel_mtp_scatter_next_token_ids(
    req_to_next_token_ids,  # [max_req + 1, W] int64
    req_to_next_token_ids_stride,
    all_next_token_ids,  # [batch, K + 1] int64
    all_next_token_ids_stride,
    b_req_mtp_start_loc,  # [num_reqs] int32
    b_req_idx,  # [batch] int32
    mtp_accept_len,  # [num_reqs] int32
    num_cols,  # K + 1
    BLOCK_SIZE: tl.constexpr,
):
    cur_req = tl.program_id(0)
    start = tl.load(b_req_mtp_start_loc + cur_req)
    accept_len = tl.load(mtp_accept_len + cur_req)
    src_row = (start + accept_len - 1).to(tl.int64)  # last committed row
    req_idx = tl.load(b_req_idx + src_row).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    mask = offs < num_cols
    token_ids = tl.load(all_next_token_ids + src_row * all_next_token_ids_stride + offs, mask=mask)
    tl.store(req_to_next_token_ids + req_idx * req_to_next_token_ids_stride + offs, token_ids, mask=mask)


# ----------------------------------------------------------------------------- wrappers


def verify_block_size(table_width: int) -> int:
    """Lanes per program for a next-token table of ``table_width`` columns (W)."""
    return triton.next_power_of_2(table_width)


def _check_tensor(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], ndim: int, device: torch.device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like req_to_next_token_ids")
    # Rows may be strided (a row stride is passed); elements inside a row must be dense.
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if ndim == 1 and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_device(device: torch.device):
    if device.type != "cuda" and not _TRITON_INTERPRET:
        raise ValueError(f"MTP verify kernels need CUDA tensors (got {device}); CPU runs only under TRITON_INTERPRET=1")


def _check_verify_inputs(
    req_to_next_token_ids: torch.Tensor,
    b_req_mtp_start_loc: torch.Tensor,
    new_next_token_ids: torch.Tensor,
    b_req_idx: torch.Tensor,
) -> torch.device:
    device = req_to_next_token_ids.device
    _check_device(device)
    _check_tensor("req_to_next_token_ids", req_to_next_token_ids, (torch.int64,), 2, device)
    _check_tensor("b_req_mtp_start_loc", b_req_mtp_start_loc, (torch.int32,), 1, device)
    _check_tensor("new_next_token_ids", new_next_token_ids, (torch.int64,), 1, device)
    _check_tensor("b_req_idx", b_req_idx, (torch.int32,), 1, device)
    width = req_to_next_token_ids.shape[1]
    if not 1 <= width <= MAX_MTP_BLOCK:
        raise ValueError(f"req_to_next_token_ids has {width} columns, supported 1..{MAX_MTP_BLOCK}")
    if new_next_token_ids.shape[0] != b_req_idx.shape[0]:
        raise ValueError(
            f"new_next_token_ids has {new_next_token_ids.shape[0]} rows but b_req_idx has {b_req_idx.shape[0]}"
        )
    if b_req_mtp_start_loc.shape[0] > b_req_idx.shape[0]:
        raise ValueError(f"{b_req_mtp_start_loc.shape[0]} requests but only {b_req_idx.shape[0]} rows")
    return device


def _verify_outputs(num_reqs: int, batch_size: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A verify kernel's outputs: ``mtp_accept_len`` int32 [num_reqs], ``accepted_index`` int32 [batch]."""
    return (torch.empty((num_reqs,), dtype=torch.int32, device=device),
            torch.empty((batch_size,), dtype=torch.int32, device=device))


def mtp_verify(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    new_next_token_ids: torch.Tensor,  # [batch] int64
    b_req_idx: torch.Tensor,  # [batch] int32
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Strict greedy verification: accept drafts up to the first ``d_j != t_j``.

    Returns ``mtp_accept_len`` int32 [num_reqs] and ``accepted_index`` int32 [batch]
    (1 for rows ``0..accept_len-1`` of each request, else 0).
    """
    device = _check_verify_inputs(req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx)
    num_reqs = b_req_mtp_start_loc.shape[0]
    batch_size = b_req_idx.shape[0]
    mtp_accept_len, accepted_index = _verify_outputs(num_reqs, batch_size, device)
    if num_reqs == 0:
        return mtp_accept_len, accepted_index
    _fwd_kernel_mtp_verify[(num_reqs,)](
        req_to_next_token_ids,
        req_to_next_token_ids.stride(0),
        req_to_next_token_ids.shape[1],
        b_req_mtp_start_loc,
        new_next_token_ids,
        b_req_idx,
        mtp_accept_len,
        accepted_index,
        batch_size,
        BLOCK_SIZE=verify_block_size(req_to_next_token_ids.shape[1]),
        num_warps=VERIFY_NUM_WARPS,
        num_stages=VERIFY_NUM_STAGES,
    )
    return mtp_accept_len, accepted_index


def _kernel_local_regret_ratio(local_regret_ratio: Optional[float]) -> float:
    if local_regret_ratio is None:
        return UNSET_LOCAL_REGRET_RATIO
    if isinstance(local_regret_ratio, bool) or not isinstance(local_regret_ratio, (int, float)):
        raise TypeError(f"local_regret_ratio must be a float, got {type(local_regret_ratio).__name__}")
    if math.isnan(local_regret_ratio) or local_regret_ratio < 0:
        raise ValueError(f"local_regret_ratio must be >= 0 (math.inf = unset), got {local_regret_ratio}")
    return float(local_regret_ratio)


def _kernel_block_max_mismatch(block_max_mismatch: Optional[int]) -> int:
    if block_max_mismatch is None:
        return UNSET_BLOCK_MAX_MISMATCH
    if isinstance(block_max_mismatch, bool) or not isinstance(block_max_mismatch, int):
        raise TypeError(f"block_max_mismatch must be an int, got {type(block_max_mismatch).__name__}")
    if block_max_mismatch < 0:
        raise ValueError(f"block_max_mismatch must be >= 0, got {block_max_mismatch}")
    # Any value >= K means no cap; clamp so it fits an int32 argument.
    return min(block_max_mismatch, UNSET_BLOCK_MAX_MISMATCH)


def mtp_asd_verify(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    new_next_token_ids: torch.Tensor,  # [batch] int64, relaxed rows rewritten in place
    b_req_idx: torch.Tensor,  # [batch] int32
    logits: torch.Tensor,  # [batch, vocab] fp32 / bf16 / fp16, processed logits
    req_to_asd_cum_regret: torch.Tensor,  # [max_req + 1] fp32, ledger, updated in place
    req_to_asd_budget: torch.Tensor,  # [max_req + 1] fp32
    local_regret_ratio: float,  # g, math.inf (or None) = unset
    block_max_mismatch: int,  # m, >= K (or None) = unset
    relaxed_mask: Optional[torch.Tensor] = None,  # [batch] int32, out: 1 on relaxed rows, else 0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ASD verification (docs/asd.md): strict, plus budgeted acceptance of mismatched drafts.

    Relaxed rows get ``d_j`` written into ``new_next_token_ids`` (and 1 in ``relaxed_mask``
    when given); the ledger grows by the regret of the accepted prefix. Budget 0, ``g == 0`` or ``m == 0`` give exactly
    ``mtp_verify``. No host synchronisation.

    Returns ``mtp_accept_len`` int32 [num_reqs] and ``accepted_index`` int32 [batch].
    """
    device = _check_verify_inputs(req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx)
    _check_tensor("logits", logits, (torch.float32, torch.bfloat16, torch.float16), 2, device)
    _check_tensor("req_to_asd_cum_regret", req_to_asd_cum_regret, (torch.float32,), 1, device)
    _check_tensor("req_to_asd_budget", req_to_asd_budget, (torch.float32,), 1, device)
    batch_size = b_req_idx.shape[0]
    if logits.shape[0] != batch_size:
        raise ValueError(f"logits has {logits.shape[0]} rows, expected one per batch row ({batch_size})")
    num_table_rows = req_to_next_token_ids.shape[0]
    for name, ledger in (("req_to_asd_cum_regret", req_to_asd_cum_regret), ("req_to_asd_budget", req_to_asd_budget)):
        if ledger.shape[0] != num_table_rows:
            raise ValueError(f"{name} has {ledger.shape[0]} entries, expected {num_table_rows} (one per req_idx)")
    g = _kernel_local_regret_ratio(local_regret_ratio)
    m = _kernel_block_max_mismatch(block_max_mismatch)
    if relaxed_mask is not None:
        _check_tensor("relaxed_mask", relaxed_mask, (torch.int32,), 1, device)
        if relaxed_mask.shape[0] != batch_size:
            raise ValueError(f"relaxed_mask has {relaxed_mask.shape[0]} rows, expected {batch_size}")

    num_reqs = b_req_mtp_start_loc.shape[0]
    mtp_accept_len, accepted_index = _verify_outputs(num_reqs, batch_size, device)
    if num_reqs == 0:
        return mtp_accept_len, accepted_index
    _fwd_kernel_mtp_asd_verify[(num_reqs,)](
        req_to_next_token_ids,
        req_to_next_token_ids.stride(0),
        req_to_next_token_ids.shape[1],
        b_req_mtp_start_loc,
        new_next_token_ids,
        b_req_idx,
        logits,
        logits.stride(0),
        req_to_asd_cum_regret,
        req_to_asd_budget,
        mtp_accept_len,
        accepted_index,
        relaxed_mask if relaxed_mask is not None else accepted_index,
        batch_size,
        logits.shape[1],
        g,
        m,
        BLOCK_SIZE=verify_block_size(req_to_next_token_ids.shape[1]),
        HAS_RELAXED_MASK=relaxed_mask is not None,
        num_warps=VERIFY_NUM_WARPS,
        num_stages=VERIFY_NUM_STAGES,
    )
    return mtp_accept_len, accepted_index


def mtp_scatter_next_token_ids(
    req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64, updated in place
    b_req_mtp_start_loc: torch.Tensor,  # [num_reqs] int32
    all_next_token_ids: torch.Tensor,  # [batch, K + 1] int64: verified token, then K drafts
    b_req_idx: torch.Tensor,  # [batch] int32
    mtp_accept_len: torch.Tensor,  # [num_reqs] int32
) -> None:
    """Store the next step's tokens of each request: row ``start + accept_len - 1`` of
    ``all_next_token_ids`` goes to columns ``0..K`` of the request's table row.
    Columns past ``K`` are untouched."""
    device = req_to_next_token_ids.device
    _check_device(device)
    _check_tensor("req_to_next_token_ids", req_to_next_token_ids, (torch.int64,), 2, device)
    _check_tensor("b_req_mtp_start_loc", b_req_mtp_start_loc, (torch.int32,), 1, device)
    _check_tensor("all_next_token_ids", all_next_token_ids, (torch.int64,), 2, device)
    _check_tensor("b_req_idx", b_req_idx, (torch.int32,), 1, device)
    _check_tensor("mtp_accept_len", mtp_accept_len, (torch.int32,), 1, device)
    num_cols = all_next_token_ids.shape[1]
    width = req_to_next_token_ids.shape[1]
    if not 1 <= num_cols <= min(width, MAX_MTP_BLOCK):
        raise ValueError(f"all_next_token_ids has {num_cols} columns, expected 1..{min(width, MAX_MTP_BLOCK)}")
    if all_next_token_ids.shape[0] != b_req_idx.shape[0]:
        raise ValueError(f"all_next_token_ids has {all_next_token_ids.shape[0]} rows, b_req_idx {b_req_idx.shape[0]}")
    num_reqs = b_req_mtp_start_loc.shape[0]
    if mtp_accept_len.shape[0] != num_reqs:
        raise ValueError(f"mtp_accept_len has {mtp_accept_len.shape[0]} entries, expected {num_reqs}")
    if num_reqs == 0:
        return
    _fwd_kernel_mtp_scatter_next_token_ids[(num_reqs,)](
        req_to_next_token_ids,
        req_to_next_token_ids.stride(0),
        all_next_token_ids,
        all_next_token_ids.stride(0),
        b_req_mtp_start_loc,
        b_req_idx,
        mtp_accept_len,
        num_cols,
        BLOCK_SIZE=verify_block_size(req_to_next_token_ids.shape[1]),
        num_warps=VERIFY_NUM_WARPS,
        num_stages=VERIFY_NUM_STAGES,
    )


def gen_b_req_mtp_start_loc(b_mtp_index: torch.Tensor, num_reqs: Optional[int] = None) -> torch.Tensor:
    """First row of every request: the rows where ``b_mtp_index == 0``, as int32 [num_reqs].

    ``b_mtp_index`` [batch] is each row's position inside its request (0..K). Pass
    ``num_reqs`` when the caller knows it: the result is then built on device without
    a host synchronisation. Without it, ``torch.nonzero`` syncs to learn the count.
    """
    if not isinstance(b_mtp_index, torch.Tensor) or b_mtp_index.ndim != 1:
        raise ValueError("b_mtp_index must be a 1-D tensor [batch]")
    is_start = b_mtp_index == 0  # [batch]
    if num_reqs is None:
        return torch.nonzero(is_start).flatten().to(torch.int32)
    # The n-th start row goes to slot n; other rows go to a spare slot that is dropped.
    slot = torch.cumsum(is_start, dim=0, dtype=torch.int64) - 1  # [batch]
    slot = torch.where(is_start & (slot < num_reqs), slot, num_reqs)
    rows = torch.arange(b_mtp_index.shape[0], dtype=torch.int32, device=b_mtp_index.device)
    b_req_mtp_start_loc = torch.zeros((num_reqs + 1,), dtype=torch.int32, device=b_mtp_index.device)
    b_req_mtp_start_loc.scatter_(0, slot, rows)
    return b_req_mtp_start_loc[:num_reqs]
