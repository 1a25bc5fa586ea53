"""The prompt cache end to end on CPU (prompt_cache.py): outputs do not depend on it.

Conversations as chat clients send them: a shared system prefix, then turn after turn that resends
the whole history (the previous prompt, the engine's own answer, a new question), with more
requests than --running_max_req_size so requests join while others decode. The reference for
every request is the same engine with --disable_dynamic_prompt_cache, and transformers' own
greedy generation where decoding is greedy and strict. Token ids must be equal; log-probs equal up
to float rounding (a cached prefix's KV came from another chunking of the same tokens).
"""
import random
from typing import Dict, List

import pytest
import torch

from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mtp_speculative.proposer import PrefixCacheRule
from lightllm.server.router.model_infer.prompt_cache import PromptCache
from lightllm.server.router.req_queue import ReqQueue
from unit_tests.models.tiny_checkpoints import tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine

K = 2
DSPARK_BLOCK = 4  # its K = 3
ASD_BUDGET = 3.0  # relaxes some tokens with the tiny eagle draft
SYSTEM_LEN = 20  # tokens of the prefix every conversation starts with
QUESTION_LENS = (3, 9)  # each turn's new tokens
CONVERSATIONS = 4
TURNS = 3
MAX_NEW = 6
COMMON = dict(max_req_total_len=96, max_total_token_num=1200, running_max_req_size=3, batch_max_tokens=16)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lightllm.models.dspark.train_module import random_dspark_draft

    root = tmp_path_factory.mktemp("prompt_cache")
    m = tiny_model("llama", seed=2, root=root)
    dspark = random_dspark_draft(m.hf.config, str(root / "dspark"), seed=3, block_size=DSPARK_BLOCK)
    return m, {"eagle": m.draft("eagle", True, 1, seed=4), "dspark": dspark}


def _mode_args(drafts: dict, mode: str) -> dict:
    if mode == "plain":
        return {}
    if mode == "dspark":  # context K/V per position from the target alone: outputs are cached too
        return dict(mtp_mode="dspark", mtp_step=DSPARK_BLOCK - 1, mtp_draft_model_dir=[drafts["dspark"]])
    eagle = drafts["eagle"]
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[eagle])
    if mode == "mtp":
        return mtp
    return dict(mtp, mtp_asd_regret_budget={"asd0": 0.0, "asd": ASD_BUDGET}[mode])


def _questions(vocab: int, seed: int) -> List[List[List[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(vocab) for _ in range(rng.randint(*QUESTION_LENS))] for _ in range(TURNS)]
            for _ in range(CONVERSATIONS)]


def _draft_kv_after_prefill(captured: Dict[tuple, torch.Tensor]):
    """An on_step hook: the eagle draft's K of every prompt position of each request, once its
    prefill is done (before it decodes), by prompt."""
    def hook(router) -> None:
        b = router.backend
        for r in router.running:
            key = tuple(r.prompt_ids)
            if b.draft is None or key in captured or r.kv_len != r.prompt_len or len(r.output_ids) != 1:
                continue
            slots = b.req_manager.req_to_token_indexs[r.req_idx, :r.prompt_len]
            captured[key] = b.draft.model.mem_manager.k_buffer[:, slots].clone()

    return hook


def _chat(eng, system: List[int], questions, max_new: int = MAX_NEW, captured=None):
    """Every conversation's turns, the turns of all conversations sent together; returns the prompts
    and results per turn."""
    histories = [list(system) for _ in questions]
    turns = []
    hook = _draft_kv_after_prefill(captured) if captured is not None else None
    for t in range(TURNS):
        prompts = [h + q[t] for h, q in zip(histories, questions)]
        res = eng.generate(prompts, [{"max_new_tokens": max_new, "ignore_eos": True}] * len(prompts), on_step=hook)
        assert all(r.finish_reason == "length" for r in res), [r.error for r in res]
        histories = [p + r.token_ids for p, r in zip(prompts, res)]
        turns.append((prompts, res))
    return turns


