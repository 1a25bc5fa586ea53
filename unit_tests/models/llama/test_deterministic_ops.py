"""Deterministic inference's layer kernels on a tiny model (CPU, Triton's interpreter): a
token's logits are bitwise the same whether it is prefilled in one chunk, in two, decoded
one token at a time, or decoded as an MTP row behind other rows, and they match the default
kernels' logits up to summation order. (The bf16 end-to-end check is a GPU test:
unit_tests/server/router/model_infer/test_deterministic_inference.py.)"""

import pytest
import torch

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.models.llama.layer_infer import attention_backends as ab
from lightllm.models.registry import load_model
from unit_tests.devices import needs_triton_cpu
from unit_tests.models.model_driver import PAD_ROW, ModelDriver
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model

pytestmark = needs_triton_cpu

PROMPT_LEN = 13
SPLIT = 5  # the two-chunk prefill splits the prompt here
NEW_TOKENS = 4


def _deterministic(model):
    """The CUDA kernels' choice, on CPU (the interpreter runs them)."""
    ops = ab.LayerOps(ab.batch_invariant_linear, ab.deterministic_triton_attention)
    model.ops = ops
    for layer in model.layers_infer:
        layer.ops = ops
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tm = tiny_model("llama", root=tmp_path_factory.mktemp("det"))
    kv = ModelKvArgs(model_dir=tm.model_dir, max_total_token_num=512, max_req_num=8, max_seq_length=64)
    prompt = random_prompts(tm.vocab_size, 1, range(PROMPT_LEN, PROMPT_LEN + 1), seed=3)[0]
    cont = random_prompts(tm.vocab_size, 1, range(NEW_TOKENS, NEW_TOKENS + 1), seed=4)[0]
    return kv, prompt, cont


def _logits_by_schedule(model, prompt, cont):
    """Logits of the positions after prompt + cont[:i] (i = 0..NEW_TOKENS-1), four ways."""
    d = ModelDriver(model)
    seq = prompt + cont
    out = {}
    # one prefill of everything, logits of the last NEW_TOKENS positions
    r = d.add_request()
    full = []
    for n in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS):  # each prefix as its own request: last row's logits
        q = d.add_request()
        full.append(d.prefill([(q, seq[:n])]).logits[0])
        d.free_request(q)
    out["prefill"] = torch.stack(full)
    d.free_request(r)
    # two chunks, then one decode row per token
    r = d.add_request()
    d.prefill([(r, prompt[:SPLIT])])
    rows = [d.prefill([(r, prompt[SPLIT:])]).logits[0]]
    rows += [d.decode([(r, t)]).logits[0] for t in cont[:NEW_TOKENS - 1]]
    out["decode"] = torch.stack(rows)
    d.free_request(r)
    # the prompt, then all continuation tokens as MTP rows of one decode forward, padded
    r, other = d.add_request(), d.add_request()
    first = d.prefill([(r, prompt), (other, prompt[:7])]).logits[0]
    mtp = d.decode([(other, 5)] + [(r, t) for t in cont[:NEW_TOKENS - 1]] + [PAD_ROW]).logits[1:NEW_TOKENS]
    out["mtp_rows"] = torch.cat([first[None], mtp])
    return out


def test_same_logits_whatever_the_schedule(setup):
    kv, prompt, cont = setup
    det = _logits_by_schedule(_deterministic(load_model(kv)), prompt, cont)
    assert torch.equal(det["decode"], det["prefill"])
    assert torch.equal(det["mtp_rows"], det["prefill"])
    default = _logits_by_schedule(load_model(kv), prompt, cont)
    torch.testing.assert_close(det["prefill"], default["prefill"], rtol=1e-4, atol=1e-4)


def test_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        ab.get_layer_ops("auto", torch.device("cpu"), deterministic=True)
    assert ab.get_layer_ops("auto", torch.device("cpu")).linear is torch.nn.functional.linear
