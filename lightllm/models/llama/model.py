"""Llama-2/3 style models (SmolLM2 is one): rope (default, linear, llama3), GQA, SwiGLU."""
from lightllm.common.basemodel.basemodel import TpPartBaseModel
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.models.llama.layer_infer.attention_backends import get_layer_ops
from lightllm.models.llama.layer_infer.transformer_layer_infer import AttentionShape, LlamaTransformerLayerInfer
from lightllm.models.llama.rope import build_rotary_embedding


class LlamaTpPartModel(TpPartBaseModel):
    layer_infer_class = LlamaTransformerLayerInfer

    def _init_infer_layers(self) -> None:
        shape = AttentionShape(  # this rank's heads (tensor parallel: a 1 / attn_tp_size part)
            q_heads=self.arch.q_heads // self.tp_shard.attn_size,
            kv_heads=self.arch.kv_heads // self.tp_shard.attn_size,
            head_dim=self.arch.head_dim,
            rms_norm_eps=self.arch.rms_norm_eps,
        )
        self.ops = get_layer_ops(self.kvargs.decode_attention_backend, self.device, self.kvargs.deterministic_inference)
        self.layers_infer = [self.layer_infer_class(layer_num, shape, self.ops) for layer_num in range(self.arch.num_layers)]

    def _init_position_embedding(self) -> None:
        self.rotary = build_rotary_embedding(self.config, self.arch.head_dim, self.device)

    def _fill_position_embeddings(self, infer_state: InferStateInfo) -> None:
        infer_state.position_cos, infer_state.position_sin = self.rotary.cos_sin(infer_state.positions, self.dtype)
