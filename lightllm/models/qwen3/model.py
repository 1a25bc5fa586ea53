"""Qwen3 dense models: Llama plus per-head q/k RMSNorm; head_dim comes from the config."""
from lightllm.models.llama.model import LlamaTpPartModel
from lightllm.models.qwen3.layer_infer.transformer_layer_infer import Qwen3TransformerLayerInfer


class Qwen3TpPartModel(LlamaTpPartModel):
    has_qk_norm = True
    layer_infer_class = Qwen3TransformerLayerInfer
