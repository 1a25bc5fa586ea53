"""The kernels a decoder layer calls, chosen once per model (``LayerOps``).

An attention function maps (q [rows, q_heads, head_dim], k_cache, v_cache, infer_state,
sm_scale) to [rows, q_heads, head_dim], for prefill chunks, decode rows and MTP verify rows
alike. ``--decode_attention_backend`` names it (``auto``: triton on CUDA, torch elsewhere):
``torch`` is the padded PyTorch attention, ``triton`` the paged variable-length kernel
(``unified_attention.py``), whose plan is built once per forward from the rows' requests and
lengths and kept on the ``infer_state``.

Deterministic inference (``--enable_deterministic_inference``, CUDA): the triton kernel with a
deterministic plan (every row its own block, no KV split) whatever the name, and every linear
layer is the batch-invariant Triton GEMM, so a token's result does not depend on the rest of its
batch, on prefill chunking, or on whether it was computed as a plain decode row or an MTP
verify row.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.triton_kernel.batch_invariant_matmul import batch_invariant_linear
from lightllm.common.basemodel.layer_infer.torch_attention import paged_attention_torch
from lightllm.models.llama.triton_kernel.unified_attention import (
    AttentionPlan, plan_attention, plan_split_rows, unified_attention,
)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, InferStateInfo, float], torch.Tensor]
# (x [..., in], weight [out, in], bias [out] or None) -> [..., out]
LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
AUTO_BACKEND = "auto"
TORCH_BACKEND = "torch"
TRITON_BACKEND = "triton"


def attention_plan(infer_state: InferStateInfo, q_heads: int, kv_heads: int, head_dim: int,
                   deterministic: bool) -> Tuple[AttentionPlan, ...]:
    """The forward's plans (each row in one): built by the first layer that asks, reused by the others.
    A forward with a decode head (a mixed step) plans its decode rows and its prompt chunks apart."""
    plans = infer_state.attention_plan
    if plans is not None and plans[0].group * kv_heads == q_heads:
        return plans
    if infer_state.is_prefill:
        req, seq_len = infer_state.b_req_idx[infer_state.token_item], infer_state.positions + 1
    else:
        req, seq_len = infer_state.b_req_idx, infer_state.b_seq_len
    head = infer_state.decode_head
    if head is not None and not deterministic:  # a deterministic plan is one block per row anyway
        # the rest's runs: a chunk per running request at most, then one run of padding rows
        plans = plan_split_rows(req, seq_len, q_heads, kv_heads, head.rows, head.q_len, head.max_runs,
                                infer_state.max_q_len, min(infer_state.max_q_runs, head.max_runs + 1), head_dim)
    else:
        plans = (plan_attention(req, seq_len, q_heads, kv_heads, infer_state.max_q_len, infer_state.max_q_runs,
                                deterministic, head_dim),)
    infer_state.attention_plan = plans
    return plans


def _triton_attention(q, k_cache, v_cache, infer_state: InferStateInfo, sm_scale: float,
                      deterministic: bool = False) -> torch.Tensor:
    out = None
    for plan in attention_plan(infer_state, q.shape[1], k_cache.shape[1], q.shape[2], deterministic):
        out = unified_attention(q, k_cache, v_cache, infer_state.req_manager.req_to_token_indexs, plan, sm_scale, out)
    return out


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, infer_state: InferStateInfo,
                     sm_scale: float) -> torch.Tensor:
    return _triton_attention(q, k_cache, v_cache, infer_state, sm_scale)


def deterministic_triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   infer_state: InferStateInfo, sm_scale: float) -> torch.Tensor:
    return _triton_attention(q, k_cache, v_cache, infer_state, sm_scale, deterministic=True)


ATTENTION_BACKENDS: Dict[str, AttentionFn] = {
    TORCH_BACKEND: paged_attention_torch,
    TRITON_BACKEND: triton_attention,
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
    attention: AttentionFn


def get_layer_ops(decode_attention_backend: str, device: torch.device, deterministic: bool = False) -> LayerOps:
    """The attention the name resolves to; deterministic inference takes the deterministic triton
    attention and the batch-invariant linear layers (CUDA only)."""
    name = resolve_attention_backend(decode_attention_backend, device)
    if deterministic:
        if device.type != "cuda":
            raise ValueError("deterministic inference needs a CUDA device (its kernels are Triton)")
        return LayerOps(batch_invariant_linear, deterministic_triton_attention)
    return LayerOps(F.linear, ATTENTION_BACKENDS[name])
