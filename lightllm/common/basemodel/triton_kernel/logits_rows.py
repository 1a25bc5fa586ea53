"""Per-row reductions over a step's logits, read once in their own dtype: the first argmax and the
log-sum-exp (fp32) of each row, and log p(token) from them.

Two launches: programs of (row, chunk) reduce VOCAB_CHUNK columns each (all its tiles' loads in
flight at once) to a partial (max, first index of the max, sum of exp below the max); one program a
row merges its chunks in order. The chunks depend only on the vocabulary size, so a row's result
does not depend on the other rows (batch-invariant). torch.argmax and a log_softmax each read a
[rows, vocab] tensor one row per program (a decode step's 256 rows x 49k: ~20 us each on an H200).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

VOCAB_TILE = 1024  # columns per load of one program
VOCAB_CHUNK = 4 * VOCAB_TILE  # columns per program: its tiles are unrolled
NUM_WARPS = 4
INDEX_NONE = tl.constexpr(2**31 - 1)  # larger than any column: the min over the columns that hold the max


@triton.jit
def _chunk_kernel(logits_ptr, part_val_ptr, part_idx_ptr, part_sum_ptr, vocab, stride_row, num_chunks,
                  CHUNK: tl.constexpr, TILE: tl.constexpr, WITH_LSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = logits_ptr + row * stride_row
    cols = chunk * CHUNK + tl.arange(0, TILE)
    best = tl.full([TILE], -float("inf"), dtype=tl.float32)  # each lane's max so far
    best_idx = cols  # its first column (a lane of only -inf keeps its first)
    s = tl.zeros([TILE], dtype=tl.float32)  # each lane's sum of exp(x - best)
    for t in tl.static_range(CHUNK // TILE):
        c = cols + t * TILE
        x = tl.load(base + c, mask=c < vocab, other=-float("inf")).to(tl.float32)
        best_idx = tl.where(x > best, c, best_idx)  # strictly greater: the first column of a tie stays
        if WITH_LSE:
            m_new = tl.maximum(best, x)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(best - m_safe) + tl.exp(x - m_safe)
        best = tl.maximum(best, x)
    m = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == m, best_idx, INDEX_NONE), axis=0)
    out = row * num_chunks + chunk
    tl.store(part_val_ptr + out, m)
    tl.store(part_idx_ptr + out, idx)
    if WITH_LSE:
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        tl.store(part_sum_ptr + out, tl.sum(s * tl.exp(best - m_safe), axis=0))


@triton.jit
def _combine_kernel(part_val_ptr, part_idx_ptr, part_sum_ptr, ids_ptr, lse_ptr, num_chunks,
                    BLOCK_C: tl.constexpr, WITH_LSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    in_row = c < num_chunks
    base = row * num_chunks
    v = tl.load(part_val_ptr + base + c, mask=in_row, other=-float("inf"))
    i = tl.load(part_idx_ptr + base + c, mask=in_row, other=INDEX_NONE)
    m = tl.max(v, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where(v == m, i, INDEX_NONE), axis=0).to(tl.int64))
    if WITH_LSE:
        s = tl.load(part_sum_ptr + base + c, mask=in_row, other=0.0)
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        total = tl.sum(s * tl.exp(v - m_safe), axis=0)  # each chunk's sum is below its own max
        tl.store(lse_ptr + row, m_safe + tl.log(total))  # a row of only -inf: log 0 = -inf


def _rows(logits: torch.Tensor, with_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    ids = torch.empty(rows, dtype=torch.int64, device=dev)
    lse = torch.empty(rows if with_lse else 0, dtype=torch.float32, device=dev)
    if rows == 0 or vocab == 0:
        return ids.zero_(), lse.fill_(-float("inf"))
    chunks = triton.cdiv(vocab, VOCAB_CHUNK)
    part_val = torch.empty((rows, chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    part_sum = torch.empty((rows, chunks), dtype=torch.float32, device=dev) if with_lse else part_val
    _chunk_kernel[(rows, chunks)](logits, part_val, part_idx, part_sum, vocab, logits.stride(0), chunks,
                                  CHUNK=VOCAB_CHUNK, TILE=VOCAB_TILE, WITH_LSE=with_lse, num_warps=NUM_WARPS)
    _combine_kernel[(rows,)](part_val, part_idx, part_sum, ids, lse if with_lse else part_val, chunks,
                             BLOCK_C=triton.next_power_of_2(chunks), WITH_LSE=with_lse, num_warps=1)
    return ids, lse


def argmax_lse(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (any float dtype, rows may be strided) -> ([rows] int64 first argmax,
    [rows] fp32 log-sum-exp)."""
    return _rows(logits, True)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: torch.argmax(logits, -1) (the first of a tie)."""
    return _rows(logits, False)[0]


def token_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor, lse: torch.Tensor = None) -> torch.Tensor:
    """log p(token) of each row: logits [rows, vocab], token_ids [rows] -> [rows] fp32. ``lse``: the rows'
    log-sum-exp from ``argmax_lse`` (computed here when None)."""
    if lse is None:
        lse = argmax_lse(logits)[1]
    if logits.shape[0] == 0:
        return lse
    picked = logits.gather(1, token_ids.long().view(-1, 1)).view(-1).float()
    return picked - lse
