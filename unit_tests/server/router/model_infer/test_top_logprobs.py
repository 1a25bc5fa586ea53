"""Top-k log-probs through the engine (issue 29), CPU fp32 on a tiny random Llama.

More prompts than --running_max_req_size and a small --batch_max_tokens, so requests join while
others decode and mixed steps (the default) carry first tokens; plain decoding (with the overlap
schedule), strict MTP (eagle K = 2) and ASD with a budget that relaxes. Every committed token's
top-k ids and log-probs must equal transformers' forward over prompt + returned tokens (top-k of
the log-softmax at each position, of logits / temperature for a sampled request), each request
truncated to its own k; a request that asks 0 gets None, and a run where nobody asks runs no top-k
and returns the same tokens and log-probs bit for bit.
"""
import pytest
import torch

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.decode_step import HostStepResult, commit_step
from lightllm.server.router.model_infer.infer_batch import InferReq
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import make_engine

K = 2
ASD_BUDGET = 6.0
TOL = 1e-4  # fp32 on CPU; the engine's kernels sum in another order than transformers'
NEAR_TIE = 1e-3  # ranks of alternatives closer than this may swap by rounding
COMMON = dict(max_req_total_len=64, max_total_token_num=800, running_max_req_size=3, batch_max_tokens=8)
# (max_new_tokens, top_logprobs, temperature or None for greedy) per request
REQS = [(10, 5, None), (7, 0, None), (12, 3, None), (9, 20, 0.8), (6, 1, None), (11, 7, None), (8, 0, 0.9)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = tiny_model("llama", seed=3, root=tmp_path_factory.mktemp("top_logprobs"))
    # a weak draft: many mismatches, so ASD relaxes
    return m, m.draft("eagle", True, 1, seed=5, std=0.02)


def _mode_args(draft: str, mode: str) -> dict:
    if mode == "plain":
        return {}
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[draft])
    return mtp if mode == "mtp" else dict(mtp, mtp_asd_regret_budget=ASD_BUDGET)


def _params(ask: bool):
    out = []
    for i, (n, k, temp) in enumerate(REQS):
        p = {"max_new_tokens": n, "ignore_eos": True, "top_logprobs": k if ask else 0}
        if temp is not None:
            p.update(do_sample=True, temperature=temp, seed=100 + i)
        out.append(p)
    return out


def _run(model_dir: str, prompts, ask: bool, monkeypatch, **kw):
    """(results, every update, mixed-step calls, torch.topk calls)."""
    eng = make_engine(model_dir, **COMMON, **kw)
    updates, mixed_calls, topk_calls = [], [], []
    step, mixed = eng.router.step, eng.backend.mixed

    def spy_step(*a, **k):
        out = step(*a, **k)
        updates.extend(out)
        return out

    def spy_mixed(rows_owner, decoding, reqs, chunk_lens):
        mixed_calls.append(len(decoding))
        return mixed(rows_owner, decoding, reqs, chunk_lens)

    real_topk = torch.topk

    def counting_topk(*a, **k):
        topk_calls.append(1)
        return real_topk(*a, **k)

    eng.router.step, eng.backend.mixed = spy_step, spy_mixed
    with monkeypatch.context() as mp:
        mp.setattr(torch, "topk", counting_topk)
        res = eng.generate(prompts, _params(ask))
    assert eng.backend.mem_manager.available_size == eng.backend.mem_manager.size
    return eng, res, updates, mixed_calls, len(topk_calls)


def _reference_logp(hf, prompt, out_ids, temperature):
    ids = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()[len(prompt) - 1:-1]
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [len(out_ids), vocab]


