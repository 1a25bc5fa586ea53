"""Fused RMSNorm and rotary embedding kernels for the decode step.

``_rotary_cache_kernel`` also writes the rotated K and V of each new token to its KV-cache
slot, so one launch replaces rotary on q, rotary on k and the two cache writes.
``_add_rms_norm_kernel`` adds a layer's residual and normalizes the sum in one launch.

The kernels reproduce the rounding steps of the PyTorch code in basic_ops.py:
every intermediate that torch stores in the tensor dtype is cast to that dtype here
as well. Launches pass enable_fp_fusion=False so that a multiply and an add are not
contracted into one fma, which would round once instead of twice.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

NUM_WARPS_SMALL = 4
NUM_WARPS_LARGE = 8
LARGE_BLOCK = 2048  # rows at least this wide use NUM_WARPS_LARGE


@triton.jit
def _normed_row(x, w_ptr, cols, mask, inv_dim, eps, dtype):
    # torch: mean = sum(x^2) * (1 / dim), then rsqrt(mean + eps), all fp32
    variance = tl.sum(x * x, axis=0) * inv_dim
    normed = (x * tl.math.rsqrt(variance + eps)).to(dtype)
    # torch: weight * normed computes in fp32 and rounds once to the tensor dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    stride_x_outer, stride_x_inner, stride_out_outer, stride_out_inner,
    dim, inv_dim, eps,
    BLOCK: tl.constexpr,
):
    # One program per row; a row is (outer, inner) of a [outer, inner, dim] view.
    outer = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x_row = x_ptr + outer * stride_x_outer + inner * stride_x_inner
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normed_row(x, w_ptr, cols, mask, inv_dim, eps, out_ptr.dtype.element_ty)
    out_row = out_ptr + outer * stride_out_outer + inner * stride_out_inner
    tl.store(out_row + cols, out, mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr,
    stride_x, stride_y, stride_sum, stride_out,
    dim, inv_dim, eps,
    BLOCK: tl.constexpr,
):
    # One program per row: sum = x + y rounded to the dtype (torch's add), then the norm of that sum.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + y).to(dtype)
    tl.store(sum_ptr + row * stride_sum + cols, total, mask=mask)
    out = _normed_row(total.to(tl.float32), w_ptr, cols, mask, inv_dim, eps, dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _rotate_tile(x_row, stride_head, out_row, out_stride_head, num_heads, half, cos_lo, cos_hi, sin_lo, sin_hi,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One token's [BLOCK_H, BLOCK_HALF] tile per half, rotated and stored.
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    x_lo_ptr = x_row + heads * stride_head + cols
    x_lo = tl.load(x_lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_lo_ptr + half, mask=mask, other=0.0).to(tl.float32)
    dtype = out_row.dtype.element_ty
    # torch: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x_hi, x_lo]; each op rounds
    out_lo = ((x_lo * cos_lo).to(dtype).to(tl.float32) + (-x_hi * sin_lo).to(dtype).to(tl.float32)).to(dtype)
    out_hi = ((x_hi * cos_hi).to(dtype).to(tl.float32) + (x_lo * sin_hi).to(dtype).to(tl.float32)).to(dtype)
    out_lo_ptr = out_row + heads * out_stride_head + cols
    tl.store(out_lo_ptr, out_lo, mask=mask)
    tl.store(out_lo_ptr + half, out_hi, mask=mask)


@triton.jit
def _load_cos_sin(cos_ptr, sin_ptr, token, stride_cs_token, half, BLOCK_HALF: tl.constexpr):
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cs_ptr = token * stride_cs_token + cols
    cos_lo = tl.load(cos_ptr + cs_ptr, mask=cols < half, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs_ptr + half, mask=cols < half, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs_ptr, mask=cols < half, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs_ptr + half, mask=cols < half, other=0.0).to(tl.float32)
    return cos_lo, cos_hi, sin_lo, sin_hi


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_x_token, stride_x_head, stride_cs_token, stride_out_token, stride_out_head,
    num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token, over all its heads.
    token = tl.program_id(0).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = _load_cos_sin(cos_ptr, sin_ptr, token, stride_cs_token, half, BLOCK_HALF)
    _rotate_tile(x_ptr + token * stride_x_token, stride_x_head, out_ptr + token * stride_out_token, stride_out_head,
                 num_heads, half, cos_lo, cos_hi, sin_lo, sin_hi, BLOCK_H, BLOCK_HALF)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cs_token, stride_qo_token, stride_qo_head, stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    q_heads, kv_heads, half,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per new token: rotate q into q_out, rotate k into its cache slot, copy v there.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = _load_cos_sin(cos_ptr, sin_ptr, token, stride_cs_token, half, BLOCK_HALF)
    _rotate_tile(q_ptr + token * stride_q_token, stride_q_head, q_out_ptr + token * stride_qo_token, stride_qo_head,
                 q_heads, half, cos_lo, cos_hi, sin_lo, sin_hi, BLOCK_QH, BLOCK_HALF)
    _rotate_tile(k_ptr + token * stride_k_token, stride_k_head, k_cache_ptr + slot * stride_kc_slot, stride_kc_head,
                 kv_heads, half, cos_lo, cos_hi, sin_lo, sin_hi, BLOCK_KH, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_KH)[:, None]
    cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    mask = (heads < kv_heads) & (cols < 2 * half)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + cols, mask=mask, other=0.0)
    tl.store(v_cache_ptr + slot * stride_vc_slot + heads * stride_vc_head + cols, v, mask=mask)


def _num_warps(block: int) -> int:
    return NUM_WARPS_LARGE if block >= LARGE_BLOCK else NUM_WARPS_SMALL


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, dim] or [outer, inner, dim] with x.stride(-1) == 1; weight: [dim] contiguous."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    x3, out3 = (x.unsqueeze(1), out.unsqueeze(1)) if x.dim() == 2 else (x, out)
    block = triton.next_power_of_2(dim)
    grid = (x3.shape[0], x3.shape[1])
    _rms_norm_kernel[grid](
        x3, weight, out3,
        x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        dim, 1.0 / dim, eps,
        BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False,
    )
    return out


def add_rms_norm_triton(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """x, y: [rows, dim] with stride(-1) == 1; weight: [dim] contiguous. Returns (x + y, rms_norm(x + y))."""
    rows, dim = x.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(rows,)](
        x, y, weight, total, out,
        x.stride(0), y.stride(0), total.stride(0), out.stride(0),
        dim, 1.0 / dim, eps,
        BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False,
    )
    return total, out


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] with x.stride(-1) == 1; cos, sin: [tokens, head_dim],
    same strides, last dim contiguous."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    out = torch.empty_like(x)
    block_h = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        x, cos, sin, out,
        x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
        num_heads, half,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=_num_warps(block_h * block_half), enable_fp_fusion=False,
    )
    return out


def rotary_cache_kv_triton(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor) -> Optional[torch.Tensor]:
    """q: [tokens, q_heads, head_dim] or None (k and v only), k, v: [tokens, kv_heads, head_dim] (last dim
    contiguous); cos, sin: [tokens, head_dim], same strides; k_cache, v_cache: [num_slots, kv_heads, head_dim];
    slots: [tokens] int64. Writes rotated k and v at the slots; returns rotated q (new tensor), None without q."""
    num_tokens, kv_heads, head_dim = k.shape
    half = head_dim // 2
    q_out = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    # without q the kernel rotates no q heads: k stands in for its pointers, never read or written
    q_in, q_dst, q_heads = (k, k, 0) if q is None else (q, q_out, q.shape[1])
    block_qh, block_kh = triton.next_power_of_2(max(q_heads, 1)), triton.next_power_of_2(kv_heads)
    block_half = triton.next_power_of_2(half)
    _rotary_cache_kernel[(num_tokens,)](
        q_in, k, v, cos, sin, q_dst, k_cache, v_cache, slots,
        q_in.stride(0), q_in.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), q_dst.stride(0), q_dst.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        q_heads, kv_heads, half,
        BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half,
        num_warps=_num_warps(max(block_qh, block_kh) * block_half), enable_fp_fusion=False,
    )
    return q_out
