"""DSpark block draft for Llama/Qwen3 targets: the engine's inference path.

The math is the contract in docs/dspark.md ("Checkpoint and math"); ``train_module.py``
implements it independently in readable PyTorch and the tests compare the two.

KV cache: one buffer per draft layer, indexed by the target's KV slots (context K/V of
position s at slot(s)), plus scratch rows past the target's slots for the block's own K/V.
The block's rows attend through the target's slot table: before a block pass the
positions ``p .. p + block_size - 1`` of each request point at its scratch rows, so the
paged decode attention (Triton or torch) sees context ``0 .. p-1`` and the whole block
(``b_seq_len = p + block_size`` for every block row: not causal). Those table entries lie
past the request's committed length and the next step's rows overwrite them before the
target reads them; the request table is ``block_size`` wider for this.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.basemodel import to_device
from lightllm.common.basemodel.batch_objs import ModelInput
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm, rotary_and_cache_kv
from lightllm.common.basemodel.layer_weights.hf_load_utils import load_hf_state_dict, take_weight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import TransformerLayerWeight
from lightllm.common.kv_cache_mem_manager import NUM_HOLD_SLOTS, MemoryManager
from lightllm.models.draft_config import check_target_layers
from lightllm.models.dspark.config import DSparkConfig
from lightllm.models.llama.layer_infer.transformer_layer_infer import AttentionShape

MARKOV_TABLE_CHUNK = 8192  # vocabulary ids embedded at a time while the Markov table is built


@dataclass
class DSparkWeight:
    fc: torch.Tensor  # [hidden, len(target_layer_ids) * hidden]
    hidden_norm: torch.Tensor  # [hidden]
    layers: List[TransformerLayerWeight]
    markov_down: Optional[torch.Tensor]  # [markov_rank, hidden]; None when markov_rank == 0
    markov_up: Optional[torch.Tensor]  # [hidden, markov_rank]
    confidence_weight: torch.Tensor  # [1, hidden]
    confidence_bias: torch.Tensor  # [1]


def load_dspark_weight(draft_dir: str, cfg: DSparkConfig, dtype, device) -> DSparkWeight:
    state = load_hf_state_dict(draft_dir, dtype, device)
    layers = [TransformerLayerWeight.from_state_dict(state, i, cfg.qk_norm) for i in range(cfg.num_hidden_layers)]
    markov = cfg.markov_rank > 0
    weight = DSparkWeight(
        fc=take_weight(state, "model.fc.weight"),
        hidden_norm=take_weight(state, "model.hidden_norm.weight"),
        layers=layers,
        markov_down=take_weight(state, "model.markov_down.weight") if markov else None,
        markov_up=take_weight(state, "model.markov_up.weight") if markov else None,
        confidence_weight=take_weight(state, "model.confidence.weight"),
        confidence_bias=take_weight(state, "model.confidence.bias"),
    )
    return to_device(weight, device)


class DSparkDraftModel:
    """Context fill and block proposals over a target model (one rank)."""

    def __init__(self, draft_dir: str, mtp_step: int, target, max_block_reqs: int):
        cfg = DSparkConfig.load(draft_dir)
        if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ValueError(f"{draft_dir}: hidden/vocab size does not match the target model")
        if not 1 <= mtp_step <= cfg.max_mtp_step:
            raise ValueError(f"--mtp_step {mtp_step} must be in 1..{cfg.max_mtp_step} (block_size - 1) for {draft_dir}")
        check_target_layers(draft_dir, cfg.target_layer_ids, target.arch.num_layers)
        if target.parallel.world_size != 1:
            raise ValueError("--mtp_mode dspark runs on one rank (--tp 1, --dp 1)")
        self.cfg = cfg
        self.target = target
        self.mtp_step = mtp_step
        self.block_size = cfg.block_size
        dtype, device = target.dtype, target.device
        self.weight = load_dspark_weight(draft_dir, cfg, dtype, device)
        self.eps = cfg.rms_norm_eps
        self.shape = AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)
        # target slots (HOLD included), then one scratch row per block position of every block
        self.scratch_base = target.mem_manager.size + NUM_HOLD_SLOTS
        self.max_block_reqs = max_block_reqs
        self.mem_manager = MemoryManager(self.scratch_base + max_block_reqs * cfg.block_size, dtype,
                                         cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, device)
        self.layers_infer = [target.layer_infer_class(i, self.shape, target.ops) for i in range(cfg.num_hidden_layers)]
        target.aux_layer_ids = tuple(cfg.target_layer_ids)
        self._scratch = torch.arange(max_block_reqs * cfg.block_size, dtype=torch.int64, device=device) + self.scratch_base
        self._block_offsets = torch.arange(cfg.block_size, dtype=torch.int64, device=device)
        self._mask_ids = torch.full((max_block_reqs, cfg.block_size - 1), cfg.mask_token_id, dtype=torch.int64,
                                    device=device)
        self._derive_weights()

    def _derive_weights(self) -> None:
        """Tensors derived once from the weights so that a step launches fewer kernels: every layer's
        context k/v projection as one matrix, the Markov term's first product per vocabulary id, the
        confidence head in fp32."""
        w, s, t = self.weight, self.shape, self.target
        q_dim = s.q_heads * s.head_dim
        self._ctx_kv_proj = torch.cat([lw.qkv_proj[q_dim:] for lw in w.layers])  # [layers * 2 * kv_dim, hidden]
        biases = [lw.qkv_bias for lw in w.layers]
        self._ctx_kv_bias = None
        if any(b is not None for b in biases):
            self._ctx_kv_bias = torch.cat([b[q_dim:] if b is not None else
                                           torch.zeros_like(lw.qkv_proj[q_dim:, 0]) for b, lw in zip(biases, w.layers)])
        self._markov_table = None  # [vocab, markov_rank]: markov_down(embed(id)) for every id
        if w.markov_down is not None:
            ids = torch.arange(t.vocab_size, dtype=torch.int64, device=t.device)
            self._markov_table = torch.cat([t.ops.linear(t.embed(chunk), w.markov_down, None)
                                            for chunk in ids.split(MARKOV_TABLE_CHUNK)])
        self._conf_weight = w.confidence_weight.float()
        self._conf_bias = w.confidence_bias.float()

    # ---- context ----
    @torch.no_grad()
    def fill_context(self, model_input: ModelInput, aux_hidden: torch.Tensor) -> None:
        """Write the context K/V of every new token of a target forward (prefill chunk or
        decode rows) at its slot. aux_hidden: [num_new_tokens, len(target_layer_ids) * hidden]."""
        t = self.target
        state = InferStateInfo.from_model_input(model_input, self.mem_manager, t.req_manager, t.device)
        t._fill_position_embeddings(state)
        w, s = self.weight, self.shape
        c = rms_norm(t.ops.linear(aux_hidden, w.fc, None), w.hidden_norm, self.eps)  # [tokens, hidden]
        kv_dim = s.kv_heads * s.head_dim
        kv = t.ops.linear(c, self._ctx_kv_proj, self._ctx_kv_bias)  # [tokens, layers * 2 * kv_dim]
        for i, (layer_infer, lw) in enumerate(zip(self.layers_infer, w.layers)):
            k, v = kv[:, 2 * i * kv_dim:2 * (i + 1) * kv_dim].split([kv_dim, kv_dim], dim=-1)
            k, v = k.reshape(-1, s.kv_heads, s.head_dim), v.reshape(-1, s.kv_heads, s.head_dim)
            _, k = layer_infer._qk_norm(k, k, lw)  # the k half of the layer's q/k norm (Qwen3)
            layer = layer_infer.layer_num
            rotary_and_cache_kv(None, k, v, state.position_cos, state.position_sin, self.mem_manager.k_buffer[layer],
                                self.mem_manager.v_buffer[layer], state.mem_indexes)

    # ---- block ----
    @torch.no_grad()
    def propose_block(
        self, b_req_idx: torch.Tensor, anchor_pos: torch.Tensor, anchors: torch.Tensor, max_len: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One block pass per request (no host sync, CUDA-graph safe).

        b_req_idx, anchor_pos, anchors: [m] (request row, position p of the anchor, anchor token);
        max_len: a host bound on p + block_size (the torch attention path's key grid).
        Returns proposals [m, K] int64 (positions p+1 .. p+K) and their confidences [m, K] fp32."""
        t, w, bs = self.target, self.weight, self.block_size
        m = anchors.shape[0]
        if m > self.max_block_reqs:
            raise ValueError(f"{m} blocks exceed the draft's {self.max_block_reqs} scratch blocks")
        rows = m * bs
        slots = self._scratch[:rows]
        pos = anchor_pos.long()[:, None] + self._block_offsets[None, :]  # [m, block]
        req_rows = b_req_idx.long().repeat_interleave(bs)  # [rows], contiguous (kernels index it flat)
        t.req_manager.req_to_token_indexs[req_rows, pos.reshape(-1)] = slots
        tokens = torch.cat([anchors.long()[:, None], self._mask_ids[:m]], dim=1).reshape(-1)  # [rows]
        seq_len = (anchor_pos.long() + bs).to(torch.int32).repeat_interleave(bs)  # every row sees the whole block
        mi = ModelInput(batch_size=rows, total_token_num=0, max_len_in_batch=max_len, input_ids=tokens,
                        mem_indexes=slots, b_req_idx=req_rows, b_seq_len=seq_len, is_prefill=False,
                        max_q_len=bs, max_q_runs=m + 1)
        state = InferStateInfo.from_model_input(mi, self.mem_manager, t.req_manager, t.device)
        state.positions = pos.reshape(-1)  # each block row at its own position, all seeing the whole block
        t._fill_position_embeddings(state)
        h, _ = t.run_layers(self.layers_infer, w.layers, t.embed(tokens), state)
        f = h.view(m, bs, -1)
        prev, toks, normed = anchors.long(), [], []
        for i in range(1, self.mtp_step + 1):  # sequential: the Markov term reads the previous proposal
            g = f[:, i]
            if self._markov_table is not None:
                g = g + t.ops.linear(F.embedding(prev, self._markov_table), w.markov_up, None)
            normed.append(rms_norm(g, t.pre_post_weight.final_norm, t.arch.rms_norm_eps))
            prev = t.greedy_ids(normed[-1], normed=True)
            toks.append(prev)
        # the confidence head of every depth at once, in fp32
        conf = torch.sigmoid(F.linear(torch.stack(normed, dim=1).float(), self._conf_weight, self._conf_bias))
        return torch.stack(toks, dim=1), conf[..., 0]
