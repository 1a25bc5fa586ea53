"""Base of every served model: load a Hugging Face dir, own the KV cache, run a forward.

Subclasses pick the decoder layer (``_init_infer_layers``) and the position
embedding (``_init_position_embedding`` / ``_fill_position_embeddings``).
"""
import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm
from lightllm.common.basemodel.layer_weights.dummy_weights import dummy_weights
from lightllm.common.basemodel.layer_weights.hf_load_utils import load_hf_state_dict
from lightllm.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TpShard, TransformerLayerWeight
from lightllm.common.constants import DATA_TYPES, LOAD_FORMATS
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.utils.dist_utils import ParallelContext, TpComm, single_rank_context

# --data_type name -> torch dtype
TORCH_DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, name) for name in DATA_TYPES}
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
    load_format: str = "auto"  # "auto": the dir's safetensors; "dummy": random weights for its config
    deterministic_inference: bool = False  # batch-invariant kernels (CUDA), see attention_backends.py

    def __post_init__(self):
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"unknown data_type {self.data_type!r}; valid names: {', '.join(DATA_TYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; valid names: {', '.join(LOAD_FORMATS)}")
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

    Tensor parallel (``parallel``, docs/parallel.md): this rank holds its heads, its KV heads,
    its vocabulary rows and its MLP rows; ``infer_state.comm`` does the collectives.
    """

    # Qwen3-style per-head q/k RMSNorm weights in every layer.
    has_qk_norm = False

    def __init__(self, kvargs: ModelKvArgs, parallel: Optional[ParallelContext] = None):
        self.kvargs = kvargs
        self.parallel = parallel if parallel is not None else single_rank_context(kvargs.device)
        self.device = torch.device(kvargs.device)
        self.dtype = TORCH_DTYPES[kvargs.data_type]
        self.config = AutoConfig.from_pretrained(kvargs.model_dir)
        self.arch = TransformerArch.from_hf_config(self.config)
        self.tp_shard = self.layer_shard(self.arch.q_heads, self.arch.kv_heads, self.arch.head_dim)
        self.tp_shard.check(kvargs.model_dir)
        self._init_weights()
        self._microbatch_streams: Optional[List[Any]] = None
        # Decoder layers whose outputs a draft reads (set once at start-up, before graph capture).
        self.aux_layer_ids: Tuple[int, ...] = ()
        self.mem_manager = MemoryManager(
            size=kvargs.max_total_token_num,
            dtype=self.dtype,
            head_num=self.arch.kv_heads // self.tp_shard.attn_size,
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

    def layer_shard(self, q_heads: int, kv_heads: int, head_dim: int) -> TpShard:
        """This rank's part of a decoder layer with these heads (target and draft layers alike)."""
        p = self.parallel
        return TpShard(q_heads, kv_heads, head_dim, p.attn_tp_size, p.attn_tp_rank, p.world_size, p.rank)

    def _init_weights(self) -> None:
        # Split weights are read on the host and only this rank's part goes to the device.
        split = self.parallel.world_size > 1
        host_or_device = torch.device("cpu") if split else self.device
        if self.kvargs.load_format == "dummy":
            pre_post, layers = dummy_weights(
                self.arch, self.config.intermediate_size, self.has_qk_norm, self.dtype, host_or_device
            )
        else:
            state = load_hf_state_dict(self.kvargs.model_dir, self.dtype, host_or_device)
            pre_post = PreAndPostLayerWeight.from_state_dict(state, self.arch.tie_word_embeddings)
            layers = [
                TransformerLayerWeight.from_state_dict(state, i, with_qk_norm=self.has_qk_norm)
                for i in range(self.arch.num_layers)
            ]
        self.pre_post_weight = to_device(
            pre_post.vocab_shard(self.parallel.attn_tp_size, self.parallel.attn_tp_rank), self.device
        )
        self.trans_layers_weight: List[TransformerLayerWeight] = [
            to_device(layer.tp_shard(self.tp_shard), self.device) for layer in layers
        ]

    def _init_infer_layers(self) -> None:
        """Sets ``self.layers_infer`` (one decoder layer object per layer) and ``self.ops``
        (the kernels they and ``compute_logits`` use)."""
        raise NotImplementedError

    def _init_position_embedding(self) -> None:
        raise NotImplementedError

    def _fill_position_embeddings(self, infer_state: InferStateInfo) -> None:
        """Sets the position tables of ``infer_state`` from ``infer_state.positions``."""
        raise NotImplementedError

    def _infer_state(self, model_input: ModelInput, comm: TpComm) -> InferStateInfo:
        infer_state = InferStateInfo.from_model_input(
            model_input, self.mem_manager, self.req_manager, self.device, comm
        )
        self._fill_position_embeddings(infer_state)
        return infer_state

    @torch.no_grad()
    def forward(self, model_input: ModelInput) -> ModelOutput:
        infer_state = self._infer_state(model_input, self.parallel.comm(0))
        hidden = self.embed(infer_state.input_ids, infer_state.comm)  # [num_new_tokens, hidden]
        hidden, aux = self.run_layers(self.layers_infer, self.trans_layers_weight, hidden, infer_state,
                                      self.aux_layer_ids)
        logits = self.compute_logits(hidden[infer_state.last_token_index], infer_state.comm)  # [batch, vocab]
        return ModelOutput(logits=logits, hidden_states=hidden, aux_hidden_states=self._cat_aux(aux))

    @staticmethod
    def run_layers(layers_infer: Sequence, weights: Sequence, hidden: torch.Tensor, infer_state: InferStateInfo,
                   aux_layer_ids: Sequence[int] = ()) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Decoder layers in order over ``hidden``, each layer's last residual add done in the next layer's input
        norm (``forward_deferred``). Returns the last layer's output and, in layer order, those of the layers in
        ``aux_layer_ids`` (their add is done where they end)."""
        aux, delta = [], None
        for i, (layer_infer, layer_weight) in enumerate(zip(layers_infer, weights)):
            hidden, delta = TpPartBaseModel._layer_step(layer_infer, layer_weight, hidden, delta, infer_state,
                                                        aux if i in aux_layer_ids else None)
        return _settled(hidden, delta), aux

    @staticmethod
    def _layer_step(layer_infer, layer_weight, hidden: torch.Tensor, delta: Optional[torch.Tensor],
                    infer_state: InferStateInfo, aux: Optional[List[torch.Tensor]]):
        """One layer of ``run_layers``: (hidden, delta) after it; ``aux`` (a list: the layer's output is asked for)
        gets the settled output, and the add is then done here."""
        hidden, delta = layer_infer.forward_deferred(hidden, delta, layer_weight, infer_state)
        if aux is None:
            return hidden, delta
        aux.append(hidden + delta)
        return aux[-1], None

    def _cat_aux(self, aux: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """The asked layers' outputs side by side, in ``aux_layer_ids`` order (None if none asked)."""
        if not self.aux_layer_ids:
            return None
        by_layer = dict(zip(sorted(self.aux_layer_ids), aux))
        return torch.cat([by_layer[i] for i in self.aux_layer_ids], dim=-1)

    @torch.no_grad()
    def forward_microbatches(self, inputs: Sequence[ModelInput]) -> List[ModelOutput]:
        """Decode micro-batches layer by layer, micro-batch ``i`` over ``parallel.comm(i)``.

        On CUDA each micro-batch runs on its own stream: while one waits for its collective
        the other computes. On CPU they run in order. Every rank issues the collectives in
        the same order (micro-batch 0, then 1, per layer)."""
        streams = self._streams_for(len(inputs))
        states, hidden = [], []
        for i, model_input in enumerate(inputs):
            with _on_stream(streams[i]):
                states.append(self._infer_state(model_input, self.parallel.comm(i)))
                hidden.append(self.embed(states[i].input_ids, states[i].comm))
        aux = [[] for _ in inputs]
        delta = [None for _ in inputs]
        for layer, (layer_infer, layer_weight) in enumerate(zip(self.layers_infer, self.trans_layers_weight)):
            for i, infer_state in enumerate(states):
                with _on_stream(streams[i]):
                    hidden[i], delta[i] = self._layer_step(layer_infer, layer_weight, hidden[i], delta[i], infer_state,
                                                           aux[i] if layer in self.aux_layer_ids else None)
        outs = []
        for i, infer_state in enumerate(states):
            with _on_stream(streams[i]):
                hidden[i] = _settled(hidden[i], delta[i])
                logits = self.compute_logits(hidden[i][infer_state.last_token_index], infer_state.comm)
                outs.append(ModelOutput(logits=logits, hidden_states=hidden[i], aux_hidden_states=self._cat_aux(aux[i])))
        if streams[0] is not None:
            main = torch.cuda.current_stream(self.device)
            for s in streams:
                main.wait_stream(s)
            for out in outs:  # made on a side stream, used on the main one: keep their memory until then
                out.logits.record_stream(main)
                out.hidden_states.record_stream(main)
                if out.aux_hidden_states is not None:
                    out.aux_hidden_states.record_stream(main)
        return outs

    def _streams_for(self, n: int) -> List[Any]:
        """One CUDA stream per micro-batch, each first waiting for the main stream; Nones on CPU."""
        if self.device.type != "cuda":
            return [None] * n
        if self._microbatch_streams is None or len(self._microbatch_streams) < n:
            self._microbatch_streams = [torch.cuda.Stream(self.device) for _ in range(n)]
        streams = self._microbatch_streams[:n]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(self.device))
        return streams

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, comm: Optional[TpComm] = None) -> torch.Tensor:
        """input_ids: [tokens] -> [tokens, hidden] in the model dtype.

        Vocabulary split: each rank looks up the ids it holds, zeros elsewhere, and the DP
        group sums (exactly one rank contributes each row, so the sum is exact)."""
        w = self.pre_post_weight
        ids = input_ids.to(self.device)
        if w.vocab_len < 0:
            return F.embedding(ids, w.embed_tokens)
        local = ids - w.vocab_start
        inside = (local >= 0) & (local < w.vocab_len)  # [tokens]
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), w.embed_tokens)
        out = out.masked_fill(~inside[:, None], 0)
        return (comm or self.parallel.comm(0)).attn_all_reduce(out)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor, comm: Optional[TpComm] = None) -> torch.Tensor:
        """hidden_states: [n, hidden] before the final norm -> [n, vocab] fp32 (gathered over the
        vocabulary split, identical on every rank of the DP group)."""
        return self._vocab_logits(hidden_states, comm).contiguous().float()

    def greedy_ids(self, hidden_states: torch.Tensor, comm: Optional[TpComm] = None,
                   normed: bool = False) -> torch.Tensor:
        """[n] int64: the argmax of ``compute_logits`` without its fp32 copy (the upcast is exact and keeps
        the order, so the ids are the same; a draft's greedy guess reads half the bytes). ``normed``: the
        hidden states are past the final norm already."""
        return torch.argmax(self._vocab_logits(hidden_states, comm, normed), dim=-1)

    def _vocab_logits(self, hidden_states: torch.Tensor, comm: Optional[TpComm], normed: bool = False) -> torch.Tensor:
        """[n, vocab] in the model's dtype (a view past the gather of a vocabulary split)."""
        w = self.pre_post_weight
        if not normed:
            hidden_states = rms_norm(hidden_states, w.final_norm, self.arch.rms_norm_eps)
        logits = self.ops.linear(hidden_states, w.lm_head, None)  # [n, vocab_part]
        if w.vocab_len >= 0:
            logits = (comm or self.parallel.comm(0)).attn_all_gather_cols(logits)[:, :self.vocab_size]
        return logits


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _settled(hidden: torch.Tensor, delta: Optional[torch.Tensor]) -> torch.Tensor:
    """A deferred layer output (``forward_deferred``) with its last residual add done."""
    return hidden if delta is None else hidden + delta


def to_device(weight, device: torch.device):
    """A weight dataclass with every tensor field on ``device`` (a tensor shared by two fields,
    like tied embeddings, stays shared)."""
    moved: Dict[int, torch.Tensor] = {}
    changes = {}
    for f in dataclasses.fields(weight):
        v = getattr(weight, f.name)
        if isinstance(v, torch.Tensor):
            if id(v) not in moved:
                moved[id(v)] = v.to(device)
            changes[f.name] = moved[id(v)]
    return dataclasses.replace(weight, **changes)
