"""Random weights for a config (``--load_format dummy``): benchmark a model's shape without its checkpoint.

Matrices are N(0, DUMMY_INIT_STD) (the usual initializer range of Llama configs), norms are
ones, biases absent. A fixed seed makes two loads of the same config identical.
"""
from typing import List, Tuple

import torch

from lightllm.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight

DUMMY_INIT_STD = 0.02
DUMMY_SEED = 0


def dummy_weights(
    arch, intermediate_size: int, with_qk_norm: bool, dtype: torch.dtype, device: torch.device
) -> Tuple[PreAndPostLayerWeight, List[TransformerLayerWeight]]:
    """``arch``: a TransformerArch. Returns whole (unsharded) weights on ``device``."""
    gen = torch.Generator(device=device).manual_seed(DUMMY_SEED)

    def mat(rows: int, cols: int) -> torch.Tensor:
        w = torch.empty((rows, cols), dtype=dtype, device=device)
        return w.normal_(0.0, DUMMY_INIT_STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    h, hd = arch.hidden_size, arch.head_dim
    embed = mat(arch.vocab_size, h)
    pre_post = PreAndPostLayerWeight(
        embed_tokens=embed, final_norm=ones(h), lm_head=embed if arch.tie_word_embeddings else mat(arch.vocab_size, h)
    )
    layers = [
        TransformerLayerWeight(
            input_norm=ones(h),
            qkv_proj=mat((arch.q_heads + 2 * arch.kv_heads) * hd, h),
            qkv_bias=None,
            o_proj=mat(h, arch.q_heads * hd),
            o_bias=None,
            post_attention_norm=ones(h),
            gate_up_proj=mat(2 * intermediate_size, h),
            down_proj=mat(h, intermediate_size),
            q_norm=ones(hd) if with_qk_norm else None,
            k_norm=ones(hd) if with_qk_norm else None,
        )
        for _ in range(arch.num_layers)
    ]
    return pre_post, layers