def _all_kv_back(backend) -> bool:
    mem, cache = backend.mem_manager, backend.prompt_cache
    cached = cache.stats().cached_tokens if cache is not None else 0  # slots the tree holds
    return mem.can_use_mem_size + cached == mem.size and (cache is None or cache.locked_tokens == 0)


@pytest.mark.parametrize("mode", ["plain", "plain_behind", "mtp", "asd0", "asd", "dspark"])
def test_conversations_give_the_same_outputs_with_and_without_the_cache(tiny, mode):
    """``plain_behind``: plain decoding with --router_admit_behind_step (requests join behind a step in flight)."""
    m, drafts = tiny
    behind = mode == "plain_behind"
    mode = "plain" if behind else mode
    kw = dict(_mode_args(drafts, mode), router_admit_behind_step=behind)
    system = random.Random(1).choices(range(m.vocab_size), k=SYSTEM_LEN)
    questions = _questions(m.vocab_size, seed=3)
    off = make_engine(m.model_dir, disable_dynamic_prompt_cache=True, **COMMON, **kw)
    on = make_engine(m.model_dir, **COMMON, **kw)
    assert off.backend.prompt_cache is None and on.backend.prompt_cache is not None
    kv_off, kv_on = {}, {}
    ref, got = _chat(off, system, questions, captured=kv_off), _chat(on, system, questions, captured=kv_on)
    window = K if mode in ("mtp", "asd0", "asd") else 0
    if mode != "plain":  # the draft's KV of every prompt position, cached or not, is what a prefill computes
        assert kv_on.keys() == kv_off.keys() and len(kv_on) == CONVERSATIONS * TURNS
        for key in kv_off:
            torch.testing.assert_close(kv_on[key], kv_off[key], atol=1e-5, rtol=1e-5)
    for t, ((prompts, a), (_, b)) in enumerate(zip(ref, got)):
        for prompt, ra, rb in zip(prompts, a, b):
            assert rb.token_ids == ra.token_ids
            assert rb.logprobs == pytest.approx(ra.logprobs, abs=LOGPROB_TOL)
            assert rb.accept_lens == ra.accept_lens  # the draft proposed the same: its cached KV is exact
            assert ra.prompt_cached_tokens == 0
            assert rb.prompt_cached_tokens <= len(prompt) - 1  # the last prompt token is always prefilled
        if t:  # a later turn reuses its previous turn (eagle: all but its last K prompt tokens)
            prev_prompts, prev_res = ref[t - 1]
            for p, r, rb in zip(prev_prompts, prev_res, b):
                kept = len(p) - window if window else len(p) + len(r.token_ids) - 1
                assert rb.prompt_cached_tokens >= kept
    first = [r.prompt_cached_tokens for r in got[0][1]]
    assert max(first) >= SYSTEM_LEN - window  # the shared system prompt, from a conversation admitted earlier
    if mode != "asd":  # greedy, strictly verified: transformers' tokens
        for prompts, res in got:
            for p, r in zip(prompts, res):
                assert r.token_ids == hf_greedy(m.hf, p, MAX_NEW)
    if mode == "asd":
        assert sum(r.asd_relaxed_token_num for _, res in got for r in res) > 0  # the budget was used
    assert _all_kv_back(on.backend) and _all_kv_back(off.backend)
    stats = on.backend.prompt_cache.stats()
    assert stats.hit_tokens_total == sum(r.prompt_cached_tokens for _, res in got for r in res)
    assert stats.hit_tokens_total + stats.computed_tokens_total == sum(len(p) for ps, _ in got for p in ps)


def test_a_small_pool_evicts_and_keeps_every_output(tiny):
    """A pool that holds a few requests at once: the cache gives way (evictions), nothing fails."""
    m, _ = tiny
    system = random.Random(5).choices(range(m.vocab_size), k=SYSTEM_LEN)
    questions = _questions(m.vocab_size, seed=6)
    small = dict(COMMON, max_total_token_num=120)
    off = make_engine(m.model_dir, disable_dynamic_prompt_cache=True, **small)
    on = make_engine(m.model_dir, **small)
    ref, got = _chat(off, system, questions), _chat(on, system, questions)
    for (_, a), (_, b) in zip(ref, got):
        assert [r.token_ids for r in b] == [r.token_ids for r in a]
    assert on.backend.prompt_cache.tree.evicted_tokens > 0
    assert sum(r.prompt_cached_tokens for _, res in got for r in res) > 0
    assert _all_kv_back(on.backend)


