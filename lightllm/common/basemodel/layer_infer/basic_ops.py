"""Small tensor ops shared by the decoder layers, written to match Hugging Face numerics.

rms_norm, add_rms_norm, apply_rotary and silu_and_mul run a fused Triton kernel on CUDA tensors
(same rounding steps, see triton_kernel/fused_norm_rotary.py and silu_and_mul.py) and the PyTorch
reference otherwise.
"""
from typing import Optional, Tuple

import torch

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GRID_Y = 65535  # CUDA limit of the second grid axis (the rms_norm kernel's inner rows)


def _triton_ok(*tensors: torch.Tensor) -> bool:
    """All tensors on CUDA, one supported dtype, no autograd to record, last dim contiguous."""
    x = tensors[0]
    if not x.is_cuda or x.dtype not in _TRITON_DTYPES or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.is_cuda and t.dtype == x.dtype and t.stride(-1) == 1 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim]; statistics in fp32, result in x's dtype."""
    rows_ok = x.dim() == 2 or (x.dim() == 3 and x.shape[1] <= _MAX_GRID_Y)
    if rows_ok and weight.shape == x.shape[-1:] and _triton_ok(x, weight):
        from lightllm.common.basemodel.triton_kernel.fused_norm_rotary import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: statistics in fp32, normalized value rounded to x's dtype, then times weight."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """x, y: [rows, dim] (a residual and what a sublayer adds to it). Returns (x + y, rms_norm(x + y)),
    the sum rounded to x's dtype as torch's add rounds it; one launch on CUDA."""
    if (x.dim() == 2 and x.shape == y.shape and weight.shape == x.shape[-1:]
            and _triton_ok(x, y, weight)):
        from lightllm.common.basemodel.triton_kernel.fused_norm_rotary import add_rms_norm_triton

        return add_rms_norm_triton(x, y, weight, eps)
    total = x + y
    return total, rms_norm(total, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim] (halves duplicated, x's dtype)."""
    if (x.dim() == 3 and x.shape[-1] % 2 == 0 and cos.shape == (x.shape[0], x.shape[2]) == sin.shape
            and cos.stride() == sin.stride() and _triton_ok(x, cos, sin)):
        from lightllm.common.basemodel.triton_kernel.fused_norm_rotary import apply_rotary_triton

        return apply_rotary_triton(x, cos, sin)
    return apply_rotary_torch(x, cos, sin)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: x * cos + rotate_half(x) * sin, each op rounded to x's dtype."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def rotary_and_cache_kv(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor) -> Optional[torch.Tensor]:
    """Rotary on q and k; the rotated k and v of token t written to the caches at slots[t].
    q: [tokens, q_heads, head_dim] or None (k and v only), k, v: [tokens, kv_heads, head_dim], caches:
    [num_slots, kv_heads, head_dim], slots: [tokens] int64. Returns the rotated q (None without q).
    One Triton launch on CUDA."""
    fused = (k.dim() == v.dim() == 3 and k.shape[-1] % 2 == 0 and k.shape == v.shape
             and k_cache.shape[1:] == k.shape[1:] == v_cache.shape[1:]
             and cos.shape == (k.shape[0], k.shape[2]) == sin.shape and cos.stride() == sin.stride()
             and slots.dtype == torch.int64 and slots.is_cuda and slots.is_contiguous()
             and _triton_ok(k, v, cos, sin, k_cache, v_cache)
             and (q is None or (q.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
                                and _triton_ok(q, k))))
    if fused:
        from lightllm.common.basemodel.triton_kernel.fused_norm_rotary import rotary_cache_kv_triton

        return rotary_cache_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    k_cache[slots] = apply_rotary(k, cos, sin)
    v_cache[slots] = v
    return None if q is None else apply_rotary(q, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * intermediate] -> [tokens, intermediate]; one launch on CUDA."""
    if gate_up.dim() == 2 and gate_up.shape[-1] % 2 == 0 and _triton_ok(gate_up):
        from lightllm.common.basemodel.triton_kernel.silu_and_mul import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: silu(gate) rounded to the dtype, times up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
