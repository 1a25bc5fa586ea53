"""The longest request a server takes: --max_req_total_len, capped by the model's positions. One place for
the HTTP side (its limit and /v1/models' max_model_len) and the worker (its KV pool and request tables)."""
import json
import os
from typing import Optional


def read_max_position_embeddings(model_dir: str) -> Optional[int]:
    """The model's ``max_position_embeddings`` from its config.json (None when it has none)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        v = json.load(f).get("max_position_embeddings")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def max_model_len(max_req_total_len: int, model_dir: Optional[str]) -> int:
    """Prompt + new tokens of one request at most: the flag, or the model's positions when they end sooner."""
    positions = None if model_dir is None else read_max_position_embeddings(model_dir)
    return max_req_total_len if positions is None else min(max_req_total_len, positions)
