"""Issue 13, item 1 (worker half): a request the worker cannot serve fails alone.

Values that pass (or bypass) HTTP validation but not the worker's tables fail their request
with finish_reason "error" and a message naming the field; the other requests finish
token-identical to a run without it. A batch step that raises fails the requests of that
step, gives back every KV slot and req_idx row, and the router keeps serving. Seeds of any
size are served (seed + position overflowed torch.Generator.manual_seed).
"""
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest

from lightllm.common import req_manager
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.manager import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    AddReq,
    RouterManager,
    serve_steps,
)
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ModeBackend
from lightllm.utils.dist_utils import single_rank_context
from unit_tests.devices import needs_triton_cpu
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import make_engine

ENGINE = dict(max_req_total_len=96, running_max_req_size=4, batch_max_tokens=48, max_total_token_num=500)
MAX_IDLE_STEPS = 200  # a test router that makes no progress this long is stuck
# Ordinary requests served beside the poisoned one: greedy, penalized, seeded sampled.
ORDINARY = [
    {"max_new_tokens": 9, "ignore_eos": True},
    {"max_new_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
    {"max_new_tokens": 8, "ignore_eos": True, "do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 7},
    {"max_new_tokens": 5, "ignore_eos": True, "logit_bias": {"3": 2.5}},
]


@dataclass
class Result:
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model("llama", seed=11, root=tmp_path_factory.mktemp("survival"))


def _router(tiny, **kw) -> RouterManager:
    return make_engine(tiny.model_dir, **{**ENGINE, **kw}).router


def _prompts(vocab: int, n: int, seed: int = 0) -> List[List[int]]:
    return random_prompts(vocab, n, range(2, 25), seed)


def _params(raw: dict, **bypass) -> SamplingParams:
    """Validated parameters, then raw fields set past validation (what a hole in it lets through)."""
    sp = SamplingParams.from_request(dict(raw))
    for name, value in bypass.items():
        object.__setattr__(sp, name, value)  # SamplingParams is frozen
    return sp


def _run(router: RouterManager, msgs: List[AddReq],
         joining: Optional[Dict[int, List[AddReq]]] = None) -> Dict[int, Result]:
    """Submit ``msgs`` (and ``joining[n]`` before step n) and step until every request finished; results
    by req_id."""
    joining = dict(joining or {})
    results = {m.req_id: Result() for m in msgs + [m for later in joining.values() for m in later]}
    for m in msgs:
        router.add_req(m)
    idle = steps = 0
    while router.has_work or joining:
        for m in joining.pop(steps, []):
            router.add_req(m)
        steps += 1
        updates = router.step()
        idle = 0 if updates else idle + 1
        assert idle < MAX_IDLE_STEPS, "router made no progress"
        for u in updates:
            r = results[u.req_id]
            r.token_ids.extend(u.token_ids)
            u.copy_totals_to(r)
    return results


def _msgs(prompts, params, first_id: int = 0, asd_budgets=None) -> List[AddReq]:
    budgets = asd_budgets or [0.0] * len(prompts)
    return [AddReq(first_id + i, list(p), sp if isinstance(sp, SamplingParams) else _params(sp), [], b)
            for i, (p, sp, b) in enumerate(zip(prompts, params, budgets))]


def _assert_pools_whole(router: RouterManager) -> None:
    backend = router.backend
    assert backend.mem_manager.available_size == backend.mem_manager.size
    assert backend.req_manager.can_alloc_num == backend.req_manager.max_request_num
    assert router.queue.reserved_tokens == 0 and not router.running


POISONS = {
    # field: (request JSON, the raw value set after validation)
    "top_k": ({"do_sample": True}, dict(top_k=2**31)),
    "temperature": ({"do_sample": True}, dict(temperature=1e39)),
    "repetition_penalty": ({}, dict(repetition_penalty=1e39)),
    "presence_penalty": ({}, dict(presence_penalty=-1e39)),
    "top_p": ({"do_sample": True}, dict(top_p=float("nan"))),
    "logit_bias": ({}, dict(logit_bias={10**6: 1.0})),
    "max_new_tokens": ({}, dict(max_new_tokens=10**6)),
    "top_logprobs": ({}, dict(top_logprobs=10**6)),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_request_fails_alone_and_the_others_are_unchanged(tiny, poison):
    vocab = tiny.vocab_size
    prompts = _prompts(vocab, len(ORDINARY) + 1)
    reference = _run(_router(tiny), _msgs(prompts[:-1], ORDINARY))
    raw, bypass = POISONS[poison]
    bad = _params({"max_new_tokens": 4, **raw}, **bypass)
    # the poisoned request sits in the middle of the batch
    params = ORDINARY[:2] + [bad] + ORDINARY[2:]
    order = prompts[:2] + [prompts[-1]] + prompts[2:-1]
    router = _router(tiny)
    res = _run(router, _msgs(order, params))
    failed = res.pop(2)
    assert failed.finish_reason == FinishReason.ERROR and failed.token_ids == []
    assert failed.error is not None and poison in failed.error
    got = [res[i] for i in sorted(res)]
    for ref, r in zip([reference[i] for i in sorted(reference)], got):
        assert r.finish_reason == ref.finish_reason == FinishReason.LENGTH and r.error is None
        assert r.token_ids == ref.token_ids
    _assert_pools_whole(router)


def test_prompt_token_outside_the_vocabulary_fails_alone(tiny):
    vocab = tiny.vocab_size
    prompts = _prompts(vocab, 2)
    router = _router(tiny)
    res = _run(router, _msgs([prompts[0], [1, vocab + 3, 2], prompts[1]], [ORDINARY[0]] * 3))
    assert res[1].finish_reason == FinishReason.ERROR and "inputs" in res[1].error
    assert res[0].token_ids == _run(_router(tiny), _msgs([prompts[0]], [ORDINARY[0]]))[0].token_ids
    assert len(res[2].token_ids) == ORDINARY[0]["max_new_tokens"]
    _assert_pools_whole(router)


def test_huge_asd_budget_fails_alone(tiny):
    draft = tiny.draft("weak_draft", True, 1, seed=5, std=0.02)
    asd = dict(mtp_mode="eagle_with_att", mtp_step=2, mtp_draft_model_dir=[draft], mtp_asd_regret_budget=2.0)
    prompts = _prompts(tiny.vocab_size, 3, seed=4)
    greedy = [ORDINARY[0]] * 3
    reference = _run(_router(tiny, **asd), _msgs([prompts[0], prompts[2]], greedy[:2], asd_budgets=[2.0, 2.0]))
    router = _router(tiny, **asd)
    res = _run(router, _msgs(prompts, greedy, asd_budgets=[2.0, 1e39, 2.0]))
    assert res[1].finish_reason == FinishReason.ERROR and "asd_regret_budget" in res[1].error
    assert res[0].token_ids == reference[0].token_ids and res[2].token_ids == reference[1].token_ids
    _assert_pools_whole(router)


@needs_triton_cpu
def test_admission_by_kernel_serves_as_the_per_table_writes(tiny, monkeypatch):
    """The engine with admission's CUDA path (init_req_rows' kernel, here in the Triton interpreter on the CPU
    tables) serves the ordinary mix and ASD requests, several admitted at once, token for token as the CPU
    backend's per-table writes."""
    draft = tiny.draft("weak_draft", True, 1, seed=5, std=0.02)
    asd = dict(mtp_mode="eagle_with_att", mtp_step=2, mtp_draft_model_dir=[draft], mtp_asd_regret_budget=2.0)
    prompts = _prompts(tiny.vocab_size, len(ORDINARY), seed=8)
    for kw, budgets in ((ENGINE, None), (asd, [2.0] * len(ORDINARY))):
        reference = _run(_router(tiny, **kw), _msgs(prompts, ORDINARY, asd_budgets=budgets))
        with monkeypatch.context() as m:
            m.setattr(req_manager, "writes_by_kernel", lambda _: True)
            router = _router(tiny, **kw)
            got = _run(router, _msgs(prompts, ORDINARY, asd_budgets=budgets))
        assert {i: r.token_ids for i, r in got.items()} == {i: r.token_ids for i, r in reference.items()}
        _assert_pools_whole(router)


def test_backend_that_cannot_store_a_request_fails_it_and_frees_its_row(tiny, monkeypatch):
    """Anything the backend raises for one request at admission (beyond the known checks) fails that
    request, not the requests admitted with it, nor the worker."""
    prompts = _prompts(tiny.vocab_size, 3, seed=2)
    router = _router(tiny)
    pm = router.backend.params_manager
    check = pm.check_req

    def refuse_one(req):
        if req.req_id == 1:
            raise RuntimeError("cannot store")
        check(req)

    monkeypatch.setattr(pm, "check_req", refuse_one)
    res = _run(router, _msgs(prompts, [ORDINARY[0]] * 3))
    assert res[1].finish_reason == FinishReason.ERROR and "cannot store" in res[1].error
    assert [len(res[i].token_ids) for i in (0, 2)] == [ORDINARY[0]["max_new_tokens"]] * 2
    _assert_pools_whole(router)


def test_a_failed_batch_write_at_admission_fails_that_batch_and_serving_goes_on(tiny, monkeypatch):
    """The table rows of requests admitted together are written in one batch: when that write raises,
    each of them fails (their rows go back); the requests admitted before and after are served exactly."""
    prompts = _prompts(tiny.vocab_size, 4, seed=4)
    params = [ORDINARY[0], ORDINARY[2], ORDINARY[1], ORDINARY[3]]
    reference = _run(_router(tiny), _msgs(prompts, params))
    router = _router(tiny)
    pm = router.backend.params_manager
    write = pm.init_reqs_sampling_params
    batches = []

    def fail_the_batch_of_request_1(reqs, next_token_ids=None):
        batches.append(sorted(r.req_id for r in reqs))
        if 1 in batches[-1]:
            raise RuntimeError("injected write failure")
        write(reqs, next_token_ids)

    monkeypatch.setattr(pm, "init_reqs_sampling_params", fail_the_batch_of_request_1)
    msgs = _msgs(prompts, params)
    res = _run(router, msgs[:1], joining={1: msgs[1:3], 8: msgs[3:]})
    assert batches == [[0], [1, 2], [3]]  # 1 and 2 admitted together
    for i in (1, 2):
        assert res[i].finish_reason == FinishReason.ERROR and "injected write failure" in res[i].error
    for i in (0, 3):
        assert res[i].token_ids == reference[i].token_ids
    _assert_pools_whole(router)


def _fail_forward_at(router: RouterManager, monkeypatch, calls: set) -> List[List[int]]:
    """Make the model's forward raise on the given (0-based) calls; returns, per failed call,
    the req_ids that were running then."""
    model = router.backend.model
    forward = model.forward
    count = [0]
    running_at_failures = []

    def flaky(*a, **kw):
        n = count[0]
        count[0] += 1
        if n in calls:
            running_at_failures.append(sorted(r.req_id for r in router.running))
            raise RuntimeError(f"injected failure in forward call {n}")
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", flaky)
    return running_at_failures


def test_a_failed_batch_step_fails_its_requests_frees_everything_and_serving_goes_on(tiny, monkeypatch):
    vocab = tiny.vocab_size
    prompts = _prompts(vocab, 5, seed=3)
    params = [ORDINARY[0], ORDINARY[1], ORDINARY[0], ORDINARY[2], ORDINARY[3]]
    reference = _run(_router(tiny), _msgs(prompts, params))
    # two run at a time, the others wait; the third forward (a decode) fails
    router = _router(tiny, running_max_req_size=2)
    running_at_failures = _fail_forward_at(router, monkeypatch, calls={2})
    res = _run(router, _msgs(prompts, params))
    failed = [i for i in res if res[i].finish_reason == FinishReason.ERROR]
    assert running_at_failures and failed == running_at_failures[0]
    for i in failed:
        assert "batch step" in res[i].error and "injected failure" in res[i].error and res[i].token_ids
    served = [i for i in res if i not in failed]
    assert served  # the requests waiting at the failure: served as if nothing happened
    for i in served:
        assert res[i].token_ids == reference[i].token_ids and res[i].finish_reason == FinishReason.LENGTH
    _assert_pools_whole(router)
    # and the worker serves the failed prompts again, exactly
    again = _run(router, _msgs([prompts[i] for i in failed], [params[i] for i in failed], first_id=100))
    assert [again[100 + k].token_ids for k in range(len(failed))] == [reference[i].token_ids for i in failed]


def test_a_step_that_keeps_failing_raises(tiny, monkeypatch):
    """A persistent fault (a broken device) is not hidden: after a few failed steps in a row
    the router raises, so the worker process exits and the server notices."""
    router = _router(tiny, running_max_req_size=1)
    _fail_forward_at(router, monkeypatch, calls=set(range(1000)))
    prompts = _prompts(tiny.vocab_size, MAX_CONSECUTIVE_STEP_FAILURES + 1)
    for m in _msgs(prompts, [ORDINARY[0]] * len(prompts)):
        router.add_req(m)
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        assert [u.finish_reason for u in router.step()] == [FinishReason.ERROR]
    with pytest.raises(RuntimeError, match="injected failure"):
        router.step()


def test_serve_loop_survives_poisoned_requests_and_failed_steps(tiny, monkeypatch):
    """The worker's own loop (serve_steps): errors come back as updates, the loop goes on."""
    vocab = tiny.vocab_size
    router = _router(tiny)
    running_at_failures = _fail_forward_at(router, monkeypatch, calls={0})
    in_q, out_q = queue.Queue(), queue.Queue()
    prompts = _prompts(vocab, 4, seed=6)
    bad = [_params({"do_sample": True}, top_k=2**31), _params({"do_sample": True}, seed=2**70)]
    for m in _msgs(prompts[:1], [ORDINARY[0]]) + _msgs(prompts[1:3], bad, first_id=1):
        in_q.put(m)  # all there before the loop's first poll: one prefill step takes 0 and 2
    loop = threading.Thread(target=serve_steps, args=(router, single_rank_context("cpu"), in_q, [out_q]), daemon=True)
    loop.start()
    finished: Dict[int, Result] = {}
    while len(finished) < 3:
        updates, _stats = out_q.get(timeout=60)
        for u in updates:
            if u.finish_reason is not None:
                finished[u.req_id] = Result(finish_reason=u.finish_reason, error=u.error)
    in_q.put(_msgs(prompts[3:], [ORDINARY[0]], first_id=3)[0])  # served after the failures
    tokens = []
    while True:
        updates, _stats = out_q.get(timeout=60)
        tokens += [t for u in updates for t in u.token_ids]
        if any(u.finish_reason is not None for u in updates):
            break
    in_q.put(None)
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert finished[1].finish_reason == FinishReason.ERROR and "top_k" in finished[1].error
    assert running_at_failures == [[0, 2]]  # the first prefill failed: requests 0 and 2
    for i in (0, 2):
        assert finished[i].finish_reason == FinishReason.ERROR and "batch step" in finished[i].error
    assert len(tokens) == ORDINARY[0]["max_new_tokens"]
    _assert_pools_whole(router)


def _seeded_req(seed: int, generated: int) -> InferReq:
    req = InferReq(0, [1], _params({"do_sample": True}, seed=seed), [])
    req.output_ids = [0] * generated
    return req


def test_seed_plus_position_never_overflows_and_ordinary_seeds_are_unchanged():
    for seed, generated, j in ((0, 0, 0), (42, 5, 2), (2**63 - 10, 3, 1), (2**64 - 4, 2, 1)):
        assert ModeBackend._seed(_seeded_req(seed, generated), j) == seed + generated + j
    # past torch's range: wraps modulo 2**64 instead of raising in manual_seed
    assert ModeBackend._seed(_seeded_req(2**64 - 1, 1), 0) == 0
    assert ModeBackend._seed(_seeded_req(2**64 + 5, 2), 1) == 8
    assert ModeBackend._seed(_seeded_req(3 * 2**64, 0), 0) == 0


def test_huge_seeds_are_served(tiny):
    """seed 2**64 crashed at the first token, 2**64 - 1 at the second; seed 2**64 + s now
    draws exactly like seed s."""
    prompts = _prompts(tiny.vocab_size, 1, seed=9) * 3
    sampled = {"max_new_tokens": 6, "ignore_eos": True, "do_sample": True, "temperature": 1.2}
    params = [_params(sampled, seed=s) for s in (2**64 - 1, 2**64 + 5, 5)]
    router = _router(tiny)
    res = _run(router, _msgs(prompts, params))
    assert all(r.finish_reason == FinishReason.LENGTH for r in res.values())
    assert res[1].token_ids == res[2].token_ids
    _assert_pools_whole(router)


WORKER_REPLY_TIMEOUT_S = 120.0  # start-up of the worker process included


def test_worker_process_survives_the_issue_requests(tiny):
    """The issue's reproduction against a real worker process: each of these killed it."""
    from lightllm.server.api_start import start_worker, validate_start_args
    from lightllm.server.core.objs.start_args_type import StartArgs

    args = validate_start_args(StartArgs(model_dir=tiny.model_dir, **ENGINE))
    workers, in_q, out_q, _ready = start_worker(args, "cpu", "float32")
    try:
        prompts = _prompts(tiny.vocab_size, 6, seed=8)
        sampled = {"max_new_tokens": 2, "do_sample": True}
        bad = [_params(sampled, top_k=2**31), _params(sampled, temperature=1e39),
               _params({"max_new_tokens": 2}, repetition_penalty=1e39)]
        seeded = [_params(sampled, seed=2**64), _params({**sampled, "max_new_tokens": 3}, seed=2**64 - 1)]
        msgs = _msgs(prompts[:3], bad) + _msgs(prompts[3:5], seeded, first_id=3) + _msgs(prompts[5:], [ORDINARY[0]],
                                                                                        first_id=5)
        for m in msgs:
            in_q.put(m)
        results = {m.req_id: Result() for m in msgs}
        deadline = time.monotonic() + WORKER_REPLY_TIMEOUT_S
        while any(r.finish_reason is None for r in results.values()):
            assert workers.is_alive(), f"the worker died (exit code {workers.exitcode})"
            assert time.monotonic() < deadline, "the worker did not answer"
            try:
                updates, _stats = out_q.get(timeout=1.0)
            except queue.Empty:
                continue
            for u in updates:
                results[u.req_id].token_ids.extend(u.token_ids)
                u.copy_totals_to(results[u.req_id])
        assert workers.is_alive()
        for i, name in enumerate(("top_k", "temperature", "repetition_penalty")):
            assert results[i].finish_reason == FinishReason.ERROR and name in results[i].error
        assert [len(results[i].token_ids) for i in (3, 4, 5)] == [2, 3, ORDINARY[0]["max_new_tokens"]]
    finally:
        in_q.put(None)
        workers.join(timeout=30)
        workers.kill()
