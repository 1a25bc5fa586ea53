"""One Llama decoder layer: pre-norm attention over the KV cache, then a SwiGLU MLP.

Tensor / data parallel (docs/parallel.md): ``shape`` holds this rank's heads; the
attention output is summed over the DP group (row-parallel o_proj); the MLP runs on the
rows of every DP group with this rank's part of the intermediate dim and is summed over
all ranks. ``infer_state.comm`` does the collectives (identity on one rank).
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.basic_ops import add_rms_norm, rms_norm, rotary_and_cache_kv, silu_and_mul
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight
from lightllm.models.llama.layer_infer.attention_backends import LayerOps, LinearFn
from lightllm.utils.dist_utils import TpComm


def ffn_forward(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, comm: TpComm, linear: LinearFn = F.linear
) -> torch.Tensor:
    """SwiGLU MLP, tensor parallel over all ranks. x: [rows, hidden] of my DP group ->
    [rows, hidden]: gather every group's rows, my intermediate part, sum over ranks, my rows."""
    rows = comm.mlp_gather_rows(x)  # [dp * rows, hidden]
    partial = linear(silu_and_mul(linear(rows, gate_up_proj, None)), down_proj, None)
    return comm.mlp_reduce_rows(partial)


@dataclass(frozen=True)
class AttentionShape:
    q_heads: int  # this rank's heads
    kv_heads: int
    head_dim: int
    rms_norm_eps: float


class LlamaTransformerLayerInfer:
    def __init__(self, layer_num: int, shape: AttentionShape, ops: LayerOps):
        self.layer_num = layer_num  # index into the mem_manager's per-layer buffers
        self.shape = shape
        self.ops = ops
        self.sm_scale = shape.head_dim**-0.5

    def forward(
        self, hidden: torch.Tensor, weight: TransformerLayerWeight, infer_state: InferStateInfo
    ) -> torch.Tensor:
        """hidden: [num_new_tokens, hidden] -> [num_new_tokens, hidden]."""
        hidden, delta = self.forward_deferred(hidden, None, weight, infer_state)
        return hidden + delta

    def forward_deferred(
        self, hidden: torch.Tensor, delta: Optional[torch.Tensor], weight: TransformerLayerWeight,
        infer_state: InferStateInfo,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer with its last residual add left to the caller: its input is hidden + delta (hidden when
        delta is None) and it returns (h, d) whose sum is its output, so that the next layer adds d in its
        input norm's launch. Each sum is rounded as torch's add rounds it: outputs equal ``forward``'s."""
        eps = self.shape.rms_norm_eps
        if delta is None:
            x = rms_norm(hidden, weight.input_norm, eps)
        else:
            hidden, x = add_rms_norm(hidden, delta, weight.input_norm, eps)
        attn = self._attention(x, weight, infer_state)
        hidden, x = add_rms_norm(hidden, attn, weight.post_attention_norm, eps)
        return hidden, self._ffn(x, weight, infer_state.comm)

    def _qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, weight: TransformerLayerWeight
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head q/k norms (Qwen3); Llama has none."""
        return q, k

    def _attention(self, x: torch.Tensor, weight: TransformerLayerWeight, infer_state: InferStateInfo) -> torch.Tensor:
        s = self.shape
        num_tokens = x.shape[0]
        linear = self.ops.linear
        qkv = linear(x, weight.qkv_proj, weight.qkv_bias)  # [tokens, (q_heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = q.view(num_tokens, s.q_heads, s.head_dim)
        k = k.view(num_tokens, s.kv_heads, s.head_dim)
        v = v.view(num_tokens, s.kv_heads, s.head_dim)
        q, k = self._qk_norm(q, k, weight)
        mem = infer_state.mem_manager
        k_cache = mem.k_buffer[self.layer_num]  # [num_slots, kv_heads, head_dim]
        v_cache = mem.v_buffer[self.layer_num]
        # New tokens' K/V go in first, so each token (and each later MTP row) sees them.
        q = rotary_and_cache_kv(q, k, v, infer_state.position_cos, infer_state.position_sin, k_cache, v_cache,
                                infer_state.mem_indexes)
        o = self.ops.attention(q, k_cache, v_cache, infer_state, self.sm_scale)  # [tokens, q_heads, head_dim]
        if infer_state.comm.attn_size == 1:
            return linear(o.reshape(num_tokens, s.q_heads * s.head_dim), weight.o_proj, weight.o_bias)
        out = infer_state.comm.attn_all_reduce(linear(o.reshape(num_tokens, s.q_heads * s.head_dim), weight.o_proj, None))
        return out if weight.o_bias is None else out + weight.o_bias

    def _ffn(self, x: torch.Tensor, weight: TransformerLayerWeight, comm: TpComm) -> torch.Tensor:
        return ffn_forward(x, weight.gate_up_proj, weight.down_proj, comm, self.ops.linear)
