"""Decode attention backends: swappable behind one signature, picked by name.

Every backend maps (q [rows, q_heads, head_dim], k_cache, v_cache, infer_state,
sm_scale) to [rows, q_heads, head_dim]. Prefill always uses the torch path.
"""
from typing import Callable, Dict

import torch

from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.torch_attention import paged_attention_torch
from lightllm.models.llama.triton_kernel.token_attention import token_decode_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, InferStateInfo, float], torch.Tensor]
AUTO_BACKEND = "auto"


def _triton_decode_attention(
    q: torch.Tensor,  # [rows, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    infer_state: InferStateInfo,
    sm_scale: float,
) -> torch.Tensor:
    return token_decode_attention(
        q,
        k_cache,
        v_cache,
        infer_state.req_manager.req_to_token_indexs,
        infer_state.b_req_idx,
        infer_state.b_seq_len,
        sm_scale,
    )


DECODE_ATTENTION_BACKENDS: Dict[str, AttentionFn] = {
    "torch": paged_attention_torch,
    "triton": _triton_decode_attention,
}


def get_decode_attention(name: str, device: torch.device) -> AttentionFn:
    """``auto`` picks triton on CUDA and torch elsewhere."""
    if name == AUTO_BACKEND:
        name = "triton" if device.type == "cuda" else "torch"
    if name not in DECODE_ATTENTION_BACKENDS:
        valid = ", ".join([AUTO_BACKEND] + sorted(DECODE_ATTENTION_BACKENDS))
        raise ValueError(f"unknown decode attention backend {name!r}; valid names: {valid}")
    return DECODE_ATTENTION_BACKENDS[name]
