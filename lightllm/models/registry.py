"""Model classes by Hugging Face ``config.model_type``."""
from typing import Dict, Optional, Type

from transformers import AutoConfig

from lightllm.common.basemodel.basemodel import ModelKvArgs, TpPartBaseModel
from lightllm.models.llama.model import LlamaTpPartModel
from lightllm.models.qwen3.model import Qwen3TpPartModel
from lightllm.utils.dist_utils import ParallelContext

MODEL_CLASSES: Dict[str, Type[TpPartBaseModel]] = {
    "llama": LlamaTpPartModel,
    "qwen3": Qwen3TpPartModel,
}


def get_model_class(model_type: str) -> Type[TpPartBaseModel]:
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; valid names: {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[model_type]


def load_model(kvargs: ModelKvArgs, parallel: Optional[ParallelContext] = None) -> TpPartBaseModel:
    """``parallel``: this rank's place among tensor / data parallel ranks (None: one rank)."""
    model_type = AutoConfig.from_pretrained(kvargs.model_dir).model_type
    return get_model_class(model_type)(kvargs, parallel)
