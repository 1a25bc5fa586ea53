"""Weights outside the decoder layers: token embedding, final norm, lm_head."""
from dataclasses import dataclass
from typing import Dict

import torch

from lightllm.common.basemodel.layer_weights.hf_load_utils import take_weight

EMBED_NAME = "model.embed_tokens.weight"
FINAL_NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"


@dataclass
class PreAndPostLayerWeight:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed_tokens when tied

    @classmethod
    def from_state_dict(cls, state: Dict[str, torch.Tensor], tie_word_embeddings: bool) -> "PreAndPostLayerWeight":
        embed_tokens = take_weight(state, EMBED_NAME)
        lm_head = state.pop(LM_HEAD_NAME, None)
        if tie_word_embeddings or lm_head is None:
            lm_head = embed_tokens
        return cls(embed_tokens=embed_tokens, final_norm=take_weight(state, FINAL_NORM_NAME), lm_head=lm_head)