def _req(req_id: int, prompt: List[int], max_new: int = 4) -> InferReq:
    return InferReq(req_id, prompt, SamplingParams(max_new_tokens=max_new), [])


def test_admission_counts_a_shared_prefix_once_hand_computed():
    """Pool of 40 slots. A finished request left 10 prompt tokens in the tree; two requests of 12
    tokens share those 10 (the match stops before the last prompt token): each reserves its 2 own
    prompt tokens + 4 new, and the 10 locked tokens count once: 6 + 6 + 10 = 22 of 40."""
    mem = MemoryManager(40, torch.float32, 1, 1, 1, "cpu")
    cache = PromptCache(mem, PrefixCacheRule())
    prefix = list(range(100, 110))
    done = _req(0, prefix, max_new=1)
    cache.lock(done, cache.match(done))  # admitted with nothing cached
    assert done.prompt_cached_len == 0
    done.slots = mem.alloc(10).tolist()
    done.kv_len = 10
    cache.release(done)
    assert (cache.tree.total_tokens, mem.can_use_mem_size) == (10, 30)
    q = ReqQueue(40, running_max_req_size=8, mtp_step=0, prompt_cache=cache)
    a, b = _req(1, prefix + [1, 2]), _req(2, prefix + [3, 4])
    q.append(a)
    q.append(b)
    assert q.pop_admissible(0) == [a, b]
    assert (a.prompt_cached_len, b.prompt_cached_len) == (10, 10)
    assert (a.kv_reserved, b.kv_reserved, q.reserved_tokens, cache.locked_tokens) == (6, 6, 12, 10)
    # 12 + 10 locked + 19 > 40: a 15-token prompt with 4 new tokens (nothing shared) waits
    c = _req(3, list(range(200, 215)))
    q.append(c)
    assert q.pop_admissible(2) == []
    q.release(a)
    assert q.reserved_tokens == 6 and a.kv_reserved == 0
    assert q.pop_admissible(1) == [c]


def test_a_waiting_head_that_cannot_fit_is_not_matched():
    """The tree is walked for the waiting head only when it could fit with its whole prompt but
    the last token cached: not while the running rows are full, nor while its least reservation
    (1 + 4 new tokens) exceeds the pool; its admission is the same as before."""
    mem = MemoryManager(40, torch.float32, 1, 1, 1, "cpu")
    cache = PromptCache(mem, PrefixCacheRule())
    walks = []
    match = cache.match
    cache.match = lambda req: walks.append(req.req_id) or match(req)
    q = ReqQueue(40, running_max_req_size=2, mtp_step=0, prompt_cache=cache)
    head = _req(1, list(range(100, 112)))
    q.append(head)
    assert q.pop_admissible(2) == [] and walks == []  # no running row free
    q.reserved_per_group[0] = 36  # 36 + 1 + 4 > 40
    assert q.pop_admissible(0) == [] and walks == []
    q.reserved_per_group[0] = 35  # 35 + 1 + 4 fits at best; with nothing cached (12 + 4) it does not
    assert q.pop_admissible(0) == [] and walks == [1]
    q.reserved_per_group[0] = 24
    assert q.pop_admissible(0) == [head] and walks == [1, 1] and head.kv_reserved == 16


