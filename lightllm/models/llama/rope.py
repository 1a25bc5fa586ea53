"""Rotary position embedding parameters from a Hugging Face config.

Newer transformers keep theta and scaling in ``config.rope_parameters``; older
ones use ``config.rope_theta`` plus ``config.rope_scaling``. Both are read.
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_ROPE_TYPE = "default"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RotaryEmbedding:
    inv_freq: torch.Tensor  # [head_dim // 2] fp32
    attention_scaling: float

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions: [tokens] -> cos, sin: [tokens, head_dim] in ``dtype`` (halves duplicated)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def read_rope_parameters(config: Any) -> Dict[str, Any]:
    """A dict with at least ``rope_theta`` and ``rope_type``, whatever the transformers version."""
    params = getattr(config, "rope_parameters", None)
    out = dict(params) if isinstance(params, dict) else dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", DEFAULT_ROPE_TYPE)
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by ``factor``, a smooth blend in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_rotary_embedding(config: Any, head_dim: int, device: torch.device) -> RotaryEmbedding:
    params = read_rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        valid = ", ".join(SUPPORTED_ROPE_TYPES)
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; valid names: {valid}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return RotaryEmbedding(inv_freq=inv_freq.to(device), attention_scaling=1.0)
