"""Mixed steps on CPU: decode rows and prompt chunks in one forward (step_rows.py).

More requests than --running_max_req_size, prompts of different lengths chunked by a small
--batch_max_tokens: requests join while others decode, so most steps hold both. The reference
for every request is the same engine serving one request at a time (no step ever mixes), and
transformers' own greedy generation for plain decoding. Token ids must be equal; log-probs
equal up to float rounding (the rows run in other GEMM and attention shapes).
"""

import pytest

import torch

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.server.router.model_infer.mode_backend.chunked_prefill import impl as chunked_prefill_impl
from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import PACED_MIN_PREFILL_TOKENS, paced_budget
from lightllm.server.router.model_infer.step_rows import GATHER_INPUT, RowItem, StepRows, max_sampled_rows, step_ladder
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine, mode_args

K = 2
ASD_BUDGET = 3.0  # relaxes some tokens with the tiny eagle draft
MAX_NEW = (12, 5, 9, 14, 7, 10, 6)
PROMPT_LENS = range(3, 40)
COMMON = dict(max_req_total_len=64, max_total_token_num=600)
CHUNK = 8  # prompt tokens per step: most prompts take several chunks
LOGPROB_TOL = 1e-4
BLOCK_LADDER_MAX = 4  # dspark's padded blocks in the rows layout: 1, 2, 4 (3 running requests pad to 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lightllm.models.dspark.train_module import random_dspark_draft

    root = tmp_path_factory.mktemp("mixed")
    m = tiny_model("llama", seed=2, root=root)
    drafts = {"eagle": m.draft("eagle", True, 1, seed=4),
              "dspark": random_dspark_draft(m.hf.config, str(root / "dspark"), seed=3, block_size=4)}
    return m, drafts


def _mode_args(drafts: dict, mode: str) -> dict:
    return mode_args(drafts, mode, K, ASD_BUDGET)


def _run(model_dir: str, prompts, running: int, layout: str = "items", counters=None, max_new=MAX_NEW,
         pace_min=None, **kw):
    """``layout`` rows: CUDA's padded rows layout (its eager body) instead of CPU's items. ``counters``: a dict
    filled with the backend's step counters of those names. ``max_new``: each prompt's max_new_tokens.
    ``pace_min``: the paced mixed steps' fewest prompt tokens (the tiny prompts are far below the default)."""
    eng = make_engine(model_dir, running_max_req_size=running, batch_max_tokens=CHUNK, **COMMON, **kw)
    b = eng.backend
    if pace_min is not None:
        b.pace_min_tokens = pace_min
    if layout == "rows":
        ladder = step_ladder(CHUNK, running * (b.mtp_step + 1) + CHUNK)
        b.mixed_rows = StepRows(b.model, b.req_to_next_token_ids, ladder, False, b.rows_draft,
                                max_logit_rows=max_sampled_rows(running, b.mtp_step), context=b.rows_context)
        if b.rows_context is not None:  # dspark: its blocks padded as on CUDA (a ladder of 1, 2, 4)
            b.draft.use_block_ladder(GraphLadder.from_flags(BLOCK_LADDER_MAX, BLOCK_LADDER_MAX, 1), False)
    calls = []
    launch = eng.backend.launch_mixed  # every mixed step's launch (run at once, or left in flight with overlap)

    def spy(step):
        calls.append((len(step.decoding), sum(step.chunk_lens)))
        return launch(step)

    eng.backend.launch_mixed = spy
    params = [{"max_new_tokens": n, "ignore_eos": True} for n in max_new]
    res = eng.generate(prompts, params)
    assert eng.backend.mem_manager.available_size == eng.backend.mem_manager.size  # every slot back
    hold = b.req_manager.HOLD_REQUEST_ID  # padding rows read position 0 of the HOLD row: the HOLD slot
    assert b.req_manager.req_to_token_indexs[hold, 0] == b.mem_manager.HOLD_SLOT
    if counters is not None:
        counters.update({k: getattr(b, k) for k in counters})
    return res, calls