def test_a_prompt_is_cached_when_its_prefill_is_done_hand_computed():
    """Pool of 40. A 12-token prompt whose first 10 tokens are cached reserves 2 + 4 = 6. When its
    prefill is done the tree takes its 2 slots (reservation 4, 12 tokens locked); a request that
    arrives meanwhile with the same 12 tokens and one more matches all 12. When the first ends it
    frees none of its prompt's slots (the tree has them); only its decoded slots go back."""
    mem = MemoryManager(40, torch.float32, 1, 1, 1, "cpu")
    cache = PromptCache(mem, PrefixCacheRule(cache_decoded=False))
    prefix = list(range(100, 110))
    done = _req(0, prefix, max_new=1)
    cache.lock(done, cache.match(done))
    done.slots, done.kv_len = mem.alloc(10).tolist(), 10
    cache.release(done)
    q = ReqQueue(40, running_max_req_size=8, mtp_step=0, prompt_cache=cache)
    a = _req(1, prefix + [1, 2])
    q.append(a)
    assert q.pop_admissible(0) == [a] and (a.prompt_cached_len, a.kv_reserved, cache.locked_tokens) == (10, 6, 10)
    a.slots, a.kv_len = mem.alloc(2).tolist(), 12  # its prefill
    q.unreserve(a, cache.cache_prompt(a))
    assert (a.kv_reserved, q.reserved_tokens, cache.tree.total_tokens, cache.locked_tokens) == (4, 4, 12, 12)
    b = _req(2, prefix + [1, 2, 3])
    q.append(b)
    assert q.pop_admissible(1) == [b] and b.prompt_cached_len == 12 and b.kv_reserved == 5
    a.slots += mem.alloc(3).tolist()  # 3 decoded positions: not cached (cache_decoded=False)
    a.output_ids, a.kv_len = [7, 8, 9], 15
    free_before = mem.can_use_mem_size
    cache.release(a)
    q.release(a)
    assert mem.can_use_mem_size == free_before + 3 and cache.tree.total_tokens == 12
    assert cache.locked_tokens == 12  # b's lock
    assert q.reserved_tokens == 5


def test_eviction_frees_the_oldest_paths_real_slots_in_one_call_hand_computed():
    """Draft window 2: a finished 6-token prompt leaves 6 tree tokens, the first 2 holding no slot, and 4 slots
    (positions 0..3, filed under tokens 2..5); its positions 4, 5 go back at release. Two such prompts hold 8 of
    40 slots. A match of the newer path's first 3 tokens splits it in two nodes. Evicting 3 takes the older path
    whole (4 slots), then the rest takes both nodes of the other, their slots in one free."""
    mem = MemoryManager(40, torch.float32, 1, 1, 1, "cpu")
    cache = PromptCache(mem, PrefixCacheRule(draft_window=2, cache_decoded=False))
    slots = {}
    for i, prompt in enumerate([list(range(100, 106)), list(range(200, 206))]):
        r = _req(i, prompt, max_new=1)
        cache.lock(r, cache.match(r))
        slots[i] = mem.alloc(6).tolist()
        r.slots, r.kv_len = list(slots[i]), 6
        cache.release(r)
    assert (mem.can_use_mem_size, cache.tree.total_tokens, cache.stats().cached_tokens) == (32, 12, 8)
    assert cache.tree.match_prefix(list(range(200, 203))).length == 3 and cache.tree.num_nodes == 3
    calls = []

    def free(s: torch.Tensor) -> None:
        calls.append(sorted(s.tolist()))
        mem.free(s)

    assert cache.evict(3, free) == 4
    assert calls == [sorted(slots[0][:4])]
    assert (mem.can_use_mem_size, cache.tree.total_tokens, cache.stats().cached_tokens) == (36, 6, 4)
    assert cache.evict(100, free) == 4 and calls[1:] == [sorted(slots[1][:4])]
    assert (mem.can_use_mem_size, cache.tree.total_tokens, cache.stats().cached_tokens) == (40, 0, 0)
    assert cache.evict(1, free) == 0 and len(calls) == 2  # nothing left: no call


def _drive(eng, arrivals, max_new: int):
    """Step the router by hand: ``arrivals`` [(step, prompt)] join at their step. Returns per
    request (token ids, log-probs, accept lens, prompt_cached_tokens) and, per arrival, whether an
    earlier request was still running then. Checks every step that what requests hold beyond the
    tree fits in their reservations."""
    from lightllm.server.core.objs.messages import AddReq

    router, backend = eng.router, eng.backend
    mem, cache = backend.mem_manager, backend.prompt_cache
    out = {i: ([], [], [], 0) for i in range(len(arrivals))}
    overlapped = []
    step = 0
    pending = list(enumerate(arrivals))
    while pending or router.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt) = pending.pop(0)
            overlapped.append(bool(router.running))
            router.add_req(AddReq(i, list(prompt), SamplingParams(max_new_tokens=max_new, ignore_eos=True), [], 0.0))
        for u in router.step():
            ids, lps, lens, _ = out[u.req_id]
            assert u.error is None, u.error
            ids += u.token_ids
            lps += u.logprobs
            if u.accept_len:
                lens.append(u.accept_len)
            out[u.req_id] = (ids, lps, lens, u.prompt_cached_tokens)
        held = mem.size - mem.can_use_mem_size - cache.stats().cached_tokens
        assert held <= router.queue.reserved_tokens
        step += 1
    return out, overlapped


