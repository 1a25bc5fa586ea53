"""Continuous batching on tiny random models: every request gets exactly transformers' answer."""
import pytest

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.server.router.manager import BatchClock, StepTiming, decode_batch_bucket
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine

PROMPT_LENGTHS = range(1, 40)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return tiny_model(request.param, seed=1, root=tmp_path_factory.mktemp(request.param))


def test_many_concurrent_requests_match_transformers(tiny):
    hf, d = tiny.hf, tiny.model_dir
    prompts = random_prompts(hf.config.vocab_size, 12, PROMPT_LENGTHS)
    lens = [3 + (i * 5) % 17 for i in range(len(prompts))]
    eng = make_engine(d, max_req_total_len=96, running_max_req_size=5, batch_max_tokens=64,
                      max_total_token_num=400)
    res = eng.generate(prompts, [{"max_new_tokens": n, "ignore_eos": True} for n in lens])
    for i, p in enumerate(prompts):
        assert res[i].token_ids == hf_greedy(hf, p, lens[i]), f"request {i}"
        assert res[i].finish_reason == "length"
    assert eng.backend.mem_manager.available_size == eng.backend.mem_manager.size


def test_chunked_prefill_of_a_long_prompt(tiny):
    hf, d = tiny.hf, tiny.model_dir
    prompt = random_prompts(hf.config.vocab_size, 1, PROMPT_LENGTHS, seed=3)[0] * 4  # ~ up to 160 tokens
    eng = make_engine(d, max_req_total_len=220, batch_max_tokens=16, max_total_token_num=400)
    steps = []
    res = eng.generate([prompt], [{"max_new_tokens": 8, "ignore_eos": True}], on_step=lambda r: steps.append(1))
    assert res[0].token_ids == hf_greedy(hf, prompt, 8)
    assert len(steps) >= len(prompt) // 16  # really prefilled in chunks


def test_eos_stop_sequence_and_length(tiny):
    hf, d = tiny.hf, tiny.model_dir
    prompt = random_prompts(hf.config.vocab_size, 1, PROMPT_LENGTHS, seed=5)[0]
    ref = hf_greedy(hf, prompt, 12)
    eng = make_engine(d, max_req_total_len=96, max_total_token_num=400)
    # eos = the 4th reference token: the request ends right there, eos included
    res = eng.generate([prompt], [{"max_new_tokens": 12}], eos_token_ids=[ref[3]])
    first = ref.index(ref[3])
    assert res[0].token_ids == ref[: first + 1] and res[0].finish_reason == "eos"
    res = eng.generate([prompt], [{"max_new_tokens": 12, "ignore_eos": True}], eos_token_ids=[ref[3]])
    assert res[0].token_ids == ref and res[0].finish_reason == "length"
    # a stop sequence given as token ids ends the request after it
    from lightllm.server.core.objs.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[ref[5:7]])
    res = eng.generate([prompt], [sp])
    end = next(i for i in range(2, 13) if ref[i - 2:i] == ref[5:7])
    assert res[0].token_ids == ref[:end] and res[0].finish_reason == "stop"


def test_abort_frees_kv_at_once(tiny):
    d = tiny.model_dir
    router = make_engine(d, max_req_total_len=96, max_total_token_num=400).router
    from lightllm.server.core.objs.sampling_params import SamplingParams
    from lightllm.server.router.manager import AddReq

    router.add_req(AddReq(1, [1, 2, 3, 4], SamplingParams.from_request({"max_new_tokens": 50}), [], 0.0))
    router.add_req(AddReq(2, [5, 6], SamplingParams.from_request({"max_new_tokens": 50}), [], 0.0))
    for _ in range(3):
        router.step()
    mem = router.backend.mem_manager
    assert mem.can_use_mem_size < mem.size
    ups = router.abort(1) + router.abort(2)
    assert [u.finish_reason for u in ups if u.finish_reason] == ["abort", "abort"]
    # the decode step in flight at the first abort (overlap) is committed for the other request
    assert all(u.req_id == 2 and u.token_ids for u in ups if u.finish_reason is None)
    assert mem.available_size == mem.size and not router.has_work
    assert router.queue.reserved_tokens == 0


