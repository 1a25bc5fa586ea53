"""Tiny random Llama / Qwen3 targets and MTP drafts: the one fixture module for tests that
need a model on disk.

``tiny_model(kind, root, seed)`` writes a random transformers model (the reference) to
``root/target`` and returns a ``TinyModel``; ``TinyModel.draft(name, ...)`` writes a random
MTP draft for it to ``root/name``. ``random_prompts`` draws token-id prompts for them.
"""
import os
import random
from dataclasses import dataclass
from typing import List, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightllm.models.llama_mtp.train_module import random_draft

WEIGHT_STD = 0.15  # large enough that logits spread over several units
NORM_WEIGHT_STD = 0.2  # norm weights are 1 + noise
SHARD_SIZE = "40KB"  # forces a sharded checkpoint with an index file
MAX_POSITIONS = 256

MODEL_KINDS = ("llama", "qwen3")  # the parity tests run over these
TP_MODEL_KINDS = ("qwen3_kv2",)  # extra kinds for tensor parallel tests


def _llama_config() -> LlamaConfig:
    # GQA 4/2, tied embeddings, llama3 rope scaling with a short original context
    # so that low, medium and high frequencies all occur.
    return LlamaConfig(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _qwen3_config() -> Qwen3Config:
    # GQA 4/1, head_dim * heads != hidden, untied lm_head.
    return Qwen3Config(
        vocab_size=293,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _qwen3_kv2_config() -> Qwen3Config:
    # Qwen3 for tensor parallel tests: kv heads divisible by 2, an odd vocabulary (uneven
    # vocab split), an intermediate size that splits unevenly.
    config = _qwen3_config()
    config.num_key_value_heads = 2
    config.vocab_size = 307
    config.intermediate_size = 91
    return config


def build_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 transformers model of ``kind`` (MODEL_KINDS or TP_MODEL_KINDS), in eval mode."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(_llama_config())
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(_qwen3_config())
    elif kind == "qwen3_kv2":
        model = Qwen3ForCausalLM(_qwen3_kv2_config())
    else:
        raise ValueError(f"unknown kind {kind!r}; valid names: {', '.join(MODEL_KINDS + TP_MODEL_KINDS)}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + NORM_WEIGHT_STD * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)
    return model.eval()


def save_checkpoint(model: torch.nn.Module, model_dir: str, sharded: bool) -> str:
    os.makedirs(model_dir, exist_ok=True)
    if sharded:
        model.save_pretrained(model_dir, safe_serialization=True, max_shard_size=SHARD_SIZE)
    else:
        model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


@dataclass(frozen=True)
class TinyModel:
    """A random fp32 transformers model and its checkpoint; its drafts are written beside it."""

    hf: torch.nn.Module  # the reference: transformers' own forward and generate
    model_dir: str  # root/target
    root: str

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def draft(self, name: str, with_attention: bool = True, num_modules: int = 1, seed: int = 0,
              std: float = WEIGHT_STD, target_layer_ids: Sequence[int] = ()) -> str:
        """A random MTP draft for this target, written to ``root/name``; returns its dir.
        A small ``std`` (0.02) gives a weak draft: mismatches, so ASD relaxations, are common.
        ``target_layer_ids``: depth 0 reads fc of those target layers (feature fusion)."""
        return random_draft(self.hf.config, os.path.join(self.root, name), with_attention, num_modules,
                            seed=seed, std=std, target_layer_ids=target_layer_ids)


def tiny_model(kind: str, root, seed: int = 0, sharded: bool = False) -> TinyModel:
    """build_hf_model(kind, seed) saved to ``root/target`` (``root``: a str or a pathlib path)."""
    hf = build_hf_model(kind, seed=seed)
    root = str(root)
    return TinyModel(hf, save_checkpoint(hf, os.path.join(root, "target"), sharded), root)


def random_prompts(vocab_size: int, n: int, lengths: range, seed: int = 0) -> List[List[int]]:
    """``n`` prompts of uniform random token ids, each of a length drawn from ``lengths``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(lengths.start, lengths.stop))] for _ in range(n)]
