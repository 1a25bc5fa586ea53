"""A draft dir: config.json (a dataclass whose ``model_type`` field default names its kind) and
the weights file."""
import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, Sequence

from lightllm.common.basemodel.basemodel import TransformerArch

DRAFT_SAFETENSORS = "model.safetensors"  # every draft kind's weights file


class DraftConfigFile:
    """Mixin for draft config dataclasses: ``load`` checks ``model_type`` and ignores unknown keys."""

    @classmethod
    def load(cls, draft_dir: str):
        with open(os.path.join(draft_dir, "config.json")) as f:
            raw = json.load(f)
        want = cls.__dataclass_fields__["model_type"].default
        if raw.get("model_type") != want:
            raise ValueError(f"{draft_dir}: model_type must be {want!r}, got {raw.get('model_type')!r}")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def save(self, draft_dir: str) -> None:
        os.makedirs(draft_dir, exist_ok=True)
        with open(os.path.join(draft_dir, "config.json"), "w") as f:
            json.dump(asdict(self), f, indent=2)


@dataclass
class DraftLayerShape(DraftConfigFile):
    """The decoder-layer shape every draft config starts with (the target's, checked at load)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int


def layer_shape_of(target_config) -> Dict[str, object]:
    """The ``DraftLayerShape`` fields of a draft for this target (its Hugging Face config)."""
    arch = TransformerArch.from_hf_config(target_config)
    return dict(hidden_size=arch.hidden_size, intermediate_size=target_config.intermediate_size,
                num_attention_heads=arch.q_heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                rms_norm_eps=arch.rms_norm_eps, vocab_size=arch.vocab_size)


def check_target_layers(draft_dir: str, target_layer_ids: Sequence[int], num_target_layers: int) -> None:
    """A draft's ``target_layer_ids`` must all be layers of the target (ValueError naming the others)."""
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"{draft_dir}: target_layer_ids {bad} are not layers of the target")
