"""Batch-invariant linear layer: out = x @ w.T (+ bias), in Triton.

Each output row depends only on its own input row, never on how many rows the call
has: the tiles depend on the weight's shape (N, K) only, and every output element is
reduced over K in one fixed order (no split-K, no atomics). So a token's hidden states
and logits are bitwise the same alone, in a batch of 256, or as an MTP verify row, which
makes strict MTP token-identical to plain decoding in bf16 (``--enable_deterministic_inference``).
"""
import os

import torch
import triton
import triton.language as tl

# Rows per program: one Hopper warpgroup MMA row block, fixed for every M.
TILE_M = 64
TILE_K = 64
# Weights with at most this many output columns get narrower tiles (more programs at batch 1).
NARROW_N = 1024
TILE_N_NARROW, TILE_N_WIDE = 32, 64
NUM_WARPS = 4
NUM_STAGES = 3
# Triton's CPU interpreter computes garbage for bf16 dot products, and its fp32 dot (BLAS)
# rounds a row differently by its place in the tile: there the kernel sums fp32 products
# over K one by one, the same for every row.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _bi_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] or a dummy pointer
    out_ptr,  # [M, N]
    M,
    stride_xm,
    stride_wn,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if INTERPRETED:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif DOT_FP32:  # full fp32 products (not tf32)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tile_n(n: int) -> int:
    """Output columns per program: a function of the weight's shape only."""
    return TILE_N_NARROW if n <= NARROW_N else TILE_N_WIDE


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] or None -> [..., N] in x's dtype."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError("x, weight and bias must share a dtype")
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous in its last dim")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, k) = x2.shape[0], weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_n = tile_n(n)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, block_n))
    _bi_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out, m,
        x2.stride(0), weight.stride(0), out.stride(0),
        N=n, K=k, HAS_BIAS=bias is not None, DOT_FP32=x.dtype == torch.float32,
        INTERPRETED=_INTERPRETED,
        BLOCK_M=TILE_M, BLOCK_N=block_n, BLOCK_K=TILE_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out.reshape(*lead, n)