@pytest.mark.parametrize("wait", [0, 1, 4])  # --router_max_wait_tokens: admission at every step, or grouped
@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["plain", "mtp", "asd0", "asd", "dspark_mtp", "dspark_asd0", "dspark_asd"])
def test_mixed_steps_give_one_request_at_a_times_outputs(tiny, mode, layout, wait):
    m, drafts = tiny
    prompts = random_prompts(m.vocab_size, len(MAX_NEW), PROMPT_LENS, seed=7)
    kw = dict(_mode_args(drafts, mode), router_max_wait_tokens=wait)
    alone, alone_calls = _run(m.model_dir, prompts, 1, **kw)
    mixed, calls = _run(m.model_dir, prompts, 3, layout, **kw)
    assert not alone_calls
    assert calls and all(d > 0 and t > 0 for d, t in calls)
    assert any(t == CHUNK for _, t in calls)  # a chunk that does not finish its prompt rode along
    for a, b in zip(alone, mixed):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
        assert b.accept_lens == a.accept_lens  # the same drafts, step by step
        assert [len(c) for c in b.draft_confidences] == [len(c) for c in a.draft_confidences]
        assert sum(b.draft_confidences, []) == pytest.approx(sum(a.draft_confidences, []), abs=LOGPROB_TOL)
    if mode.startswith("dspark"):
        assert any(a.draft_confidences for a in alone)
    if not mode.endswith("_asd") and mode != "asd":  # greedy decoding, strictly verified: transformers' tokens
        for prompt, n, b in zip(prompts, MAX_NEW, mixed):
            assert b.token_ids == hf_greedy(m.hf, prompt, n)
    if mode.endswith("asd"):
        assert sum(r.asd_relaxed_token_num for r in mixed) > 0  # the budget was used


PACE_STEPS = 4


def test_paced_budget_by_hand():
    """About 1 / N of the tokens left, at least the floor, at most the budget; N = 0: the budget."""
    assert paced_budget([3000], 8, 2048) == 375
    assert paced_budget([1000, 2001], 8, 2048) == 376  # rounded up
    assert paced_budget([100], 8, 2048) == PACED_MIN_PREFILL_TOKENS == 256
    assert paced_budget([30000], 8, 2048) == 2048
    assert paced_budget([3000], 0, 2048) == 2048
    assert paced_budget([9], 4, 8, floor=1) == 3


