"""config.json of a draft dir: a dataclass whose ``model_type`` field default names its kind."""
import json
import os
from dataclasses import asdict, dataclass


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
