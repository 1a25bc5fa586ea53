"""Small tensor ops shared by the decoder layers, written to match Hugging Face numerics."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim]; statistics in fp32, result in x's dtype."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim] (halves duplicated, x's dtype)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * intermediate] -> [tokens, intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
