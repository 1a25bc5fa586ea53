"""Weights outside the decoder layers: token embedding, final norm, lm_head."""
from dataclasses import dataclass, replace
from typing import Dict

import torch

from lightllm.common.basemodel.layer_weights.hf_load_utils import take_weight

EMBED_NAME = "model.embed_tokens.weight"
FINAL_NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"


@dataclass
class PreAndPostLayerWeight:
    embed_tokens: torch.Tensor  # [vocab_part, hidden] (whole vocab on one rank)
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab_part, hidden]; the same tensor as embed_tokens when tied
    # Vocabulary split (attention TP): this rank holds token ids [vocab_start, vocab_start + vocab_len);
    # embed_tokens / lm_head are zero-padded to vocab_part rows so every rank's part has equal size.
    vocab_start: int = 0
    vocab_len: int = -1  # -1: the whole vocabulary, unsplit

    @classmethod
    def from_state_dict(cls, state: Dict[str, torch.Tensor], tie_word_embeddings: bool) -> "PreAndPostLayerWeight":
        embed_tokens = take_weight(state, EMBED_NAME)
        lm_head = state.pop(LM_HEAD_NAME, None)
        if tie_word_embeddings or lm_head is None:
            lm_head = embed_tokens
        return cls(embed_tokens=embed_tokens, final_norm=take_weight(state, FINAL_NORM_NAME), lm_head=lm_head)

    def vocab_shard(self, parts: int, index: int) -> "PreAndPostLayerWeight":
        """Rows [index * P, (index + 1) * P) of embed_tokens / lm_head, P = ceil(vocab / parts),
        the last part zero-padded (its logits past the vocabulary are dropped after the gather)."""
        if parts == 1:
            return self
        vocab = self.embed_tokens.shape[0]
        part = -(-vocab // parts)
        start = index * part
        length = max(0, min(vocab, start + part) - start)

        def rows(w: torch.Tensor) -> torch.Tensor:
            out = w.new_zeros((part, w.shape[1]))
            out[:length] = w[start:start + length]
            return out

        embed = rows(self.embed_tokens)
        lm_head = embed if self.lm_head is self.embed_tokens else rows(self.lm_head)
        return replace(self, embed_tokens=embed, lm_head=lm_head, vocab_start=start, vocab_len=length)
