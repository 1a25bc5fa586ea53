"""Base of every served model: load a Hugging Face dir, own the KV cache, run a forward.

Subclasses pick the decoder layer (``_init_infer_layers``) and the position
embedding (``_init_position_embedding`` / ``_fill_position_embeddings``).
"""
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm
from lightllm.common.basemodel.layer_weights.hf_load_utils import load_hf_state_dict
from lightllm.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.req_manager import ReqManager

DATA_TYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_TYPES = ("cpu", "cuda")
SUPPORTED_HIDDEN_ACT = "silu"


@dataclass(frozen=True)
class ModelKvArgs:
    model_dir: str
    max_total_token_num: int  # KV cache slots
    max_req_num: int
    max_seq_length: int
    data_type: str = "float32"  # one of DATA_TYPES
    device: str = "cpu"  # "cpu" or "cuda" ("cuda:N" too)
    decode_attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU), "torch", "triton"

    def __post_init__(self):
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"unknown data_type {self.data_type!r}; valid names: {', '.join(DATA_TYPES)}")
        if torch.device(self.device).type not in DEVICE_TYPES:
            raise ValueError(f"unknown device {self.device!r}; valid types: {', '.join(DEVICE_TYPES)}")
        for name in ("max_total_token_num", "max_req_num", "max_seq_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class TransformerArch:
    """The config numbers a Llama-family forward needs."""

    num_layers: int
    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> "TransformerArch":
        hidden_act = getattr(config, "hidden_act", SUPPORTED_HIDDEN_ACT)
        if hidden_act != SUPPORTED_HIDDEN_ACT:
            raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (only {SUPPORTED_HIDDEN_ACT})")
        if getattr(config, "mlp_bias", False):
            raise NotImplementedError("mlp_bias is not supported")
        q_heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            q_heads=q_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or q_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // q_heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class TpPartBaseModel:
    """A loaded model with its KV cache (``mem_manager``) and request table (``req_manager``).

    Before ``forward`` the backend has allocated ``mem_indexes`` and written them into
    ``req_manager.req_to_token_indexs[req_idx, pos]`` for every new position. Padding rows
    use ``req_manager.HOLD_REQUEST_ID`` and ``mem_manager.HOLD_SLOT``.
    ``embed`` and ``compute_logits`` are shared with MTP draft modules.
    """

    # Qwen3-style per-head q/k RMSNorm weights in every layer.
    has_qk_norm = False

    def __init__(self, kvargs: ModelKvArgs):
        self.kvargs = kvargs
        self.device = torch.device(kvargs.device)
        self.dtype = DATA_TYPES[kvargs.data_type]
        self.config = AutoConfig.from_pretrained(kvargs.model_dir)
        self.arch = TransformerArch.from_hf_config(self.config)
        self._init_weights()
        self.mem_manager = MemoryManager(
            size=kvargs.max_total_token_num,
            dtype=self.dtype,
            head_num=self.arch.kv_heads,
            head_dim=self.arch.head_dim,
            layer_num=self.arch.num_layers,
            device=self.device,
        )
        self.req_manager = ReqManager(kvargs.max_req_num, kvargs.max_seq_length, self.mem_manager, self.device)
        self._init_infer_layers()
        self._init_position_embedding()

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    def _init_weights(self) -> None:
        state = load_hf_state_dict(self.kvargs.model_dir, self.dtype, self.device)
        self.pre_post_weight = PreAndPostLayerWeight.from_state_dict(state, self.arch.tie_word_embeddings)
        self.trans_layers_weight: List[TransformerLayerWeight] = [
            TransformerLayerWeight.from_state_dict(state, i, with_qk_norm=self.has_qk_norm)
            for i in range(self.arch.num_layers)
        ]

    def _init_infer_layers(self) -> None:
        """Sets ``self.layers_infer``: one decoder layer object per layer."""
        raise NotImplementedError

    def _init_position_embedding(self) -> None:
        raise NotImplementedError

    def _fill_position_embeddings(self, infer_state: InferStateInfo) -> None:
        """Sets the position tables of ``infer_state`` from ``infer_state.positions``."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, model_input: ModelInput) -> ModelOutput:
        infer_state = InferStateInfo.from_model_input(model_input, self.mem_manager, self.req_manager, self.device)
        self._fill_position_embeddings(infer_state)
        hidden = self.embed(infer_state.input_ids)  # [num_new_tokens, hidden]
        for layer_infer, layer_weight in zip(self.layers_infer, self.trans_layers_weight):
            hidden = layer_infer.forward(hidden, layer_weight, infer_state)
        logits = self.compute_logits(hidden[infer_state.last_token_index])  # [batch, vocab]
        return ModelOutput(logits=logits, hidden_states=hidden)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [tokens] -> [tokens, hidden] in the model dtype."""
        return F.embedding(input_ids.to(self.device), self.pre_post_weight.embed_tokens)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [n, hidden] before the final norm -> [n, vocab] fp32."""
        w = self.pre_post_weight
        normed = rms_norm(hidden_states, w.final_norm, self.arch.rms_norm_eps)
        return F.linear(normed, w.lm_head).float()
