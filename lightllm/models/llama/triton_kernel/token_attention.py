"""Decode attention over the slot-indexed KV cache (one new token per row), in Triton.

One program per (row, query head): it walks the row's positions 0..b_seq_len-1
in blocks of BLOCK_N, looks each position's slot up in ``req_to_token_indexs``,
and keeps an online softmax in fp32. GQA: query head h reads kv head
h // (q_heads // kv_heads). MTP decode rows are ordinary rows here.
"""
import torch
import triton
import triton.language as tl

# Positions read per loop iteration.
TOKEN_BLOCK = 64
NUM_WARPS = 4


@triton.jit
def _token_decode_attention_kernel(
    q_ptr,  # [batch, q_heads, head_dim]
    k_ptr,  # [num_slots, kv_heads, head_dim]
    v_ptr,  # [num_slots, kv_heads, head_dim]
    req_to_token_ptr,  # [max_req + 1, max_seq_len] int64 slot of each position
    b_req_idx_ptr,  # [batch]
    b_seq_len_ptr,  # [batch]
    out_ptr,  # [batch, q_heads, head_dim]
    sm_scale,
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_req_row,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    GQA_GROUP: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GQA_GROUP
    req_idx = tl.load(b_req_idx_ptr + row).to(tl.int64)
    seq_len = tl.load(b_seq_len_ptr + row).to(tl.int32)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    row_max = -float("inf")
    row_sum = 0.0
    acc = tl.zeros([BLOCK_DMODEL], dtype=tl.float32)
    # A while loop: the interpreter (with numpy 2) cannot take a loaded value as a range() bound.
    start = 0
    while start < seq_len:
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        slots = tl.load(req_to_token_ptr + req_idx * stride_req_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)
        scores = tl.sum(q[None, :] * k, 1) * sm_scale  # [BLOCK_N]
        scores = tl.where(n_mask, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 0))
        rescale = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max)  # [BLOCK_N]
        v = tl.load(
            v_ptr + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, 0)
        row_sum = row_sum * rescale + tl.sum(p, 0)
        row_max = new_max
        start += BLOCK_N

    # An empty row (padding with b_seq_len 0) writes zeros instead of NaN.
    out = tl.where(row_sum > 0.0, acc / tl.maximum(row_sum, 1e-30), 0.0)
    out_offs = out_ptr + row * stride_out_row + head * stride_out_head + offs_d
    tl.store(out_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def token_decode_attention(
    q: torch.Tensor,  # [batch, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    req_to_token_indexs: torch.Tensor,  # [max_req + 1, max_seq_len] int64
    b_req_idx: torch.Tensor,  # [batch] int32 / int64
    b_seq_len: torch.Tensor,  # [batch] int32 / int64
    sm_scale: float,
) -> torch.Tensor:  # [batch, q_heads, head_dim]
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError("q, k_cache, v_cache must be [rows|slots, heads, head_dim]")
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if q_heads % kv_heads != 0:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("req_to_token_indexs", req_to_token_indexs)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if req_to_token_indexs.dtype != torch.int64:
        raise ValueError("req_to_token_indexs must be int64")
    if b_req_idx.shape != (batch,) or b_seq_len.shape != (batch,):
        raise ValueError("b_req_idx and b_seq_len must be [batch]")
    # the kernel indexes these flat: an expanded (stride-0) view would be read past its end
    b_req_idx, b_seq_len = b_req_idx.contiguous(), b_seq_len.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    grid = (batch, q_heads)
    _token_decode_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        req_to_token_indexs,
        b_req_idx,
        b_seq_len,
        out,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token_indexs.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        GQA_GROUP=q_heads // kv_heads,
        BLOCK_DMODEL=triton.next_power_of_2(head_dim),
        BLOCK_N=TOKEN_BLOCK,
        num_warps=NUM_WARPS,
    )
    return out
