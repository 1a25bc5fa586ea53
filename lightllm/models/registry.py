"""Model classes by Hugging Face ``config.model_type``.

The classes are imported on first use, so that start-up can check a model dir's architecture
(``check_model_type``) without torch, before any worker process spawns.
"""
import importlib
import json
import os
from typing import TYPE_CHECKING, Dict, Optional, Type

if TYPE_CHECKING:
    from lightllm.common.basemodel.basemodel import ModelKvArgs, TpPartBaseModel
    from lightllm.utils.dist_utils import ParallelContext

# model_type -> "module:class"
MODEL_CLASS_PATHS: Dict[str, str] = {
    "llama": "lightllm.models.llama.model:LlamaTpPartModel",
    "qwen3": "lightllm.models.qwen3.model:Qwen3TpPartModel",
}
MODEL_TYPES = tuple(MODEL_CLASS_PATHS)


def _unsupported(model_type) -> ValueError:
    return ValueError(f"unsupported model_type {model_type!r}; valid names: {', '.join(MODEL_TYPES)}")


def check_model_type(model_dir: str) -> str:
    """The ``model_type`` of ``model_dir``'s config.json; ValueError naming the valid ones when it
    is not served (reads the JSON only: no torch, no transformers)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in MODEL_CLASS_PATHS:
        raise _unsupported(model_type)
    return model_type


def get_model_class(model_type: str) -> "Type[TpPartBaseModel]":
    if model_type not in MODEL_CLASS_PATHS:
        raise _unsupported(model_type)
    module, name = MODEL_CLASS_PATHS[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def load_model(kvargs: "ModelKvArgs", parallel: "Optional[ParallelContext]" = None) -> "TpPartBaseModel":
    """``parallel``: this rank's place among tensor / data parallel ranks (None: one rank)."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(kvargs.model_dir).model_type
    return get_model_class(model_type)(kvargs, parallel)