@pytest.mark.parametrize("mode", ["plain", "mtp", "asd"])
def test_top_logprobs_equal_transformers_forward(tiny, mode, monkeypatch):
    m, draft = tiny
    prompts = random_prompts(m.vocab_size, len(REQS), range(3, 30), seed=11)
    kw = _mode_args(draft, mode)
    eng, res, updates, mixed_calls, topk_calls = _run(m.model_dir, prompts, True, monkeypatch, **kw)
    assert mixed_calls, "no mixed step ran: the first-token path of mixed steps is not covered"
    assert topk_calls > 0
    if mode == "plain":
        assert eng.backend.overlap_schedule and eng.backend.steps_ahead > 0  # steps launched ahead too
    if mode == "asd":
        assert sum(r.asd_relaxed_token_num for r in res) > 0
    id_of = {}
    for i, rid in enumerate(sorted({u.req_id for u in updates})):
        id_of[rid] = i
    relaxed_seen = 0
    for u in updates:
        k = REQS[id_of[u.req_id]][1]
        if k == 0:
            assert u.top_logprobs is None
        else:
            assert u.top_logprobs is not None and len(u.top_logprobs) == len(u.token_ids)
            assert all(len(t) == k for t in u.top_logprobs)
    for prompt, (n, k, temp), r in zip(prompts, REQS, res):
        assert len(r.token_ids) == n and len(r.logprobs) == n
        logp = _reference_logp(m.hf, prompt, r.token_ids, temp)
        ref_chosen = logp.gather(1, torch.tensor(r.token_ids).unsqueeze(1)).squeeze(1)
        assert r.logprobs == pytest.approx(ref_chosen.tolist(), abs=TOL)
        if k == 0:
            assert r.top_logprobs == []
            continue
        assert len(r.top_logprobs) == n
        for pos, top in enumerate(r.top_logprobs):
            ids = [t for t, _ in top]
            vals = torch.tensor([v for _, v in top])
            ref_vals, ref_ids = torch.topk(logp[pos], k)
            assert torch.allclose(vals, ref_vals, atol=TOL), (pos, vals, ref_vals)
            # each id's reference log-prob is its value (near-ties may swap ranks, nothing else)
            assert torch.allclose(logp[pos, ids], vals, atol=TOL), (pos, ids, ref_ids)
            gaps = ref_vals[:-1] - ref_vals[1:]
            for j in range(k):
                if (j == 0 or gaps[j - 1] > NEAR_TIE) and (j == k - 1 or gaps[j] > NEAR_TIE):
                    assert ids[j] == int(ref_ids[j]), (pos, j, ids, ref_ids.tolist())
            best2 = torch.topk(logp[pos], 2).values
            if temp is None and ids[0] != r.token_ids[pos] and best2[0] - best2[1] > NEAR_TIE:
                relaxed_seen += 1  # a relaxed (draft) token: its list is still the target's
    if mode == "asd":
        assert relaxed_seen > 0
    else:
        assert relaxed_seen == 0
    # nobody asks: no top-k at all, and the same tokens and log-probs (the schedule is the same)
    _, plain, plain_updates, _, plain_topk = _run(m.model_dir, prompts, False, monkeypatch, **kw)
    assert plain_topk == 0
    assert all(u.top_logprobs is None for u in plain_updates)
    for a, b in zip(res, plain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_packed_top_logprobs_round_trip_and_commit_truncates_to_each_requests_k():
    rows, reqs, k_max = 4, 2, 3  # two requests of K + 1 = 2 rows
    ids = torch.tensor([5, 6, 7, 8])
    lps = torch.tensor([-0.5, -1.0, -1.5, -2.0])
    acc = torch.tensor([2, 1], dtype=torch.int32)
    top_ids = torch.tensor([[5, 1, 2], [6, 3, 4], [9, 7, 0], [8, 2, 1]])
    top_vals = torch.tensor([[-0.5, -1.25, -2.0], [-1.0, -1.5, -3.0], [-0.25, -1.5, -4.0], [-2.0, -2.5, -2.75]])
    packed = HostStepResult.pack(ids, lps, acc, top=(top_ids, top_vals))
    assert packed.numel() == HostStepResult.packed_size(rows, reqs, False, top_width=k_max)
    host = HostStepResult.unpack(packed, rows, reqs, False, top_width=k_max)
    assert host.ids == [5, 6, 7, 8] and host.accept_len == [2, 1]
    assert host.top_ids == top_ids.tolist() and host.top_logprobs == top_vals.tolist()
    # after the ASD and confidence parts (a draft that reports confidences, e.g. dspark)
    relaxed, spent, conf = torch.tensor([0, 1, 0, 0]), torch.tensor([0.5, 0.0]), torch.tensor([[0.9], [0.25]])
    packed = HostStepResult.pack(ids, lps, acc, relaxed, spent, conf, top=(top_ids, top_vals))
    assert packed.numel() == HostStepResult.packed_size(rows, reqs, True, 1, k_max)
    full = HostStepResult.unpack(packed, rows, reqs, True, conf_width=1, top_width=k_max)
    assert full.relaxed == [False, True, False, False] and full.spent == [0.5, 0.0]
    assert full.confidence == [[pytest.approx(0.9)], [0.25]]
    assert full.top_ids == top_ids.tolist() and full.top_logprobs == top_vals.tolist()
    # without k_max nothing is appended and nothing is read
    assert HostStepResult.pack(ids, lps, acc).numel() == HostStepResult.packed_size(rows, reqs, False)
    assert HostStepResult.unpack(HostStepResult.pack(ids, lps, acc), rows, reqs, False).top_ids is None
    a = InferReq(1, [1, 2], SamplingParams(max_new_tokens=10, top_logprobs=2), [], kv_len=2)
    b = InferReq(2, [1, 2], SamplingParams(max_new_tokens=10), [], kv_len=2)
    commits, _ = commit_step([a, b], host, [10, 11, 12, 13], 2)
    assert commits[0].top_logprobs == [[(5, -0.5), (1, -1.25)], [(6, -1.0), (3, -1.5)]]
    assert commits[1].top_logprobs is None and commits[1].tokens == [7]


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_top_logprobs_is_validated(bad):
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=bad)