def test_kv_pool_exhaustion_requests_wait(tiny):
    hf, d = tiny.hf, tiny.model_dir
    prompts = random_prompts(hf.config.vocab_size, 6, PROMPT_LENGTHS, seed=7)
    # each request reserves prompt + 20 tokens; the pool fits about two at once
    eng = make_engine(d, max_req_total_len=64, max_total_token_num=64 + 30)
    max_running = []
    res = eng.generate(prompts, [{"max_new_tokens": 20, "ignore_eos": True}] * 6,
                       on_step=lambda r: max_running.append(len(r.running)))
    assert max(max_running) < 6
    for i, p in enumerate(prompts):
        assert res[i].token_ids == hf_greedy(hf, p, 20)


def test_step_clock_counts_decode_steps_apart(tiny):
    """The engine's clock (StepTiming): prefill chunks and decode steps both count as batch steps;
    the decode clock counts only the decode steps (one per new token after the first, here)."""
    prompt = random_prompts(tiny.hf.config.vocab_size, 1, range(40, 41), seed=7)[0]
    chunk, new_tokens = 16, 6
    eng = make_engine(tiny.model_dir, max_req_total_len=96, batch_max_tokens=chunk, max_total_token_num=400)
    eng.router.take_timing()
    eng.generate([prompt], [{"max_new_tokens": new_tokens, "ignore_eos": True}])
    t = eng.router.take_timing()
    prefill_steps = -(-len(prompt) // chunk)
    assert t.decode_steps == new_tokens - 1
    assert t.steps == prefill_steps + t.decode_steps
    assert t.decode_batch_reqs == t.decode_steps and t.batch_reqs == t.steps  # one request throughout
    assert 0 < t.decode_seconds < t.seconds
    assert list(t.decode_by_batch) == [1] and t.decode_by_batch[1].steps == t.decode_steps


def test_step_clock_by_decode_batch(tiny):
    """Decode steps are also filed by how many requests they decoded (on CPU, no graph ladder:
    the exact count): three requests prefilled together, finishing after 3, 5 and 8 tokens, decode
    2 steps with 3 requests, 2 with 2 and 3 with 1."""
    prompts = random_prompts(tiny.hf.config.vocab_size, 3, range(8, 12), seed=9)
    eng = make_engine(tiny.model_dir, max_req_total_len=64, batch_max_tokens=64, max_total_token_num=400)
    eng.router.take_timing()
    eng.generate(prompts, [{"max_new_tokens": n, "ignore_eos": True} for n in (3, 5, 8)])
    t = eng.router.take_timing()
    assert {b: (c.steps, c.reqs) for b, c in t.decode_by_batch.items()} == {3: (2, 6), 2: (2, 4), 1: (3, 3)}
    assert sum(c.steps for c in t.decode_by_batch.values()) == t.decode_steps == 7
    assert sum(c.seconds for c in t.decode_by_batch.values()) == pytest.approx(t.decode_seconds)
    assert all(c.seconds > 0 for c in t.decode_by_batch.values())


def test_decode_batch_buckets_follow_the_graph_ladder():
    ladder = GraphLadder.from_flags(64, 32, 16)  # 1, 2, 4, 8, 16, 32, 48, 64
    assert [decode_batch_bucket(n, ladder) for n in (1, 3, 5, 32, 33, 49, 64, 65, 100)] == [
        1, 4, 8, 32, 48, 64, 64, 65, 100]  # above the ladder (eager): the exact count
    assert decode_batch_bucket(5, None) == 5
    t = StepTiming()
    t.add(0.5, 60, decode=False)  # a prefill step
    t.add(0.25, 60, decode=True, decoded_reqs=40, ladder=ladder)
    t.add(0.5, 60, decode=True, decoded_reqs=48, ladder=ladder)
    t.add(0.125, 3, decode=True, decoded_reqs=3, ladder=ladder)
    t.add(0.0625, 2, decode=True)  # a decode step that decoded nothing: not filed
    assert (t.steps, t.decode_steps, t.decode_batch_reqs) == (5, 4, 125)
    assert t.decode_by_batch == {48: BatchClock(0.75, 2, 88), 4: BatchClock(0.125, 1, 3)}


class _Stepper:
    """Steps a router, collecting tokens and counting its decode-only forwards."""

    def __init__(self, router):
        self.router, self.out, self.decode_forwards = router, {}, 0

    def step(self) -> None:
        for u in self.router.step():
            self.out.setdefault(u.req_id, []).extend(u.token_ids)
        result = self.router.last_result
        if result is not None and not result.prefilled:
            self.decode_forwards += result.steps
        if result is not None and result.launched_decode_reqs:  # launched after a mixed step's commit
            self.decode_forwards += 1

    def until_running(self, req_id: int, max_steps: int = 50) -> int:
        """Step until ``req_id`` runs; the decode forwards run before the step that admitted it."""
        for _ in range(max_steps):
            before = self.decode_forwards
            self.step()
            if any(r.req_id == req_id for r in self.router.running):
                return before
        raise AssertionError(f"request {req_id} was not admitted in {max_steps} steps")


@pytest.mark.parametrize("wait", [0, 3])
def test_router_max_wait_tokens_groups_arrivals_and_keeps_the_tokens(tiny, wait):
    """--router_max_wait_tokens N: a request arriving while others decode joins once N decode forwards ran
    since the last admission (0: at the next step); one arriving while a prompt is still being prefilled
    joins at once. Every request still gets transformers' greedy tokens."""
    from lightllm.server.core.objs.sampling_params import SamplingParams
    from lightllm.server.router.manager import AddReq

    hf, d = tiny.hf, tiny.model_dir
    prompts = random_prompts(hf.config.vocab_size, 3, range(4, 12), seed=9)  # one chunk each
    long_prompt = random_prompts(hf.config.vocab_size, 1, range(40, 41), seed=10)[0]  # three chunks
    eng = make_engine(d, max_req_total_len=96, running_max_req_size=4, batch_max_tokens=16, max_total_token_num=400,
                      router_max_wait_tokens=wait)
    router, new = eng.router, 20
    s = _Stepper(router)

    def add(i, prompt) -> int:
        router.add_req(AddReq(i, list(prompt), SamplingParams(max_new_tokens=new, ignore_eos=True), [], 0.0))
        return s.decode_forwards

    added = add(0, prompts[0])
    joined = s.until_running(0)
    assert joined == added  # nothing runs: at once
    s.step()
    s.step()  # request 0 decodes
    added = add(1, prompts[1])
    assert added > joined
    joined, last = s.until_running(1), joined
    assert joined == (added if wait == 0 else last + max(wait, added - last))
    while any(r.in_prefill for r in router.running):
        s.step()
    added = add(2, long_prompt)
    joined, last = s.until_running(2), joined
    assert joined == (added if wait == 0 else last + wait)
    added = add(3, prompts[2])
    assert any(r.in_prefill for r in router.running)  # request 2's prompt: the next step is a mixed one anyway
    assert s.until_running(3) == added
    while router.has_work:
        s.step()
    for i, p in enumerate([prompts[0], prompts[1], long_prompt, prompts[2]]):
        assert s.out[i] == hf_greedy(hf, p, new), f"request {i}"


def test_negative_router_max_wait_tokens_fails_at_start_up():
    from lightllm.server.api_start import StartArgsError, validate_start_args
    from lightllm.server.core.objs.start_args_type import StartArgs

    with pytest.raises(StartArgsError, match="--router_max_wait_tokens: must be >= 0"):
        validate_start_args(StartArgs(router_max_wait_tokens=-1))
