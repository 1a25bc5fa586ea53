"""Weights of one Llama-family decoder layer, with q/k/v and gate/up fused for fewer matmuls."""
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch

from lightllm.common.basemodel.layer_weights.hf_load_utils import take_weight


def split_sizes(n: int, parts: int) -> List[int]:
    """``n`` split into ``parts`` near-equal sizes, larger first (uneven intermediate / vocab)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def shard_range(n: int, parts: int, index: int):
    """[start, end) of part ``index`` of ``split_sizes(n, parts)``."""
    sizes = split_sizes(n, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


@dataclass(frozen=True)
class TpShard:
    """Which part of a layer one rank holds: heads of its attention group, rows of the MLP."""

    q_heads: int  # all heads of the layer
    kv_heads: int
    head_dim: int
    attn_size: int = 1  # ranks the heads are split over (the DP group)
    attn_rank: int = 0
    mlp_size: int = 1  # ranks the intermediate dim is split over (all ranks)
    mlp_rank: int = 0

    def check(self, what: str) -> None:
        for name, heads in (("num_attention_heads", self.q_heads), ("num_key_value_heads", self.kv_heads)):
            if heads % self.attn_size:
                raise ValueError(f"{what}: {name} ({heads}) must be divisible by the attention TP size "
                                 f"--tp / --dp ({self.attn_size})")


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

    def tp_shard(self, shard: TpShard) -> "TransformerLayerWeight":
        """This rank's part: its q/k/v heads and o_proj columns (attention group), its gate/up rows
        and down_proj columns (all ranks). Norms and o_bias stay whole (o_bias is added after the sum)."""
        if shard.attn_size == 1 and shard.mlp_size == 1:
            return self
        d = shard.head_dim
        qh, kvh = shard.q_heads // shard.attn_size, shard.kv_heads // shard.attn_size
        q0, k0 = shard.attn_rank * qh * d, shard.attn_rank * kvh * d
        q_all, kv_all = shard.q_heads * d, shard.kv_heads * d
        qkv_rows = torch.cat([
            torch.arange(q0, q0 + qh * d),
            q_all + torch.arange(k0, k0 + kvh * d),
            q_all + kv_all + torch.arange(k0, k0 + kvh * d),
        ])
        gate_up_proj, down_proj = shard_mlp(self.gate_up_proj, self.down_proj, shard)
        return replace(
            self,
            qkv_proj=self.qkv_proj[qkv_rows.to(self.qkv_proj.device)].contiguous(),
            qkv_bias=None if self.qkv_bias is None else self.qkv_bias[qkv_rows.to(self.qkv_bias.device)].contiguous(),
            o_proj=self.o_proj[:, q0:q0 + qh * d].contiguous(),
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
        )


def shard_mlp(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, shard: TpShard):
    """This rank's rows of the fused gate/up [2 * inter, hidden] and columns of down [hidden, inter]."""
    if shard.mlp_size == 1:
        return gate_up_proj, down_proj
    inter = gate_up_proj.shape[0] // 2
    i0, i1 = shard_range(inter, shard.mlp_size, shard.mlp_rank)
    rows = torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)]).to(gate_up_proj.device)
    return gate_up_proj[rows].contiguous(), down_proj[:, i0:i1].contiguous()
