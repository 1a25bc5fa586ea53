"""Issue 13, item 2 (worker half), and issue 14's penalty rows.

sample() / token_logprobs never produce NaN or inf for extreme but storable parameters
(a temperature or repetition penalty that fp32 rounds to 0, a logit bias past fp32's
range); a tiny temperature draws the greedy token. Penalties run only over the rows whose
request has one, with results equal to a readable per-row reference.
"""
import random

import pytest
import torch

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.mode_backend import generic_post_process
from lightllm.server.router.model_infer.mode_backend.generic_post_process import sample, token_logprobs
from unit_tests.models.tiny_checkpoints import tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine
from unit_tests.server.router.sampling_util import sampling_setup

VOCAB = 64
LOGIT_SCALE = 4.0  # spread of the random logits: several units, like a real model's
HUGE = 1e308  # passes validation (finite), overflows fp32
TINY = 1e-50  # passes validation (> 0), fp32 stores it as 0


def _setup(raw_params, prompts, outputs, bypass=None):
    return sampling_setup(VOCAB, raw_params, prompts, outputs, bypass)


def _sample(logits, pm, reqs, seeds=None):
    b_req_idx = torch.arange(len(reqs), dtype=torch.int32)
    s = sample(logits, b_req_idx, pm, reqs, seeds)
    return s, token_logprobs(s.processed_logits, s.next_token_ids)


SAMPLED = {"do_sample": True}
# case: (request JSON, raw fields set past validation: values the HTTP edge may not let
# through, but which the worker must still handle)
EXTREMES = {
    "tiny temperature": (SAMPLED, {"temperature": TINY}),
    "temperature 1e-30": (SAMPLED, {"temperature": 1e-30}),
    "tiny repetition penalty": ({}, {"repetition_penalty": TINY}),
    "tiny repetition penalty, sampled": (SAMPLED, {"repetition_penalty": TINY}),
    "huge repetition penalty": ({}, {"repetition_penalty": 3e38}),
    "huge logit bias": ({}, {"logit_bias": {5: HUGE}}),
    "huge logit biases, sampled": (SAMPLED, {"logit_bias": {5: HUGE, 6: HUGE, 7: -HUGE}}),
    "huge negative bias on a penalized token": ({}, {"repetition_penalty": TINY, "logit_bias": {1: -HUGE}}),
    "huge presence penalty": ({}, {"presence_penalty": 3e38}),
    "tiny temperature and huge bias": (SAMPLED, {"temperature": TINY, "logit_bias": {9: HUGE}}),
}


@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_extreme_parameters_give_finite_log_probs(case):
    raw, bypass = EXTREMES[case]
    torch.manual_seed(0)
    # row 0: the extreme request; row 1: an ordinary sampled one in the same batch
    params = [raw, {"do_sample": True, "top_k": 10}]
    prompts, outputs = [[1, 2, 3], [4]], [[1, 2, 2], [5]]
    pm, reqs = _setup(params, prompts, outputs, bypass={0: bypass})
    logits = torch.randn(2, VOCAB) * LOGIT_SCALE
    logits[0, 1] = LOGIT_SCALE  # a seen token with a positive logit
    for _ in range(20):
        s, lp = _sample(logits, pm, reqs)
        assert torch.isfinite(s.processed_logits).all(), case
        assert torch.isfinite(lp).all(), case
        assert (lp <= 0).all()
        assert 0 <= int(s.next_token_ids.min()) and int(s.next_token_ids.max()) < VOCAB


def test_tiny_temperature_draws_the_greedy_token():
    torch.manual_seed(1)
    temps = [TINY, 1e-40, 1e-30, 1e-12]  # fp32: 0, a subnormal, overflowing logits / T, not overflowing
    pm, reqs = _setup([SAMPLED] * 4, [[1]] * 4, [[]] * 4, bypass={i: {"temperature": t} for i, t in enumerate(temps)})
    logits = torch.randn(4, VOCAB) * LOGIT_SCALE
    for _ in range(20):
        s, lp = _sample(logits, pm, reqs)
        assert torch.equal(s.next_token_ids, torch.argmax(logits, dim=-1))
        assert torch.equal(lp, torch.zeros(4))  # the whole mass on that token


