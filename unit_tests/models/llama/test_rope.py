from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lightllm.models.llama.rope import build_rotary_embedding, read_rope_parameters

HEAD_DIM = 16
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def test_old_and_new_config_styles_agree():
    """Older transformers: rope_theta + rope_scaling ("type" key); newer: rope_parameters."""
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    new = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3_SCALING})
    assert read_rope_parameters(old) == read_rope_parameters(new)
    plain = SimpleNamespace(rope_theta=1e4, rope_scaling=None)
    assert read_rope_parameters(plain) == {"rope_theta": 1e4, "rope_type": "default"}


def test_llama3_inv_freq_matches_transformers():
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING},
    )
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    rotary = build_rotary_embedding(config, HEAD_DIM, torch.device("cpu"))
    torch.testing.assert_close(rotary.inv_freq, expected, atol=0, rtol=0)
    assert rotary.attention_scaling == scaling


def test_cos_sin_shapes_and_position_zero():
    rotary = build_rotary_embedding(SimpleNamespace(rope_theta=1e4), HEAD_DIM, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.tensor([0, 3, 7]), torch.float32)
    assert cos.shape == sin.shape == (3, HEAD_DIM)
    assert torch.equal(cos[0], torch.ones(HEAD_DIM)) and torch.equal(sin[0], torch.zeros(HEAD_DIM))


def test_unsupported_rope_type_lists_valid_names():
    config = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"})
    with pytest.raises(NotImplementedError, match="valid names: default, linear, llama3"):
        build_rotary_embedding(config, HEAD_DIM, torch.device("cpu"))
