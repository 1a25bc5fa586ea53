"""sample() against a readable per-row reference (penalties -> bias -> temperature -> choice)."""
import torch

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.mode_backend.generic_post_process import sample, token_logprobs
from unit_tests.server.router.sampling_util import sampling_setup

VOCAB = 50


def _setup(param_list, prompts, outputs):
    return sampling_setup(VOCAB, param_list, prompts, outputs)


def _ref_processed(logits_row, sp: SamplingParams, prompt, out):
    z = logits_row.clone()
    for tok in set(prompt) | set(out):
        if sp.repetition_penalty != 1.0:
            z[tok] = z[tok] / sp.repetition_penalty if z[tok] > 0 else z[tok] * sp.repetition_penalty
    for tok in set(out):
        z[tok] -= sp.frequency_penalty * out.count(tok) + sp.presence_penalty
    for tok, b in sp.logit_bias.items():
        z[tok] += b
    return z


def test_greedy_with_penalties_and_bias_matches_reference():
    torch.manual_seed(0)
    params = [
        {},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8, "frequency_penalty": 0.5},
        {"logit_bias": {"7": 5.0, "9": -100}},
    ]
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]
    outputs = [[], [4, 10], [11, 11, 12], []]
    pm, reqs = _setup(params, prompts, outputs)
    logits = torch.randn(len(reqs), VOCAB) * 3
    out = sample(logits, torch.arange(len(reqs), dtype=torch.int32), pm, reqs)
    for i, r in enumerate(reqs):
        # penalties only when the request has any; the reference applies them unconditionally
        ref = _ref_processed(logits[i], r.params, prompts[i] if r.has_penalty else [], outputs[i])
        torch.testing.assert_close(out.processed_logits[i], ref)
        assert out.next_token_ids[i].item() == int(torch.argmax(ref))


def test_top_k_top_p_only_allowed_tokens_and_mixed_greedy_rows():
    torch.manual_seed(1)
    params = [{"do_sample": True, "top_k": 3}, {"do_sample": True, "top_p": 0.5}, {}]
    pm, reqs = _setup(params, [[1]] * 3, [[]] * 3)
    logits = torch.randn(3, VOCAB) * 2
    allowed_k = set(torch.topk(logits[0], 3).indices.tolist())
    probs = torch.softmax(logits[1], -1)
    order = torch.argsort(probs, descending=True).tolist()
    allowed_p, mass = set(), 0.0
    for tok in order:  # nucleus: smallest prefix whose mass reaches top_p
        allowed_p.add(tok)
        mass += probs[tok].item()
        if mass >= 0.5:
            break
    seen_k, seen_p = set(), set()
    for _ in range(200):
        out = sample(logits, torch.arange(3, dtype=torch.int32), pm, reqs)
        seen_k.add(out.next_token_ids[0].item())
        seen_p.add(out.next_token_ids[1].item())
        assert out.next_token_ids[2].item() == int(torch.argmax(logits[2]))
    assert seen_k <= allowed_k and len(seen_k) > 1
    assert seen_p <= allowed_p


def test_seeded_rows_are_reproducible():
    params = [{"do_sample": True, "temperature": 1.5, "seed": 42}]
    pm, reqs = _setup(params, [[1]], [[]])
    logits = torch.randn(1, VOCAB)
    draws = {sample(logits, torch.zeros(1, dtype=torch.int32), pm, reqs, [42]).next_token_ids.item() for _ in range(5)}
    assert len(draws) == 1


def test_token_logprobs():
    z = torch.tensor([[1.0, 2.0, 3.0]])
    lp = token_logprobs(z, torch.tensor([1]))
    torch.testing.assert_close(lp, torch.log_softmax(z, -1)[:, 1])
