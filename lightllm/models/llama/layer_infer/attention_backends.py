"""The kernels a decoder layer calls, chosen once per model (``LayerOps``).

Attention backends map (q [rows, q_heads, head_dim], k_cache, v_cache, infer_state,
sm_scale) to [rows, q_heads, head_dim]. One name (``--decode_attention_backend``; ``auto``:
triton on CUDA, torch elsewhere) picks prefill and decode attention together
(``ATTENTION_BACKENDS``): ``torch`` runs the padded PyTorch attention for both, ``triton``
the Triton decode kernel for decode and, for prefill, the same kernel once per new token
(each new token is a decode row over its request's positions 0..its own).

Deterministic inference (``--enable_deterministic_inference``, CUDA): the triton backend
whatever the name, and every linear layer is the batch-invariant Triton GEMM, so a token's
result does not depend on the rest of its batch, on prefill chunking, or on whether it was
computed as a plain decode row or an MTP verify row.
"""
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.triton_kernel.batch_invariant_matmul import batch_invariant_linear
from lightllm.common.basemodel.layer_infer.torch_attention import paged_attention_torch
from lightllm.models.llama.triton_kernel.token_attention import token_decode_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, InferStateInfo, float], torch.Tensor]
# (x [..., in], weight [out, in], bias [out] or None) -> [..., out]
LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
AUTO_BACKEND = "auto"
TORCH_BACKEND = "torch"
TRITON_BACKEND = "triton"


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


def _triton_per_token_attention(
    q: torch.Tensor,  # [num_new_tokens, q_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    infer_state: InferStateInfo,
    sm_scale: float,
) -> torch.Tensor:
    """Prefill as decode rows: new token t of item i attends to positions 0..positions[t], read
    through the slot table (its K/V and earlier new tokens' are already in the cache)."""
    return token_decode_attention(
        q,
        k_cache,
        v_cache,
        infer_state.req_manager.req_to_token_indexs,
        infer_state.b_req_idx[infer_state.token_item],
        infer_state.positions + 1,
        sm_scale,
    )


class AttentionPair(NamedTuple):
    """The prefill and decode attention of one backend."""

    prefill: AttentionFn
    decode: AttentionFn


ATTENTION_BACKENDS: Dict[str, AttentionPair] = {
    TORCH_BACKEND: AttentionPair(paged_attention_torch, paged_attention_torch),
    TRITON_BACKEND: AttentionPair(_triton_per_token_attention, _triton_decode_attention),
}


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto`` is triton on CUDA and torch elsewhere; an unknown name raises, listing the valid ones."""
    if name == AUTO_BACKEND:
        return TRITON_BACKEND if device.type == "cuda" else TORCH_BACKEND
    if name not in ATTENTION_BACKENDS:
        valid = ", ".join([AUTO_BACKEND] + sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown decode attention backend {name!r}; valid names: {valid}")
    return name


@dataclass(frozen=True)
class LayerOps:
    """What a decoder layer (and the logits head) computes with; one choice per model."""

    linear: LinearFn
    prefill_attention: AttentionFn
    decode_attention: AttentionFn


def get_layer_ops(decode_attention_backend: str, device: torch.device, deterministic: bool = False) -> LayerOps:
    """Prefill and decode attention of the backend the name resolves to; deterministic inference
    takes the triton pair and the batch-invariant linear layers (CUDA only)."""
    name = resolve_attention_backend(decode_attention_backend, device)
    if deterministic:
        if device.type != "cuda":
            raise ValueError("deterministic inference needs a CUDA device (its kernels are Triton)")
        name = TRITON_BACKEND
    attention = ATTENTION_BACKENDS[name]
    return LayerOps(batch_invariant_linear if deterministic else F.linear, attention.prefill, attention.decode)
