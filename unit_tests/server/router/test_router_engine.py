"""Continuous batching on tiny random models: every request gets exactly transformers' answer."""
import pytest

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
    assert eng.backend.mem_manager.can_use_mem_size == eng.backend.mem_manager.size


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
    assert [u.finish_reason for u in ups] == ["abort", "abort"]
    assert mem.can_use_mem_size == mem.size and not router.has_work
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
