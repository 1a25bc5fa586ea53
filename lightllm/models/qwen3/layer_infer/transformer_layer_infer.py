"""Qwen3 decoder layer: Llama's, plus an RMSNorm over each q and k head before rope."""
from typing import Tuple

import torch

from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight
from lightllm.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer


class Qwen3TransformerLayerInfer(LlamaTransformerLayerInfer):
    def _qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, weight: TransformerLayerWeight
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        eps = self.shape.rms_norm_eps
        return rms_norm(q, weight.q_norm, eps), rms_norm(k, weight.k_norm, eps)