@pytest.mark.parametrize("mode", ["plain", "mtp", "dspark"])
def test_a_request_that_arrives_while_another_decodes_shares_its_prompt(tiny, mode):
    """A request with the same system prompt that arrives after the first one's prefill, while it
    decodes, takes that prompt from the cache (cached at the end of the prefill, not at the end of
    the request); outputs equal the uncached engine's, request by request."""
    m, drafts = tiny
    kw = _mode_args(drafts, mode)
    system = random.Random(7).choices(range(m.vocab_size), k=SYSTEM_LEN)
    qs = _questions(m.vocab_size, seed=8)
    prompts = [system + qs[0][0], system + qs[1][0], system + qs[0][0] + qs[2][1]]
    long_new = 12
    on = make_engine(m.model_dir, **COMMON, **kw)
    # batch_max_tokens 16: the first prompt's prefill takes 2 steps; the others come at steps 3 and 5
    got, overlapped = _drive(on, [(0, prompts[0]), (3, prompts[1]), (5, prompts[2])], long_new)
    assert overlapped == [False, True, True]  # each came while the first one was still decoding
    window = K if mode == "mtp" else 0
    assert got[1][3] >= SYSTEM_LEN - window and got[2][3] >= len(prompts[0]) - window
    off = make_engine(m.model_dir, disable_dynamic_prompt_cache=True, **COMMON, **kw)
    for i, p in enumerate(prompts):
        ref = off.generate([p], [{"max_new_tokens": long_new, "ignore_eos": True}])[0]
        assert got[i][0] == ref.token_ids
        assert got[i][1] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
        assert got[i][2] == ref.accept_lens
    assert _all_kv_back(on.backend)


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_requests_admitted_together_point_at_their_own_cached_prefixes(tiny, mode):
    """Two requests that join at the same step, one sharing the first prompt's system part and one its whole
    prompt, are admitted in one batch (their cached slots go to the slot table in one scatter): each reads its
    own prefix; outputs equal the uncached engine's."""
    m, drafts = tiny
    kw = _mode_args(drafts, mode)
    system = random.Random(9).choices(range(m.vocab_size), k=SYSTEM_LEN)
    qs = _questions(m.vocab_size, seed=10)
    prompts = [system + qs[0][0], system + qs[1][0], system + qs[0][0] + qs[2][1]]
    on = make_engine(m.model_dir, **COMMON, **kw)
    admitted = []
    point = on.backend._point_at_prefixes

    def record(reqs):
        admitted.append(sorted((r.req_id, r.prompt_cached_len) for r in reqs))
        point(reqs)

    on.backend._point_at_prefixes = record
    got, overlapped = _drive(on, [(0, prompts[0]), (3, prompts[1]), (3, prompts[2])], MAX_NEW)
    assert overlapped == [False, True, True]
    window = K if mode == "mtp" else 0
    together = [batch for batch in admitted if len(batch) == 2]
    assert together and [i for i, _ in together[0]] == [1, 2]
    (_, first), (_, second) = together[0]
    assert first >= SYSTEM_LEN - window and second >= len(prompts[0]) - window and first < second
    off = make_engine(m.model_dir, disable_dynamic_prompt_cache=True, **COMMON, **kw)
    for i, p in enumerate(prompts):
        ref = off.generate([p], [{"max_new_tokens": MAX_NEW, "ignore_eos": True}])[0]
        assert got[i][0] == ref.token_ids
        assert got[i][1] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    assert _all_kv_back(on.backend)
