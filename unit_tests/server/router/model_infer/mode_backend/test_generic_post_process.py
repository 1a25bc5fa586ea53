"""sample() against a readable per-row reference (penalties -> bias -> grammar mask -> temperature -> choice)."""
import pytest
import torch

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.grammar import BITS_PER_WORD, bitmask_width
from lightllm.server.router.model_infer.mode_backend.generic_post_process import (
    apply_token_bitmask, sample, token_logprobs,
)
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


# ---- the grammar's token bitmask (docs/structured_output.md) ----
MASK_VOCAB = 70  # three bitmask words, the last one partly past the vocabulary


def _ref_masked(logits: torch.Tensor, allowed) -> torch.Tensor:
    """-inf on every token not in ``allowed[row]``, one entry at a time."""
    z = logits.clone()
    for r in range(z.shape[0]):
        for t in range(z.shape[1]):
            if t not in allowed[r]:
                z[r, t] = float("-inf")
    return z


def _bitmask(allowed, vocab: int) -> torch.Tensor:
    """The bitmask words of ``allowed`` token sets, bit by bit (grammar.py's layout)."""
    words = [[0] * bitmask_width(vocab) for _ in allowed]
    for r, toks in enumerate(allowed):
        for t in toks:
            words[r][t // BITS_PER_WORD] |= 1 << (t % BITS_PER_WORD)
    # int32 words: bit 31 is the sign bit
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def test_token_bitmask_masked_argmax_equals_reference():
    torch.manual_seed(3)
    allowed = [{0}, {31, 32, 63}, {69, 5, 40}, set(range(MASK_VOCAB))]  # word edges, the last token, all
    logits = torch.randn(len(allowed), MASK_VOCAB) * 4
    masked = apply_token_bitmask(logits, _bitmask(allowed, MASK_VOCAB))
    ref = _ref_masked(logits, allowed)
    assert torch.equal(masked, ref)
    params = [{}, {}, {"logit_bias": {"6": 100}}, {}]  # a bias never revives a forbidden token
    pm, reqs = sampling_setup(MASK_VOCAB, params, [[1]] * 4, [[]] * 4)
    out = sample(logits, torch.arange(4, dtype=torch.int32), pm, reqs, token_bitmask=_bitmask(allowed, MASK_VOCAB))
    assert out.next_token_ids.tolist() == torch.argmax(ref, dim=-1).tolist()
    assert all(t in a for t, a in zip(out.next_token_ids.tolist(), allowed))
    lp = token_logprobs(out.processed_logits, out.next_token_ids)  # log-probs under the grammar
    assert torch.allclose(lp, torch.log_softmax(ref, -1).gather(1, out.next_token_ids[:, None]).squeeze(1))


def test_token_bitmask_sampled_rows_stay_allowed():
    torch.manual_seed(4)
    allowed = [{2, 3, 50}] * 4
    logits = torch.randn(4, MASK_VOCAB)
    logits[:, 7] = 30.0  # the unmasked favourite is forbidden
    params = [{"do_sample": True, "temperature": t} for t in (0.5, 1.0, 2.0)] + [{"do_sample": True, "top_k": 2}]
    pm, reqs = sampling_setup(MASK_VOCAB, params, [[1]] * 4, [[]] * 4)
    mask = _bitmask(allowed, MASK_VOCAB)
    for _ in range(20):
        out = sample(logits, torch.arange(4, dtype=torch.int32), pm, reqs, token_bitmask=mask)
        assert all(t in a for t, a in zip(out.next_token_ids.tolist(), allowed))


def test_token_bitmask_equals_xgrammar_apply():
    xgr = pytest.importorskip("xgrammar")
    torch.manual_seed(5)
    mask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_width(MASK_VOCAB)), dtype=torch.int32)
    logits = torch.randn(5, MASK_VOCAB)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, mask, vocab_size=MASK_VOCAB)
    assert torch.equal(apply_token_bitmask(logits, mask), ref)
