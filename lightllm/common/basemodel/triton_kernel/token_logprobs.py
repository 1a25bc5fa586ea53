"""log p(token) of each row in one pass over its logits: a running max and sum of exponentials
(fp32, one lane per column of a tile), then the token's logit minus the log of the sum.

One program per row walks the vocabulary's tiles in a fixed order, so a row's result does not
depend on the other rows; torch's log_softmax writes a [rows, vocab] tensor to gather one entry
a row, and its reduction order may change with the number of rows.
"""
import torch
import triton
import triton.language as tl

VOCAB_TILE = 2048  # logits per step of a row's walk
NUM_WARPS = 8


@triton.jit
def _token_logprob_kernel(logits_ptr, token_ids_ptr, out_ptr, vocab, stride_row, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, TILE)
    m = tl.full([TILE], -float("inf"), dtype=tl.float32)
    s = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, vocab, TILE):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a lane of only -inf so far keeps s = 0
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)  # a lane of only -inf: 0 * 0
    token = tl.load(token_ids_ptr + row)
    picked = tl.load(base + token).to(tl.float32)
    tl.store(out_ptr + row, picked - row_max - tl.log(total))


def token_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], token_ids [rows] -> [rows] fp32 log p(token)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        ids = token_ids.to(torch.int64).contiguous()
        _token_logprob_kernel[(rows,)](logits, ids, out, vocab, logits.stride(0), TILE=VOCAB_TILE,
                                       num_warps=NUM_WARPS)
    return out
