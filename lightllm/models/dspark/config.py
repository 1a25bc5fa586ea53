"""config.json of a DSpark block draft (Hugging Face-style, our own ``model_type``).

The math both the engine (``model.py``) and the training module (``train_module.py``)
implement is written out in docs/dspark.md ("Checkpoint and math")."""
from dataclasses import dataclass, field
from typing import List

from lightllm.models.draft_config import DraftLayerShape

DSPARK_MODEL_TYPE = "dspark"


@dataclass
class DSparkConfig(DraftLayerShape):
    num_hidden_layers: int  # draft decoder layers
    block_size: int  # anchor + (block_size - 1) mask positions; --mtp_step <= block_size - 1
    mask_token_id: int  # input token of the mask positions
    markov_rank: int  # rank of the Markov head (0: no Markov head)
    target_layer_ids: List[int] = field(default_factory=list)  # target layers whose outputs form the context
    qk_norm: bool = False  # Qwen3 targets
    model_type: str = DSPARK_MODEL_TYPE

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.num_hidden_layers < 1 or self.markov_rank < 0:
            raise ValueError("num_hidden_layers must be >= 1 and markov_rank >= 0")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")

    @property
    def max_mtp_step(self) -> int:
        return self.block_size - 1
