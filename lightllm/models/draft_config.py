"""config.json of a draft dir: a dataclass whose ``model_type`` field default names its kind."""
import json
import os
from dataclasses import asdict


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
