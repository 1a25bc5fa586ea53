import pytest

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.models.llama.model import LlamaTpPartModel
from lightllm.models.qwen3.model import Qwen3TpPartModel
from lightllm.models.registry import get_model_class, load_model
from unit_tests.models.tiny_checkpoints import tiny_model


def test_get_model_class_by_model_type():
    assert get_model_class("llama") is LlamaTpPartModel
    assert get_model_class("qwen3") is Qwen3TpPartModel


def test_unknown_model_type_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: llama, qwen3"):
        get_model_class("gpt2")


@pytest.mark.parametrize("kind,cls", [("llama", LlamaTpPartModel), ("qwen3", Qwen3TpPartModel)])
def test_load_model_picks_the_class_from_config(tmp_path, kind, cls):
    model_dir = tiny_model(kind, root=tmp_path).model_dir
    model = load_model(ModelKvArgs(model_dir, max_total_token_num=8, max_req_num=2, max_seq_length=8))
    assert type(model) is cls
