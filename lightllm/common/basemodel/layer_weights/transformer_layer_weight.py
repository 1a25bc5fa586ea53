"""Weights of one Llama-family decoder layer, with q/k/v and gate/up fused for fewer matmuls."""
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from lightllm.common.basemodel.layer_weights.hf_load_utils import take_weight


def _take_optional_bias(state: Dict[str, torch.Tensor], prefix: str, names) -> Optional[torch.Tensor]:
    keys = [f"{prefix}{name}.bias" for name in names]
    present = [key in state for key in keys]
    if not any(present):
        return None
    if not all(present):
        raise KeyError(f"checkpoint has only some of the biases {keys}")
    return torch.cat([state.pop(key) for key in keys], dim=0)


@dataclass
class TransformerLayerWeight:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(q_heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: Optional[torch.Tensor]  # [(q_heads + 2 * kv_heads) * head_dim]
    o_proj: torch.Tensor  # [hidden, q_heads * head_dim]
    o_bias: Optional[torch.Tensor]  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]
    q_norm: Optional[torch.Tensor] = None  # [head_dim], Qwen3 only
    k_norm: Optional[torch.Tensor] = None  # [head_dim], Qwen3 only

    @classmethod
    def from_state_dict(
        cls, state: Dict[str, torch.Tensor], layer_idx: int, with_qk_norm: bool
    ) -> "TransformerLayerWeight":
        """Pops the layer's tensors from ``state`` (Hugging Face names)."""
        prefix = f"model.layers.{layer_idx}."
        attn = prefix + "self_attn."
        mlp = prefix + "mlp."
        qkv_names = ("q_proj", "k_proj", "v_proj")
        qkv_bias = _take_optional_bias(state, attn, qkv_names)
        qkv_proj = torch.cat([take_weight(state, f"{attn}{name}.weight") for name in qkv_names], dim=0)
        gate_up_proj = torch.cat(
            [take_weight(state, f"{mlp}gate_proj.weight"), take_weight(state, f"{mlp}up_proj.weight")], dim=0
        )
        return cls(
            input_norm=take_weight(state, prefix + "input_layernorm.weight"),
            qkv_proj=qkv_proj,
            qkv_bias=qkv_bias,
            o_proj=take_weight(state, attn + "o_proj.weight"),
            o_bias=state.pop(attn + "o_proj.bias", None),
            post_attention_norm=take_weight(state, prefix + "post_attention_layernorm.weight"),
            gate_up_proj=gate_up_proj,
            down_proj=take_weight(state, mlp + "down_proj.weight"),
            q_norm=take_weight(state, attn + "q_norm.weight") if with_qk_norm else None,
            k_norm=take_weight(state, attn + "k_norm.weight") if with_qk_norm else None,
        )
