"""The decoder layer with its residual adds fused into the norms and the SwiGLU in one launch gives the same
bits as the layer written op by op (add, then norm; silu, then the product), for the logits, the hidden states
and the layers a draft reads, on tiny random Llama and Qwen3 checkpoints: fp32 on CPU (the torch code: what the
deferred adds change is the order of the layer loop), bf16 on CUDA (the fused kernels)."""
import pytest
import torch

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.common.basemodel.layer_infer.basic_ops import rms_norm, silu_and_mul_torch
from lightllm.models.llama.layer_infer import transformer_layer_infer
from lightllm.models.llama.layer_infer.transformer_layer_infer import LlamaTransformerLayerInfer, ffn_forward
from lightllm.models.registry import load_model
from unit_tests.devices import needs_cuda
from unit_tests.models.model_driver import PAD_ROW, ModelDriver
from unit_tests.models.tiny_checkpoints import MODEL_KINDS, tiny_model

KV_SLOTS = 256
MAX_REQS = 4
MAX_SEQ_LEN = 64
PROMPT = list(range(3, 14))


def op_by_op_layer(self, hidden, delta, weight, infer_state):
    """The layer as the torch code wrote it: each add its own op, then the norm; silu, then the product.
    Returns (output, zeros) so the model's deferred add is an exact no-op."""
    eps = self.shape.rms_norm_eps
    if delta is not None:
        hidden = hidden + delta
    hidden = hidden + self._attention(rms_norm(hidden, weight.input_norm, eps), weight, infer_state)
    x = rms_norm(hidden, weight.post_attention_norm, eps)
    hidden = hidden + ffn_forward(x, weight.gate_up_proj, weight.down_proj, infer_state.comm, self.ops.linear)
    return hidden, torch.zeros_like(hidden)


def _run(model_dir: str, device: str, data_type: str):
    """Prefill two prompts, then a decode step with padding and MTP rows: each forward's outputs."""
    model = load_model(ModelKvArgs(model_dir=model_dir, max_total_token_num=KV_SLOTS, max_req_num=MAX_REQS,
                                   max_seq_length=MAX_SEQ_LEN, data_type=data_type, device=device))
    model.aux_layer_ids = (0,)  # a draft reading the first layer's output: the deferred add is done there
    driver = ModelDriver(model)
    a, b = driver.add_request(), driver.add_request()
    outs = [driver.prefill([(a, PROMPT), (b, PROMPT[:5])])]
    outs.append(driver.decode([(a, 7), (a, 8), PAD_ROW, (b, 9)]))
    return [(o.logits, o.hidden_states, o.aux_hidden_states) for o in outs]


def _assert_same(model_dir: str, device: str, data_type: str, monkeypatch) -> None:
    fused = _run(model_dir, device, data_type)
    with monkeypatch.context() as m:
        m.setattr(LlamaTransformerLayerInfer, "forward_deferred", op_by_op_layer)
        m.setattr(transformer_layer_infer, "silu_and_mul", silu_and_mul_torch)
        reference = _run(model_dir, device, data_type)
    for got, want in zip(fused, reference):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.fixture(scope="module", params=MODEL_KINDS)
def model_dir(request, tmp_path_factory):
    return tiny_model(request.param, root=tmp_path_factory.mktemp(request.param)).model_dir


def test_fused_layer_equals_op_by_op_cpu(model_dir, monkeypatch):
    _assert_same(model_dir, "cpu", "float32", monkeypatch)


@needs_cuda
@pytest.mark.parametrize("data_type", ["bfloat16", "float32"])
def test_fused_layer_equals_op_by_op_cuda(model_dir, data_type, monkeypatch):
    _assert_same(model_dir, "cuda", data_type, monkeypatch)