@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["plain", "mtp", "asd", "dspark_asd"])
def test_paced_mixed_steps_spread_prompts_and_keep_outputs(tiny, mode, layout, monkeypatch):
    """--mixed_prefill_pace_steps: each mixed step takes the paced budget of the prompt tokens left (the floor
    lowered to 1 for the tiny prompts), fewer than the whole budget while little is left; every request's
    outputs stay one request at a time's."""
    m, drafts = tiny
    prompts = random_prompts(m.vocab_size, len(MAX_NEW), PROMPT_LENS, seed=7)
    kw = _mode_args(drafts, mode)
    alone, _ = _run(m.model_dir, prompts, 1, **kw)
    budgets = []

    def spy(remaining, pace_steps, budget, floor):
        out = paced_budget(remaining, pace_steps, budget, floor)
        budgets.append((sum(remaining), out))
        return out

    monkeypatch.setattr(chunked_prefill_impl, "paced_budget", spy)
    paced, calls = _run(m.model_dir, prompts, 3, layout, pace_min=1, mixed_prefill_pace_steps=PACE_STEPS, **kw)
    for a, b in zip(alone, paced):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
        assert b.accept_lens == a.accept_lens
    assert calls and budgets
    assert all(budget == min(CHUNK, max(1, -(-left // PACE_STEPS))) for left, budget in budgets)
    assert any(budget < min(CHUNK, left) for left, budget in budgets)  # paced: fewer tokens than it could take
    assert max(t for _, t in calls) <= CHUNK


EARLY_COUNTERS = ("mixed_early", "mixed_staged", "mixed_ahead", "decode_early")


@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_admission_behind_the_step_in_flight_keeps_outputs_and_launches_more_early(tiny, mode, layout):
    """--router_admit_behind_step: the step after the one in flight is launched before its commit even while
    requests wait, which join the step after it. Every request's outputs are still one request at a time's."""
    m, drafts = tiny
    prompts = random_prompts(m.vocab_size, len(MAX_NEW), PROMPT_LENS, seed=7)
    kw = dict(_mode_args(drafts, mode), router_max_wait_tokens=0)
    alone, _ = _run(m.model_dir, prompts, 1, **kw)
    before, after = dict.fromkeys(EARLY_COUNTERS, 0), dict.fromkeys(EARLY_COUNTERS, 0)
    _run(m.model_dir, prompts, 3, layout, counters=before, **kw)
    behind, _ = _run(m.model_dir, prompts, 3, layout, counters=after, router_admit_behind_step=True, **kw)
    for a, b in zip(alone, behind):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
        assert b.accept_lens == a.accept_lens
    if mode == "plain":  # these count mixed steps, which with MTP are not launched ahead of a commit
        assert sum(after.values()) > sum(before.values()), (before, after)


LEFT_COUNTERS = ("mixed_left", "mixed_ahead", "decode_after_mixed", "mixed_early", "decode_early")
LEFT_LONG_PROMPT, LEFT_MAX_NEW = 39, 24  # 5 chunks of CHUNK; 39 + 24 within max_req_total_len
# two requests run, the first ends early, the third joins while the second decodes (within max_req_total_len)
JOIN_PROMPT_LENS, JOIN_MAX_NEW = (10, 12, 30), (4, 40, 20)
JOIN_ASD_BUDGET = 1e6


@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["mtp", "asd", "dspark_asd"])
def test_mtp_mixed_steps_are_left_in_flight_with_the_same_outputs(tiny, mode, layout):
    """With MTP a mixed step is launched right after the commit before it and left in flight (the router's work
    runs under it); the step after a mixed step is staged once its result (the accept lengths) is on the host and
    launched before its commit; every request's outputs stay one request at a time's."""
    m, drafts = tiny
    # a short prompt decodes while a long one is prefilled in chunks; both admitted at once (no request waits,
    # so the step after a commit may be launched at once), the short one far from its last token at the end
    short, long_ = (random_prompts(m.vocab_size, 1, range(n, n + 1), seed=n)[0] for n in (3, LEFT_LONG_PROMPT))
    prompts, max_new = [short, long_, short], (LEFT_MAX_NEW,) * 3
    kw = dict(_mode_args(drafts, mode), router_max_wait_tokens=4, max_new=max_new)
    alone, _ = _run(m.model_dir, prompts, 1, **kw)
    counters = dict.fromkeys(LEFT_COUNTERS, 0)
    mixed, calls = _run(m.model_dir, prompts, len(prompts), layout, counters=counters, **kw)
    assert calls
    for a, b in zip(alone, mixed):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
        assert b.accept_lens == a.accept_lens
    assert counters["mixed_left"] > 0 and counters["decode_after_mixed"] > 0, counters
    # staged with the accept lengths of the mixed step before them and launched before its commit
    assert counters["mixed_early"] > 0 and counters["decode_early"] > 0, counters


JOIN_COUNTERS = ("mixed_staged", "mixed_undone", "mixed_left", "mixed_ahead", "decode_after_mixed")


@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["mtp", "asd", "dspark_asd"])
def test_a_prompt_joining_a_decode_step_in_flight_is_mixed_over_its_commit(tiny, mode, layout, monkeypatch):
    """MTP: a prompt admitted while a decode step is in flight (held by --router_max_wait_tokens until then; at 0
    the step before its admission is only committed, since a request waits): the mixed step that takes its first
    chunk is staged with the accept lengths the wait for that step brings, launched, and the step is committed
    under it (``_mix_over_commit``); outputs stay one request at a time's."""
    from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend, InFlightMixed

    m, drafts = tiny
    prompts = [random_prompts(m.vocab_size, 1, range(n, n + 1), seed=n)[0] for n in JOIN_PROMPT_LENS]
    kw = dict(_mode_args(drafts, mode), router_max_wait_tokens=4, max_new=JOIN_MAX_NEW)
    if mode != "mtp":  # a budget that relaxes most drafts: accept lengths above 1 at the join
        kw["mtp_asd_regret_budget"] = JOIN_ASD_BUDGET
    alone, _ = _run(m.model_dir, prompts, 1, **kw)
    # each kept step's decode rows start where the commit under it left each request (its accept length added)
    kept_gains = []
    mix = ChunkedPrefillBackend._mix_over_commit

    def spy(self, cur, decoding, prefilling):
        before = {r.req_idx: r.kv_len for r in cur.rows.reqs}
        updates = mix(self, cur, decoding, prefilling)
        if isinstance(self._inflight, InFlightMixed) and self._inflight.step.decoding:
            step = self._inflight.step
            for item, req in zip(step.batch.items, step.decoding):
                assert item.start == req.kv_len, (item.start, req.kv_len)
                kept_gains.append(req.kv_len - before.get(req.req_idx, req.kv_len))
        return updates

    monkeypatch.setattr(ChunkedPrefillBackend, "_mix_over_commit", spy)
    counters = dict.fromkeys(JOIN_COUNTERS, 0)
    joined, _ = _run(m.model_dir, prompts, len(prompts) - 1, layout, counters=counters, **kw)
    for a, b in zip(alone, joined):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
        assert b.accept_lens == a.accept_lens
    assert counters["mixed_staged"] > 0, counters
    if mode != "mtp":
        assert max(kept_gains) > 1, kept_gains  # some request accepted drafts in the step committed under it


def test_disable_mixed_steps_alternates(tiny):
    m, _ = tiny
    prompts = random_prompts(m.vocab_size, len(MAX_NEW), PROMPT_LENS, seed=8)
    res, calls = _run(m.model_dir, prompts, 3, disable_mixed_steps=True)
    assert not calls
    for prompt, n, r in zip(prompts, MAX_NEW, res):
        assert r.token_ids == hf_greedy(m.hf, prompt, n)


def test_mixed_steps_take_their_own_budget_prefill_steps_the_whole_one(tiny):
    """--mixed_max_prefill_tokens caps the prompt tokens of a step that also decodes; a step with nothing
    to decode (the first, here) still takes --batch_max_tokens; outputs stay transformers'."""
    m, _ = tiny
    mixed_budget = 3
    prompts = random_prompts(m.vocab_size, len(MAX_NEW), PROMPT_LENS, seed=9)
    eng = make_engine(m.model_dir, running_max_req_size=3, batch_max_tokens=CHUNK,
                      mixed_max_prefill_tokens=mixed_budget, **COMMON)
    b = eng.backend
    mixed_calls, prefill_calls = [], []
    launch, prefill = b.launch_mixed, b.prefill

    def spy_mixed(step):
        mixed_calls.append(sum(step.chunk_lens))
        return launch(step)

    def spy_prefill(reqs, chunk_lens, *args, **kwargs):
        prefill_calls.append(sum(chunk_lens))
        return prefill(reqs, chunk_lens, *args, **kwargs)

    b.launch_mixed, b.prefill = spy_mixed, spy_prefill
    res = eng.generate(prompts, [{"max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW])
    assert b.mixed_budget == mixed_budget
    assert mixed_calls and max(mixed_calls) == mixed_budget  # chunks of a longer prompt fill the budget
    assert prefill_calls[0] == CHUNK  # the first step: nothing decodes yet, three prompts of >= 3 tokens
    for prompt, n, r in zip(prompts, MAX_NEW, res):
        assert r.token_ids == hf_greedy(m.hf, prompt, n)


def test_stage_lays_out_decode_rows_then_chunks_hand_computed(tiny):
    """Two decode requests (K + 1 = 3 rows each) then a chunk of positions 4..6 of a prompt."""
    m, _ = tiny
    eng = make_engine(m.model_dir, running_max_req_size=4, **COMMON)
    rows = eng.backend.mixed_rows
    assert rows is not None and rows.ladder is None  # CPU: the items layout
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    items = [RowItem(0, 5, 3), RowItem(2, 9, 3), RowItem(1, 4, 3, prompt)]
    batch = rows.stage(items, torch.arange(100, 109))
    assert (batch.num_decode_rows, batch.num_rows, batch.first_row) == (6, 9, [0, 3, 6])
    assert rows.b_req_idx[:9].tolist() == [0, 0, 0, 2, 2, 2, 1, 1, 1]
    assert rows.b_seq_len[:9].tolist() == [6, 7, 8, 10, 11, 12, 5, 6, 7]
    assert rows.b_mtp_index[:9].tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 0]  # prefill rows: staged inputs
    assert rows.staged_ids[:9].tolist() == [GATHER_INPUT] * 6 + [15, 16, 17]
    assert rows.mem_indexes[:9].tolist() == list(range(100, 109))
    assert batch.sampled_rows([2]) == [0, 1, 2, 3, 4, 5, 8]
    with pytest.raises(ValueError, match="decode items come before"):
        rows.stage([RowItem(1, 4, 3, prompt), RowItem(0, 5, 3)], torch.arange(6))