def test_ordinary_temperatures_are_unchanged():
    """The temperature floor and the clamp leave ordinary values bit-identical."""
    torch.manual_seed(2)
    temps = [1e-4, 0.05, 0.7, 1.0, 1.8, 50.0]
    n = len(temps)
    pm, reqs = _setup([SAMPLED] * n, [[1]] * n, [[]] * n, bypass={i: {"temperature": t} for i, t in enumerate(temps)})
    logits = torch.randn(n, VOCAB) * LOGIT_SCALE
    s, _ = _sample(logits, pm, reqs, seeds=list(range(n)))
    expected = logits / torch.tensor(temps, dtype=torch.float32).unsqueeze(1)
    assert torch.equal(s.processed_logits, expected)


def _ref_penalized(row: torch.Tensor, sp: SamplingParams, prompt, out) -> torch.Tensor:
    """Penalties of one row, token by token (HF's repetition rule, OpenAI's presence/frequency)."""
    z = row.clone()
    rep, freq, presence = (torch.tensor(v, dtype=torch.float32)  # the tables' fp32 values
                           for v in (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty))
    for tok in set(prompt) | set(out):
        z[tok] = z[tok] / rep if z[tok] > 0 else z[tok] * rep
    for tok in set(out):
        z[tok] = z[tok] - freq * out.count(tok)
        z[tok] = z[tok] - presence
    return z


def test_penalties_run_only_over_the_rows_that_use_them(monkeypatch):
    torch.manual_seed(3)
    params = [
        {},
        {"repetition_penalty": 1.4},
        {"do_sample": True, "temperature": 0.8},
        {"presence_penalty": 0.6, "frequency_penalty": 0.3},
        {},
    ]
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8], [9]]
    outputs = [[2, 10], [4, 11], [12], [13, 13, 7], [14]]
    pm, reqs = _setup(params, prompts, outputs)
    rows_seen = []
    apply = generic_post_process._apply_penalties

    def spy(logits, b_req_idx, pm, rows=None):
        rows_seen.append(list(range(logits.shape[0])) if rows is None else rows.tolist())
        return apply(logits, b_req_idx, pm, rows)

    monkeypatch.setattr(generic_post_process, "_apply_penalties", spy)
    logits = torch.randn(len(reqs), VOCAB) * LOGIT_SCALE
    s, _ = _sample(logits, pm, reqs, seeds=[None, None, 8, None, None])
    assert rows_seen == [[1, 3]]
    for i, req in enumerate(reqs):
        ref = _ref_penalized(logits[i], req.params, prompts[i], outputs[i]) if req.has_penalty else logits[i]
        if req.params.top_k != 1:
            ref = ref / req.params.temperature
        assert torch.equal(s.processed_logits[i], ref), i
    # every row with a penalty: one pass over all rows, same values
    pm, reqs = _setup([params[1], params[3]], [prompts[1], prompts[3]], [outputs[1], outputs[3]])
    rows_seen.clear()
    s, _ = _sample(logits[[1, 3]], pm, reqs)
    assert rows_seen == [[0, 1]]
    assert torch.equal(s.processed_logits[0], _ref_penalized(logits[1], reqs[0].params, prompts[1], outputs[1]))
    assert torch.equal(s.processed_logits[1], _ref_penalized(logits[3], reqs[1].params, prompts[3], outputs[3]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model("qwen3", seed=12, root=tmp_path_factory.mktemp("robust"))


def test_engine_log_probs_stay_finite_and_tiny_temperature_is_greedy(tiny):
    """Through the engine (prefill + decode): the issue's temperature 1e-50, repetition penalty
    1e-50 and logit bias 1e308 give finite log-probs; temperature 1e-50 gives transformers'
    greedy tokens."""
    hf, d = tiny.hf, tiny.model_dir
    rng = random.Random(0)
    prompt = [rng.randrange(hf.config.vocab_size) for _ in range(12)]
    base = {"max_new_tokens": 8, "ignore_eos": True}
    extremes = [
        (SAMPLED, {"temperature": TINY}),
        ({}, {"repetition_penalty": TINY}),
        (SAMPLED, {"logit_bias": {5: HUGE}}),
        ({}, {"logit_bias": {5: HUGE, 6: HUGE}}),
    ]
    params = []
    for raw, bypass in extremes:
        sp = SamplingParams.from_request({**base, **raw})
        for name, value in bypass.items():
            object.__setattr__(sp, name, value)  # SamplingParams is frozen
        params.append(sp)
    eng = make_engine(d, max_req_total_len=64, max_total_token_num=300)
    res = eng.generate([prompt] * len(params), params)
    for p, r in zip(params, res):
        assert len(r.logprobs) == 8 and all(torch.isfinite(torch.tensor(r.logprobs))), p
    assert res[0].token_ids == hf_greedy(hf, prompt, 8)
    assert set(res[3].token_ids) <= {5, 6}
