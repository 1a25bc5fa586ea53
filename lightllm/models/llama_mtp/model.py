"""DeepSeek-V3-style MTP draft modules for Llama/Qwen3 targets.

One module computes ``h' = layer(eh_proj([enorm(embed(x_next)); hnorm(h)]))``;
its logits come from the target's final norm and shared ``lm_head`` and it
shares the target's embedding. Depth 0's ``h`` is the target's last-layer output,
or, when the draft's config names ``target_layer_ids``, ``fc`` of those target
layers' outputs side by side (EAGLE-3's feature fusion; deeper depths take the
draft's own output either way). ``*_with_att`` modules have a full decoder layer
with its own KV cache; ``*_no_att`` modules have the MLP half only.

Depth d (1..K) of a draft chain runs module d (vanilla) or the one module
(eagle). Every depth has its own KV buffer, indexed by the target's KV slots:
depth d at the row of target position s writes slot(s) of buffer d.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from lightllm.common.basemodel.basemodel import TransformerArch, to_device
from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm
from lightllm.common.basemodel.layer_weights.hf_load_utils import load_hf_state_dict, take_weight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import (
    TpShard,
    TransformerLayerWeight,
    shard_mlp,
)
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.models.draft_config import DraftLayerShape, check_target_layers
from lightllm.models.llama.layer_infer.transformer_layer_infer import AttentionShape, ffn_forward

DRAFT_MODEL_TYPE = "llama_mtp"


@dataclass
class MTPDraftConfig(DraftLayerShape):
    """config.json of a draft dir (Hugging Face-style, our own model_type)."""

    with_attention: bool
    num_modules: int = 1
    qk_norm: bool = False
    # target layers whose outputs depth 0 reads through ``fc`` (empty: the last layer's output alone)
    target_layer_ids: List[int] = field(default_factory=list)
    model_type: str = DRAFT_MODEL_TYPE

    def __post_init__(self):
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids {self.target_layer_ids} name a layer twice")


@dataclass
class MTPModuleWeight:
    enorm: torch.Tensor  # [hidden]
    hnorm: torch.Tensor  # [hidden]
    eh_proj: torch.Tensor  # [hidden, 2 * hidden]
    layer: Optional[TransformerLayerWeight]  # with attention
    mlp_norm: Optional[torch.Tensor] = None  # [hidden], no attention
    gate_up_proj: Optional[torch.Tensor] = None  # [2 * intermediate, hidden], no attention
    down_proj: Optional[torch.Tensor] = None  # [hidden, intermediate], no attention


FC_WEIGHT = "model.fc.weight"  # [hidden, len(target_layer_ids) * hidden], with target_layer_ids only


def _load_modules(draft_dir: str, cfg: MTPDraftConfig, dtype, device,
                  shard: TpShard) -> Tuple[List[MTPModuleWeight], Optional[torch.Tensor]]:
    """(the modules, fc or None). Tensor parallel like the target (``shard``): the decoder layer / MLP
    split, eh_proj, fc and norms whole."""
    split = shard.attn_size > 1 or shard.mlp_size > 1
    state = load_hf_state_dict(draft_dir, dtype, torch.device("cpu") if split else device)
    fc = take_weight(state, FC_WEIGHT).to(device) if cfg.target_layer_ids else None
    modules = []
    for m in range(cfg.num_modules):
        p = f"model.layers.{m}."
        enorm, hnorm = take_weight(state, p + "enorm.weight"), take_weight(state, p + "hnorm.weight")
        eh = take_weight(state, p + "eh_proj.weight")
        if cfg.with_attention:
            layer = TransformerLayerWeight.from_state_dict(state, m, cfg.qk_norm).tp_shard(shard)
            module = MTPModuleWeight(enorm, hnorm, eh, to_device(layer, device))
        else:
            gate_up = torch.cat([take_weight(state, p + "mlp.gate_proj.weight"), take_weight(state, p + "mlp.up_proj.weight")])
            gate_up, down = shard_mlp(gate_up, take_weight(state, p + "mlp.down_proj.weight"), shard)
            module = MTPModuleWeight(enorm, hnorm, eh, None, take_weight(state, p + "post_attention_layernorm.weight"),
                                     gate_up, down)
        modules.append(to_device(module, device))
    return modules, fc


class LlamaMTPDraftModel:
    """K draft depths over a target model (eagle: one module reused; vanilla: K modules)."""

    def __init__(self, draft_dirs: List[str], mtp_mode: str, mtp_step: int, target):
        self.target = target
        self.mtp_step = mtp_step
        self.eagle = mtp_mode.startswith("eagle")
        self.with_att = mtp_mode.endswith("_with_att")
        dtype, device = target.dtype, target.device
        modules, cfg, self.fc = [], None, None
        for i, d in enumerate(draft_dirs):
            cfg = MTPDraftConfig.load(d)
            if cfg.with_attention != self.with_att:
                raise ValueError(f"{d}: with_attention={cfg.with_attention} does not fit --mtp_mode {mtp_mode}")
            if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
                raise ValueError(f"{d}: hidden/vocab size does not match the target model")
            check_target_layers(d, cfg.target_layer_ids, target.arch.num_layers)
            if i > 0 and cfg.target_layer_ids:
                raise ValueError(f"{d}: only the first draft dir (depth 0's) may read target_layer_ids")
            shard = target.layer_shard(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            if self.with_att:
                shard.check(d)
            dir_modules, fc = _load_modules(d, cfg, dtype, device, shard)
            modules.extend(dir_modules)
            if i == 0 and fc is not None:
                self.fc = fc
                target.aux_layer_ids = tuple(cfg.target_layer_ids)
        need = 1 if self.eagle else mtp_step
        if len(modules) < need:
            raise ValueError(f"--mtp_mode {mtp_mode} with --mtp_step {mtp_step} needs {need} draft modules, got {len(modules)}")
        self.cfg = cfg
        self.modules = modules[:need]
        self.eps = cfg.rms_norm_eps
        self.mem_manager = None
        if self.with_att:
            attn_tp = target.parallel.attn_tp_size  # this rank's heads, like the target's
            arch = TransformerArch(1, cfg.hidden_size, cfg.num_attention_heads // attn_tp,
                                   cfg.num_key_value_heads // attn_tp, cfg.head_dim, cfg.vocab_size, cfg.rms_norm_eps, True)
            # one KV "layer" per depth, slots shared with the target's pool
            self.mem_manager = MemoryManager(target.mem_manager.size, dtype, arch.kv_heads, arch.head_dim, mtp_step, device)
            shape = AttentionShape(arch.q_heads, arch.kv_heads, arch.head_dim, arch.rms_norm_eps)
            layer_cls = target.layer_infer_class
            self.layers_infer = [layer_cls(depth, shape, target.ops) for depth in range(mtp_step)]

    def target_features(self, out: ModelOutput) -> torch.Tensor:
        """Depth 0's hidden input [rows, hidden]: the target's last layer, or fc of its asked layers."""
        if self.fc is None:
            return out.hidden_states
        return self.target.ops.linear(out.aux_hidden_states, self.fc, None)

    def module_for_depth(self, depth: int) -> MTPModuleWeight:
        return self.modules[0 if self.eagle else depth]

    @torch.no_grad()
    def depth_state(self, model_input: ModelInput) -> Optional[InferStateInfo]:
        """The rows' state for the attention of every depth (positions, rotary tables, the attention plan:
        the same rows at every depth, so one state serves them all); None without attention."""
        if not self.with_att:
            return None
        t = self.target
        state = InferStateInfo.from_model_input(model_input, self.mem_manager, t.req_manager, t.device,
                                                t.parallel.comm(0))
        t._fill_position_embeddings(state)
        return state

    def forward_depth(self, depth: int, model_input: ModelInput, hidden_in: torch.Tensor, token_in: torch.Tensor,
                      state: Optional[InferStateInfo] = None) -> torch.Tensor:
        """depth: 0-based. hidden_in: [tokens, hidden], token_in: [tokens] -> hidden out [tokens, hidden].
        ``state``: ``depth_state(model_input)``, built here when not given."""
        w = self.module_for_depth(depth)
        e = rms_norm(self.target.embed(token_in), w.enorm, self.eps)
        h = rms_norm(hidden_in, w.hnorm, self.eps)
        x = self.target.ops.linear(torch.cat([e, h], dim=-1), w.eh_proj, None)
        comm = self.target.parallel.comm(0)
        if self.with_att:
            if state is None:
                state = self.depth_state(model_input)
            return self.layers_infer[depth].forward(x, w.layer, state)
        return x + ffn_forward(rms_norm(x, w.mlp_norm, self.eps), w.gate_up_proj, w.down_proj, comm, self.target.ops.linear)
