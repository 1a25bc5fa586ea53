"""ASD through the engine (router + backend + kernels) on tiny random models, CPU fp32."""
import pytest
import torch

from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import make_engine

K = 3
COMMON = dict(max_req_total_len=96, running_max_req_size=6, batch_max_tokens=64, max_total_token_num=700)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = tiny_model("llama", seed=4, root=tmp_path_factory.mktemp("asd"))
    # a weak draft (small random weights) so that mismatches, and so relaxations, are common
    return m.hf, m.model_dir, m.draft("draft", seed=5, std=0.02)


def _engine(tiny, **asd):
    hf, target, draft = tiny
    return make_engine(target, mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[draft], **COMMON, **asd)


def _prompts(vocab, n=6, seed=0):
    return random_prompts(vocab, n, range(2, 20), seed)


def _greedy(n):
    return [{"max_new_tokens": 24, "ignore_eos": True}] * n


def test_budget_zero_is_token_identical_to_strict(tiny):
    hf = tiny[0]
    prompts = _prompts(hf.config.vocab_size)
    strict = _engine(tiny).generate(prompts, _greedy(len(prompts)))
    for asd in (dict(mtp_asd_regret_budget=0.0),
                dict(mtp_asd_regret_budget=5.0, mtp_asd_block_max_mismatch=0),
                dict(mtp_asd_regret_budget=5.0, mtp_asd_local_regret_ratio=0.0)):
        res = _engine(tiny, **asd).generate(prompts, _greedy(len(prompts)))
        for s, r in zip(strict, res):
            assert r.token_ids == s.token_ids and r.accept_lens == s.accept_lens
            assert r.asd_relaxed_token_num == 0 and r.asd_regret_spent == 0.0


def test_positive_budget_relaxes_within_budget_and_raises_acceptance(tiny):
    hf = tiny[0]
    prompts = _prompts(hf.config.vocab_size, seed=1)
    strict = _engine(tiny).generate(prompts, _greedy(len(prompts)))
    budget = 6.0
    res = _engine(tiny, mtp_asd_regret_budget=budget).generate(prompts, _greedy(len(prompts)))
    relaxed = sum(r.asd_relaxed_token_num for r in res)
    assert relaxed > 0
    for r in res:
        assert 0.0 <= r.asd_regret_spent <= budget
        assert (r.asd_relaxed_token_num > 0) == (r.asd_regret_spent > 0)
    tokens_per_step = lambda rs: sum(sum(r.accept_lens) for r in rs) / sum(len(r.accept_lens) for r in rs)
    assert tokens_per_step(res) > tokens_per_step(strict)


def test_one_requests_spending_never_changes_anothers(tiny):
    """Request A's output and ledger are the same alone, next to a big-budget B, and next to B = 0."""
    hf = tiny[0]
    a, b = _prompts(hf.config.vocab_size, n=2, seed=2)
    eng = _engine(tiny, mtp_asd_regret_budget=1.0)
    alone = eng.generate([a], _greedy(1), asd_budgets=[3.0])[0]
    with_big = eng.generate([a, b], _greedy(2), asd_budgets=[3.0, 50.0])
    with_zero = eng.generate([a, b], _greedy(2), asd_budgets=[3.0, 0.0])
    assert alone.asd_relaxed_token_num > 0
    for r in (with_big[0], with_zero[0]):
        assert r.token_ids == alone.token_ids
        assert r.asd_regret_spent == pytest.approx(alone.asd_regret_spent, rel=1e-5)  # batched fp32 rounding
    assert with_big[1].asd_regret_spent <= 50.0 and with_zero[1].asd_regret_spent == 0.0


def test_sampled_requests_are_verified_strictly_in_a_mixed_batch(tiny):
    """A seeded sampled request gives the same tokens with ASD on (budget 0 for it) and off."""
    hf = tiny[0]
    prompts = _prompts(hf.config.vocab_size, n=3, seed=3)
    params = [{"max_new_tokens": 20, "ignore_eos": True, "do_sample": True, "temperature": 0.8, "seed": 7}] + _greedy(2)
    off = _engine(tiny).generate(prompts, params)
    on_eng = _engine(tiny, mtp_asd_regret_budget=8.0)
    on = on_eng.generate(prompts, params)
    assert on[0].token_ids == off[0].token_ids and on[0].asd_relaxed_token_num == 0
    assert sum(r.asd_relaxed_token_num for r in on[1:]) > 0


def test_relaxed_rows_report_the_committed_tokens_logprob(tiny):
    """Reported log-probs equal transformers' log-softmax of the committed tokens (teacher forcing)."""
    hf = tiny[0]
    prompt = _prompts(hf.config.vocab_size, n=1, seed=4)[0]
    res = _engine(tiny, mtp_asd_regret_budget=20.0).generate([prompt], _greedy(1))[0]
    assert res.asd_relaxed_token_num > 0
    seq = torch.tensor([prompt + res.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(seq).logits[0].float(), -1)
    ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(res.token_ids)]
    assert res.logprobs == pytest.approx(ref, abs=1e-4)
    # and a relaxed token is not the argmax of its row
    argmax = [int(logp[len(prompt) - 1 + i].argmax()) for i in range(len(res.token_ids))]
    assert sum(a != t for a, t in zip(argmax, res.token_ids)) == res.asd_relaxed_token_num


def test_ledger_is_zeroed_when_a_req_idx_is_reused(tiny):
    """Run many short requests through few req_idx rows: each starts with the full budget."""
    hf = tiny[0]
    prompts = _prompts(hf.config.vocab_size, n=8, seed=6)
    eng = _engine(tiny, mtp_asd_regret_budget=2.0)
    one_by_one = [eng.generate([p], _greedy(1))[0] for p in prompts]
    batched = eng.generate(prompts, _greedy(len(prompts)))  # 6 rows reused by 10 requests
    for x, y in zip(one_by_one, batched):
        assert x.token_ids == y.token_ids
        assert x.asd_regret_spent == pytest.approx(y.asd_regret_spent, rel=1e-5)
