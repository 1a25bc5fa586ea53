import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm
from lightllm.common.basemodel.layer_weights.hf_load_utils import SHARD_INDEX_NAME
from lightllm.models.registry import load_model
from unit_tests.models.tiny_checkpoints import build_hf_model, save_checkpoint, tiny_model

KV_SLOTS = 32
MAX_REQS = 4
MAX_SEQ_LEN = 16


def _kvargs(model_dir: str, **overrides) -> ModelKvArgs:
    args = dict(model_dir=model_dir, max_total_token_num=KV_SLOTS, max_req_num=MAX_REQS, max_seq_length=MAX_SEQ_LEN)
    args.update(overrides)
    return ModelKvArgs(**args)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("data_type", "int8", "valid names: float32, bfloat16, float16"),
        ("device", "mps", "valid types: cpu, cuda"),
        ("max_total_token_num", 0, "max_total_token_num must be positive"),
    ],
)
def test_kvargs_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        _kvargs("unused", **{field: value})


def test_unknown_decode_attention_backend_lists_valid_names(tmp_path):
    model_dir = tiny_model("llama", root=tmp_path).model_dir
    with pytest.raises(ValueError, match="valid names: auto, torch, triton"):
        load_model(_kvargs(model_dir, decode_attention_backend="flash"))


def test_sharded_and_single_file_checkpoints_load_the_same(tmp_path):
    hf_model = build_hf_model("qwen3")
    single = load_model(_kvargs(save_checkpoint(hf_model, str(tmp_path / "single"), sharded=False)))
    sharded_dir = save_checkpoint(hf_model, str(tmp_path / "sharded"), sharded=True)
    assert os.path.isfile(os.path.join(sharded_dir, SHARD_INDEX_NAME))
    sharded = load_model(_kvargs(sharded_dir))
    for a, b in zip(single.trans_layers_weight, sharded.trans_layers_weight):
        assert torch.equal(a.qkv_proj, b.qkv_proj) and torch.equal(a.q_norm, b.q_norm)
    assert torch.equal(single.pre_post_weight.lm_head, sharded.pre_post_weight.lm_head)


def test_tied_and_untied_lm_head(tmp_path):
    tied = load_model(_kvargs(tiny_model("llama", root=tmp_path / "tied").model_dir))
    assert tied.pre_post_weight.lm_head is tied.pre_post_weight.embed_tokens
    untied = load_model(_kvargs(tiny_model("qwen3", root=tmp_path / "untied").model_dir))
    assert not torch.equal(untied.pre_post_weight.lm_head, untied.pre_post_weight.embed_tokens)


def test_model_exposes_sizes_and_managers(tmp_path):
    model = load_model(_kvargs(tiny_model("qwen3", root=tmp_path).model_dir))
    assert (model.vocab_size, model.hidden_size) == (model.config.vocab_size, model.config.hidden_size)
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    kv_shape = (KV_SLOTS + 1, model.config.num_key_value_heads, model.config.head_dim)
    assert model.mem_manager.k_buffer.shape[1:] == kv_shape
    assert model.req_manager.req_to_token_indexs.shape == (MAX_REQS + 1, MAX_SEQ_LEN)
    embedded = model.embed(torch.tensor([1, 2, 3]))
    assert embedded.shape == (3, model.hidden_size)
    logits = model.compute_logits(embedded)
    assert logits.shape == (3, model.vocab_size) and logits.dtype == torch.float32


def test_missing_weight_is_named(tmp_path):
    model_dir = tiny_model("qwen3", root=tmp_path).model_dir
    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, path)
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_norm.weight"):
        load_model(_kvargs(model_dir))


@pytest.mark.parametrize("data_type", ["float32", "bfloat16"])
def test_greedy_ids_are_the_argmax_of_the_fp32_logits(tmp_path, data_type):
    """A draft's greedy guess skips the fp32 copy of the logits: the upcast is exact, so the ids are
    those of the logits the sampler sees, ties included (the first maximum)."""
    model = load_model(_kvargs(tiny_model("llama", root=tmp_path).model_dir, data_type=data_type))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn((64, model.hidden_size), generator=gen).to(model.dtype)
    hidden = torch.cat([hidden, hidden[:1] * 0])  # a row whose logits all tie (zero hidden: zero logits)
    want = torch.argmax(model.compute_logits(hidden), dim=-1)
    assert want[-1] == 0
    assert torch.equal(model.greedy_ids(hidden), want)
    normed = rms_norm(hidden, model.pre_post_weight.final_norm, model.arch.rms_norm_eps)  # past the final norm
    assert torch.equal(model.greedy_ids(normed, normed=True), want)
