"""The overlap schedule (chunked-prefill backend, one rank) on CPU: the next decode step is
launched before the one in flight is committed, and outputs stay those of
--disable_overlap_schedule.

Each comparison runs two engines on the same tiny model and arguments, with and without the
overlap schedule, and compares every router step's updates in order (tokens, log-probs, accept
lengths, MTP / ASD totals): equal lists mean equal outputs and the same schedule of steps. The
workloads end requests at points the engine cannot predict (stop sequences, EOS) while others
decode and waiting requests join, so steps launched ahead are kept (the finished rows dropped
at commit) or undone.

On CPU there is no padding ladder and every such finish undoes the step ahead; setting
``decode_step.ladder`` pads like CUDA and exercises the keep path (the finished request's rows
run in the step and are dropped at commit).
"""
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.models.dspark.train_module import random_dspark_draft
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.manager import AddReq, BatchClock, StepTiming
from lightllm.server.router.model_infer.infer_batch import FinishReason
from lightllm.server.router.model_infer.mode_backend.chunked_prefill import impl as chunked_prefill_impl
from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import paced_budget
from lightllm.server.router.model_infer.step_rows import StepRows, max_sampled_rows, step_ladder
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import changed_hold_rows, hold_rows, make_engine, mode_args

K = 2
ASD_BUDGET = 3.0  # relaxes tokens with the eagle draft below
# The schedules these cases lay out (which step a finish or a join lands in) hold arrivals for this many decode steps
# (--router_max_wait_tokens; the default until the forty-first session). The default's own schedule runs in the
# parity cases' ``wait`` parameter here and in test_mixed_steps.py.
GROUPED_WAIT = 4
COMMON = dict(max_req_total_len=64, running_max_req_size=4, batch_max_tokens=64, max_total_token_num=500,
              router_max_wait_tokens=GROUPED_WAIT)
MAX_IDLE_STEPS = 100  # router steps without an update before a run is declared stuck
STOP_NGRAM = 2  # tokens of each stop sequence
UNPREDICTABLE = (FinishReason.STOP, FinishReason.EOS)  # finishes the engine learns at commit

# Parity workload: more requests than running_max_req_size, ended by a stop sequence, an EOS
# token (both taken from a reference run's output) or max_new_tokens.
MAX_NEW = (14, 6, 20, 11, 17, 9, 15)
ENDS = ("stop", "length", "eos", "stop", "eos", "length", "stop")
PROMPT_LENS = range(3, 24)
PARITY_SEED = 5

# Keep path: CUDA's ladder cut at 8 requests, eight requests that all fit at once.
KEEP_LADDER = GraphLadder.from_flags(8, 8, 8)  # 1, 2, 4, 8
KEEP_ARGS = dict(max_req_total_len=64, running_max_req_size=8, batch_max_tokens=200, max_total_token_num=800)
KEEP_MAX_NEW = 28
KEEP_FIRST_STEP = 2  # steps (router steps with updates; 0: the prefill) before the first finish
KEEP_STEP_GAP = 2  # at least this many steps between two finishes
# Request 0 has the longest sequence throughout (CPU attention reads the batch's longest KV
# length; a finished request's row must not change it); the others end by stop sequences.
KEEP_PROMPT_LENS = (34, 10, 9, 8, 7, 6, 5, 4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    out = {}
    for kind, seed in (("llama", 2), ("qwen3", 3)):
        m = tiny_model(kind, seed=seed, root=root / kind)
        out[kind] = dict(target=m.model_dir, vocab=m.vocab_size, eagle=m.draft("eagle", True, 1, seed=4))
        if kind == "llama":
            out[kind]["dspark"] = random_dspark_draft(m.hf.config, str(root / "dspark"), seed=3, block_size=K + 1)
    return out


def _mode_args(m: dict, mode: str) -> dict:
    return mode_args(m, mode, K, ASD_BUDGET)


# ---- driving a router ----


@dataclass
class Spec:
    """One request of a workload."""

    prompt: List[int]
    params: dict  # SamplingParams fields
    eos: List[int] = field(default_factory=list)


class Upd(NamedTuple):
    """What a test compares of one ReqStepUpdate."""

    req_id: int
    token_ids: Tuple[int, ...]
    logprobs: Tuple[float, ...]
    finish_reason: Optional[str]
    accept_len: int
    mtp_accepted: int
    asd_relaxed: int
    asd_spent: float


@dataclass
class Run:
    groups: List[List[Upd]]  # the updates of every router step that returned some, in order
    backend: object
    freed: bool  # every KV slot and req_idx row back
    changed_hold: List[str]  # tables whose HOLD row changed

    def updates(self) -> List[Upd]:
        return [u for g in self.groups for u in g]

    def tokens(self) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for u in self.updates():
            out.setdefault(u.req_id, []).extend(u.token_ids)
        return out

    def logprobs(self) -> Dict[int, List[float]]:
        out: Dict[int, List[float]] = {}
        for u in self.updates():
            out.setdefault(u.req_id, []).extend(u.logprobs)
        return out

    def last(self) -> Dict[int, Upd]:
        """Each request's last update (its finish reason and totals)."""
        return {u.req_id: u for u in self.updates()}

    def finish_group(self) -> Dict[int, int]:
        """Index in ``groups`` of the step each request finished in."""
        return {u.req_id: i for i, g in enumerate(self.groups) for u in g if u.finish_reason is not None}

    def token_groups(self) -> Dict[int, List[int]]:
        """For each request, the index in ``groups`` of the step that committed each token."""
        out: Dict[int, List[int]] = {}
        for i, g in enumerate(self.groups):
            for u in g:
                out.setdefault(u.req_id, []).extend([i] * len(u.token_ids))
        return out


def _engine(model_dir: str, overlap: bool, ladder: Optional[GraphLadder] = None, **kw):
    eng = make_engine(model_dir, disable_overlap_schedule=not overlap, **kw)
    if ladder is not None:
        eng.backend.decode_step.ladder = ladder  # CPU pads decode batches like CUDA
    return eng


def _add(router, specs: List[Spec], first_id: int = 0) -> None:
    server_budget = router.backend.args.mtp_asd_regret_budget
    for i, s in enumerate(specs):
        sp = SamplingParams(**s.params)
        router.add_req(AddReq(first_id + i, list(s.prompt), sp, list(s.eos), sp.asd_budget(server_budget)))


def _upd(u) -> Upd:
    return Upd(u.req_id, tuple(u.token_ids), tuple(u.logprobs), u.finish_reason, u.accept_len,
               u.mtp_accepted_token_num, u.asd_relaxed_token_num, u.asd_regret_spent)


def _drive(router, groups: List[List[Upd]], after_step: Optional[Callable] = None) -> None:
    """Step ``router`` until it has no work, appending each step's updates to ``groups``."""
    idle = 0
    while router.has_work:
        ups = router.step()
        if after_step is not None:
            after_step(router, ups)
        idle = 0 if ups else idle + 1
        assert idle < MAX_IDLE_STEPS, "the engine made no progress"
        if ups:
            groups.append([_upd(u) for u in ups])


def _finished_run(eng, groups: List[List[Upd]], before) -> Run:
    backend = eng.backend
    mem, reqm = backend.mem_manager, backend.req_manager
    freed = mem.available_size == mem.size and reqm.can_alloc_num == reqm.max_request_num
    return Run(groups, backend, freed, changed_hold_rows(backend, before))


def _run(eng, specs: List[Spec], after_step: Optional[Callable] = None) -> Run:
    before = hold_rows(eng.backend)
    _add(eng.router, specs)
    groups: List[List[Upd]] = []
    _drive(eng.router, groups, after_step)
    return _finished_run(eng, groups, before)


def _both(model_dir: str, specs: List[Spec], ladder: Optional[GraphLadder] = None,
          after_step: Optional[Callable] = None, **kw) -> Tuple[Run, Run]:
    """(plain schedule, overlap schedule) runs of ``specs``; ``after_step`` watches the overlap run."""
    plain = _run(_engine(model_dir, False, ladder, **kw), specs)
    return plain, _run(_engine(model_dir, True, ladder, **kw), specs, after_step)


def _assert_pools_whole(*runs: Run) -> None:
    for run in runs:
        assert run.freed  # every KV slot (an undone step's included) and req_idx row back
        assert run.changed_hold == []


# ---- workloads ----


def _first_new_ngram_end(tokens: List[int], lo: int, hi: int, n: int) -> int:
    """The first index in [lo, hi) where the n-gram ending there occurs for the first time."""
    for i in range(max(lo, n - 1), hi):
        gram = tokens[i - n + 1:i + 1]
        if all(tokens[j - n + 1:j + 1] != gram for j in range(n - 1, i)):
            return i
    raise AssertionError(f"no new {n}-gram in [{lo}, {hi}) of {tokens}: choose another workload")


def _greedy_specs(prompts: List[List[int]], max_new) -> List[Spec]:
    return [Spec(p, dict(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_new)]


def _parity_specs(model_dir: str, vocab: int, seed: int, **kw) -> List[Spec]:
    """The parity workload, its stop sequences and EOS tokens taken from a plain run's output."""
    prompts = random_prompts(vocab, len(MAX_NEW), PROMPT_LENS, seed)
    ref = _run(_engine(model_dir, False, **kw), _greedy_specs(prompts, MAX_NEW)).tokens()
    specs = []
    for i, (p, n, end) in enumerate(zip(prompts, MAX_NEW, ENDS)):
        params = dict(max_new_tokens=n, ignore_eos=end != "eos")
        lo = max(2, n // 3)  # after a few decode steps, before max_new_tokens
        eos = []
        if end == "stop":
            at = _first_new_ngram_end(ref[i], lo, n - 1, STOP_NGRAM)
            params["stop_token_ids"] = [ref[i][at - STOP_NGRAM + 1:at + 1]]
        elif end == "eos":
            eos = [ref[i][_first_new_ngram_end(ref[i], lo, n - 1, 1)]]
        specs.append(Spec(p, params, eos))
    return specs


def _keep_specs(model_dir: str, vocab: int, seed: int, order: Optional[List[int]] = None, **kw) -> List[Spec]:
    """Eight requests; all but request 0 end by a stop sequence, KEEP_STEP_GAP steps apart,
    in ``order`` (request ids, first to finish first; default: from the last request to
    request 1, so that the finished rows always sit where the plain schedule's padding does)."""
    prompts = [random_prompts(vocab, 1, range(n, n + 1), seed + i)[0] for i, n in enumerate(KEEP_PROMPT_LENS)]
    ref = _run(_engine(model_dir, False, KEEP_LADDER, **kw), _greedy_specs(prompts, [KEEP_MAX_NEW] * len(prompts)))
    tokens, steps = ref.tokens(), ref.token_groups()
    order = order if order is not None else list(range(len(prompts) - 1, 0, -1))
    stops, prev_step = {}, KEEP_FIRST_STEP - KEEP_STEP_GAP
    for i in order:  # each finishes KEEP_STEP_GAP steps or more after the one before it
        lo = next(j for j, s in enumerate(steps[i]) if s >= prev_step + KEEP_STEP_GAP)
        at = _first_new_ngram_end(tokens[i], lo, KEEP_MAX_NEW - 1, STOP_NGRAM)
        stops[i], prev_step = tokens[i][at - STOP_NGRAM + 1:at + 1], steps[i][at]
    specs = _greedy_specs(prompts, [KEEP_MAX_NEW] * len(prompts))
    for i, stop in stops.items():
        specs[i].params["stop_token_ids"] = [stop]
    return specs


class FinishWatch:
    """Counts, in an overlap run, the finishes the engine learnt with a step already launched
    ahead (it launched one in the same call), and how many of those steps it kept."""

    def __init__(self):
        self.ahead = self.discarded = 0
        self.seen = self.kept = 0

    def __call__(self, router, ups) -> None:
        b = router.backend
        if any(u.finish_reason in UNPREDICTABLE for u in ups) and b.steps_ahead > self.ahead:
            self.seen += 1
            self.kept += b.discarded_steps == self.discarded
        self.ahead, self.discarded = b.steps_ahead, b.discarded_steps


# ---- 1. outputs equal the plain schedule ----

PARITY_CASES = [("llama", "plain"), ("llama", "mtp"), ("llama", "asd0"), ("llama", "asd"),
                ("qwen3", "plain"), ("qwen3", "mtp"), ("llama", "dspark_mtp"), ("llama", "dspark_asd")]


@pytest.mark.parametrize("mode", ["plain", "mtp", "dspark_mtp"])
def test_the_overlap_schedule_is_on_by_default_with_or_without_mtp(models, mode):
    m = models["llama"]
    on = make_engine(m["target"], **COMMON, **_mode_args(m, mode))
    off = make_engine(m["target"], disable_overlap_schedule=True, **COMMON, **_mode_args(m, mode))
    assert on.backend.overlap_schedule and not off.backend.overlap_schedule


@pytest.mark.parametrize("wait", [0, 1, 4])  # --router_max_wait_tokens: admission at every step, or grouped
@pytest.mark.parametrize("kind,mode", PARITY_CASES)
def test_overlap_gives_the_plain_schedules_outputs(models, kind, mode, wait):
    """Stop sequences and EOS mid-run, waiting requests joining: the same updates, step by
    step (tokens, log-probs, accept lengths, ASD ledger) as --disable_overlap_schedule; steps
    really ran ahead, and (no ladder on CPU) the ones a finish invalidated were undone."""
    m = models[kind]
    kw = dict(COMMON, router_max_wait_tokens=wait, **_mode_args(m, mode))
    specs = _parity_specs(m["target"], m["vocab"], PARITY_SEED, **kw)
    watch = FinishWatch()
    plain, overlap = _both(m["target"], specs, after_step=watch, **kw)
    assert overlap.groups == plain.groups
    assert set(u.finish_reason for u in plain.last().values()) == {"stop", "eos", "length"}
    assert plain.backend.steps_ahead == 0
    b = overlap.backend
    assert b.steps_ahead > 0 and b.discarded_steps > 0
    assert watch.seen > 0 and watch.kept == 0  # no ladder: every invalidated step is undone
    _assert_pools_whole(plain, overlap)
    relaxed = sum(u.asd_relaxed for u in overlap.last().values())
    assert (relaxed > 0) == mode.endswith("asd")


HOST_DEPENDENT = (  # requests whose next step needs the host's commit: they never run ahead
    dict(max_new_tokens=6, ignore_eos=True, repetition_penalty=1.3),
    dict(max_new_tokens=5, ignore_eos=True, do_sample=True, temperature=1.0, top_k=40, seed=11),
)


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_penalty_and_seeded_requests_never_run_ahead(models, mode):
    """A repetition penalty and a seeded sampled request next to greedy ones: the same updates
    as the plain schedule; no step with them in it is ever left in flight, and steps run ahead
    again once they are gone."""
    m = models["llama"]
    kw = dict(COMMON, **_mode_args(m, mode))
    greedy = _parity_specs(m["target"], m["vocab"], seed=9, **kw)[:4]
    extra = random_prompts(m["vocab"], len(HOST_DEPENDENT), PROMPT_LENS, seed=8)
    specs = [Spec(p, dict(params)) for p, params in zip(extra, HOST_DEPENDENT)] + greedy
    decoded_with_greedy = []

    def check(router, ups) -> None:
        inflight = router.backend._inflight
        if inflight is not None:
            assert all(r.params.seed is None and not r.has_penalty for r in inflight.rows.reqs)
        decoded_with_greedy.append(any(r.has_penalty for r in router.running) and len(router.running) > 1)

    plain, overlap = _both(m["target"], specs, after_step=check, **kw)
    assert overlap.groups == plain.groups
    assert any(decoded_with_greedy)
    lens = [len(plain.tokens()[i]) for i in range(len(HOST_DEPENDENT))]
    assert lens == [p["max_new_tokens"] for p in HOST_DEPENDENT]
    assert overlap.backend.steps_ahead > 0
    _assert_pools_whole(plain, overlap)


# ---- 2. the keep path (a padding ladder on CPU) ----


def _padded_size_kept(ladder: GraphLadder, num_reqs: int) -> int:
    """Finishes, one at a time from ``num_reqs`` requests down to one, that keep the padded size."""
    return sum(ladder.bucket_size(n) == ladder.bucket_size(n - 1) for n in range(num_reqs, 1, -1))


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_finished_rows_in_the_padding_keep_the_step_ahead(models, mode):
    """With CUDA's padding: a finish that leaves the padded size unchanged keeps the step
    launched ahead (the finished request's rows take the padding's place and are dropped at
    commit), one that shrinks it undoes the step; both give the plain schedule's updates."""
    m = models["llama"]
    kw = dict(KEEP_ARGS, **_mode_args(m, mode))
    specs = _keep_specs(m["target"], m["vocab"], seed=30, **kw)
    watch = FinishWatch()
    plain, overlap = _both(m["target"], specs, KEEP_LADDER, after_step=watch, **kw)
    # the workload: requests 7, 6, ..., 1 stop in that order, request 0 runs to its length
    ends = plain.finish_group()
    assert [ends[i] for i in range(len(specs))] == sorted(ends.values(), reverse=True)
    assert len(set(ends.values())) == len(specs)
    assert plain.last()[0].finish_reason == "length"
    assert overlap.groups == plain.groups
    # every stop was learnt with a step ahead; it was kept where the padded size stayed
    assert watch.seen == len(specs) - 1
    assert watch.kept == _padded_size_kept(KEEP_LADDER, len(specs)) > 0
    assert overlap.backend.discarded_steps == watch.seen - watch.kept > 0
    _assert_pools_whole(plain, overlap)


# CPU attention (torch SDPA) rounds a row differently at another batch position: finished
# rows in the middle of a kept step move the others, so log-probs agree to rounding only there.
CPU_POSITION_ROUNDING = 1e-5


def _without_logprobs(run: Run) -> List[List[Upd]]:
    return [[u._replace(logprobs=()) for u in g] for g in run.groups]


def test_finishes_in_any_order_keep_the_same_tokens(models):
    """Requests finishing in the middle of the batch (their rows keep their place, the plain
    schedule compacts): the same steps and tokens; log-probs equal up to CPU rounding."""
    m = models["llama"]
    specs = _keep_specs(m["target"], m["vocab"], seed=41, order=[3, 6, 1, 5, 7, 2, 4], **KEEP_ARGS)
    watch = FinishWatch()
    plain, overlap = _both(m["target"], specs, KEEP_LADDER, after_step=watch, **KEEP_ARGS)
    assert _without_logprobs(overlap) == _without_logprobs(plain)
    lp_plain, lp_overlap = plain.logprobs(), overlap.logprobs()
    for i in lp_plain:
        assert lp_overlap[i] == pytest.approx(lp_plain[i], abs=CPU_POSITION_ROUNDING), i
    assert watch.kept > 0
    _assert_pools_whole(plain, overlap)


def test_a_kept_step_does_not_run_before_a_waiting_requests_prefill(models):
    """Four requests running, a fifth waiting: the last running request stops (the padded size
    would not change). The plain schedule then prefills the waiting request and decodes all
    four; the overlap schedule must do the same, so it undoes the step it launched ahead."""
    m = models["llama"]
    ladder = GraphLadder.from_flags(4, 4, 4)  # 1, 2, 4
    specs = _keep_specs(m["target"], m["vocab"], seed=50, order=[3], **KEEP_ARGS)[:4]
    waiting = random_prompts(m["vocab"], 1, range(6, 7), seed=51)[0]
    specs.append(Spec(waiting, dict(max_new_tokens=8, ignore_eos=True)))
    watch = FinishWatch()
    # the waiting request joins at the next step (grouped admission would hold it: then nothing waits)
    plain, overlap = _both(m["target"], specs, ladder, after_step=watch, **dict(COMMON, router_max_wait_tokens=0))
    assert watch.seen == 1 and watch.kept == 0
    assert overlap.groups == plain.groups


# ---- 3. abort through the router ----

ABORT_MAX_NEW = 12
ABORTED = 1  # the middle one of three requests
ABORT_AT_TOKENS = 4  # committed tokens of the aborted request when it is aborted


def _step_until(router, tokens: Dict[int, List[int]], req_id: int, n: int, groups: List[List[Upd]]) -> None:
    while len(tokens.get(req_id, [])) < n:
        ups = router.step()
        for u in ups:
            tokens.setdefault(u.req_id, []).extend(u.token_ids)
        if ups:
            groups.append([_upd(u) for u in ups])


def test_abort_flushes_the_step_in_flight(models):
    """Abort while a step is in flight: that step is committed for the other requests (their
    updates first, the abort's last), the aborted request's KV and req_idx go back at once, and
    the others end as in the plain schedule with the request aborted after that same step."""
    m = models["llama"]
    prompts = random_prompts(m["vocab"], 3, range(5, 15), seed=60)
    specs = _greedy_specs(prompts, [ABORT_MAX_NEW] * len(prompts))
    survivors = [i for i in range(len(specs)) if i != ABORTED]

    eng = _engine(m["target"], True, **COMMON)
    router, backend = eng.router, eng.backend
    before = hold_rows(backend)
    _add(router, specs)
    tokens, groups = {}, []
    _step_until(router, tokens, ABORTED, ABORT_AT_TOKENS, groups)
    inflight = backend._inflight
    assert inflight is not None and ABORTED in [r.req_id for r in inflight.rows.reqs]
    ups = router.abort(ABORTED)
    assert (ups[-1].req_id, ups[-1].finish_reason, ups[-1].token_ids) == (ABORTED, "abort", [])
    flushed = ups[:-1]
    assert sorted(u.req_id for u in flushed) == survivors
    assert all(len(u.token_ids) == 1 and u.finish_reason is None for u in flushed)
    mem, reqm = backend.mem_manager, backend.req_manager
    assert [r.req_id for r in router.running] == survivors
    cache = backend.prompt_cache
    cached = cache.stats().cached_tokens if cache is not None else 0
    held = sum(cache.held_slots(r) if cache is not None else len(r.slots) for r in router.running)
    # nothing else held: the running requests' own slots, the prompt cache's, the free ones
    assert mem.can_use_mem_size + cached == mem.size - held
    assert reqm.can_alloc_num == reqm.max_request_num - len(survivors)
    groups.append([_upd(u) for u in ups])
    _drive(router, groups)
    overlap = _finished_run(eng, groups, before)

    ref_eng = _engine(m["target"], False, **COMMON)
    ref_before = hold_rows(ref_eng.backend)
    _add(ref_eng.router, specs)
    ref_tokens, ref_groups = {}, []
    _step_until(ref_eng.router, ref_tokens, ABORTED, ABORT_AT_TOKENS + 1, ref_groups)  # + the flushed step
    ref_ups = ref_eng.router.abort(ABORTED)
    assert [u.finish_reason for u in ref_ups] == ["abort"]
    _drive(ref_eng.router, ref_groups)
    plain = _finished_run(ref_eng, ref_groups, ref_before)

    for i in survivors:
        assert overlap.tokens()[i] == plain.tokens()[i] and overlap.logprobs()[i] == plain.logprobs()[i], i
        assert len(overlap.tokens()[i]) == ABORT_MAX_NEW and overlap.last()[i].finish_reason == "length"
    assert len(overlap.tokens()[ABORTED]) == ABORT_AT_TOKENS
    _assert_pools_whole(plain, overlap)


FLUSH_FINISH_MAX_NEW = 6  # the other request's last token is in the step the abort flushes


def test_a_request_finished_by_an_aborts_flush_gets_one_final_update(models):
    """Two aborts in one message batch (serve_steps handles them in turn): the first flushes a
    step in which the second request finishes; that request gets exactly one final update."""
    m = models["llama"]
    specs = _greedy_specs(random_prompts(m["vocab"], 2, range(5, 15), seed=61), [20, FLUSH_FINISH_MAX_NEW])
    router = _engine(m["target"], True, **COMMON).router
    backend = router.backend
    _add(router, specs)
    tokens, groups = {}, []
    _step_until(router, tokens, 1, FLUSH_FINISH_MAX_NEW - 1, groups)
    inflight = backend._inflight
    assert inflight is not None and 1 in [r.req_id for r in inflight.rows.reqs]
    ups = router.abort(0) + router.abort(1)
    assert [u.finish_reason for u in ups if u.req_id == 1 and u.finish_reason is not None] == ["length"]


# ---- 4. mixed steps launched ahead ----

CHUNK_TOKENS = 4  # --batch_max_tokens: a prompt of many chunks runs in consecutive mixed steps
MIX_ARGS = dict(max_req_total_len=64, running_max_req_size=8, batch_max_tokens=CHUNK_TOKENS, max_total_token_num=500,
                router_max_wait_tokens=GROUPED_WAIT)
MIX_MAX_NEW = 16
JOIN_AFTER_TOKENS = 5  # request 0's committed tokens when the late prompts are added


# the first four prompts' lengths: none fits one chunk (the fifth's first mixed step comes after a decode
# step in flight), or some do (it comes after a step committed at once, nothing in flight)
def _mix_prompts(m: dict, first_lens) -> List[List[int]]:
    """Four prompts of ``first_lens`` tokens, then one of five CHUNK_TOKENS chunks."""
    prompts = random_prompts(m["vocab"], 5, first_lens, seed=80)
    prompts[4] = random_prompts(m["vocab"], 1, range(19, 20), seed=81)[0]
    return prompts


def _timed_runs(m: dict, specs: List[Spec], **kw) -> Tuple[Tuple[Run, Run], Tuple[StepTiming, StepTiming]]:
    """((plain, overlap) runs of ``specs`` with MIX_ARGS and ``kw``, their step clocks)."""
    timings, runs = [], []
    for overlap in (False, True):
        eng = _engine(m["target"], overlap, **dict(MIX_ARGS, **kw))
        eng.router.take_timing()
        runs.append(_run(eng, specs))
        timings.append(eng.router.take_timing())
    return (runs[0], runs[1]), (timings[0], timings[1])


@pytest.mark.parametrize("first_max_new", [2, 4, 7])
def test_mixed_steps_run_ahead_past_a_request_that_reaches_max_new_tokens(models, first_max_new):
    """Five requests at once, the fifth a prompt of five chunks; request 0 reaches max_new_tokens while those
    chunks run. Its finish is known in advance, so the mixed step after the one that brings its last token is
    staged without it and launched before that commit: every mixed step but the first runs ahead (none from
    idle, none taken back), and every update is the plain schedule's."""
    m = models["llama"]
    specs = _greedy_specs(_mix_prompts(m, range(5, 7)), [first_max_new] + [MIX_MAX_NEW] * 4)
    (plain, overlap), (plain_t, overlap_t) = _timed_runs(m, specs, running_max_req_size=5)
    assert overlap.groups == plain.groups
    _assert_pools_whole(plain, overlap)
    ups = overlap.updates()
    ends = next(i for i, u in enumerate(ups) if u.req_id == 0 and u.finish_reason == "length")
    firsts = [i for i, u in enumerate(ups) if u.req_id == 4 and u.token_ids]
    assert firsts and ends < firsts[0]  # request 0 finished while prompt 4 was still in chunks
    b = overlap.backend
    assert b.mixed_left == 1 and b.mixed_ahead + b.mixed_staged == plain_t.mixed_steps - 1
    assert b.mixed_undone == b.mixed_dropped == 0
    assert (overlap_t.mixed_steps, overlap_t.mixed_decode_reqs) == (plain_t.mixed_steps, plain_t.mixed_decode_reqs)
    # the plain schedule leaves nothing in flight: the GPU idles after every call but the last (which ends every
    # request); the overlap schedule at most twice
    assert plain.backend.left_idle == plain_t.steps - 1 and b.left_idle <= 2


@pytest.mark.parametrize("first_lens", [range(5, 7), range(4, 6)])
def test_consecutive_mixed_steps_run_ahead_with_the_plain_schedules_updates(models, first_lens):
    """Four requests decode while a fifth (waiting for a slot, then alone in the queue) is prefilled in
    chunks of CHUNK_TOKENS: each mixed step is left in flight (the router's work runs under it), the ones
    after the first launched right after the one before it is committed, and every update is the plain
    schedule's."""
    m = models["llama"]
    specs = _greedy_specs(_mix_prompts(m, first_lens), [6, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW])
    (plain, overlap), (plain_t, overlap_t) = _timed_runs(m, specs, running_max_req_size=4)
    assert overlap.groups == plain.groups
    b = overlap.backend
    assert b.mixed_ahead >= 3 and b.decode_after_mixed >= 1 and plain.backend.mixed_ahead == 0
    # each of those mixed steps was staged while the one before it ran (nothing changed at its commit)
    # every mixed step was launched under the step before it: after a mixed step (mixed_ahead) or after a decode
    # step (mixed_staged), and none was taken back
    assert b.mixed_early == b.mixed_ahead + b.mixed_staged and b.mixed_undone == b.mixed_dropped == 0
    assert b.mixed_kept_past_finish == 0
    # the decode step after the last chunk, launched under that chunk's mixed step before its commit
    assert b.decode_early >= 1 and b.decode_after_mixed >= b.decode_early
    assert b.mixed_left >= 1 and plain.backend.mixed_left == 0  # the first prompts' mixed steps at least
    # the step clock counts the steps launched after a commit as the plain schedule's calls do
    for key in ("steps", "decode_steps", "decode_batch_reqs", "mixed_steps", "mixed_decode_reqs"):
        assert getattr(overlap_t, key) == getattr(plain_t, key), key
    _assert_pools_whole(plain, overlap)


def test_a_finish_in_the_mixed_step_in_flight_drops_the_step_staged_under_it(models):
    """As above, but request 1 stops (its stop sequence) in one of the fifth prompt's mixed steps: the
    mixed step staged while that one ran is dropped (its slots back) and the plain schedule's step runs."""
    m = models["llama"]
    prompts = _mix_prompts(m, range(5, 7))
    max_new = [6, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW]
    kw = dict(MIX_ARGS, running_max_req_size=4)
    ref = _run(_engine(m["target"], False, **kw), _greedy_specs(prompts, max_new)).tokens()
    # request 0's 6th token lets prompt 4 in: requests 1-3 commit their tokens 7, 8, ... in its mixed steps
    at = _first_new_ngram_end(ref[1], 8, 10, STOP_NGRAM)  # a token of the second to fourth of them
    specs = _greedy_specs(prompts, max_new)
    specs[1].params["stop_token_ids"] = [ref[1][at - STOP_NGRAM + 1:at + 1]]
    plain, overlap = _both(m["target"], specs, **kw)
    _assert_same_outputs(plain, overlap)
    assert plain.last()[1].finish_reason == "stop" and len(plain.tokens()[1]) == at + 1
    b = overlap.backend
    assert b.mixed_undone == 1 and b.mixed_early >= 2  # CPU's unpadded rows keep no finished request
    _assert_pools_whole(plain, overlap)


def _rows_layout(eng, running: int):
    """CUDA's padded rows layout for the engine's mixed steps (its eager body), as test_mixed_steps does."""
    b = eng.backend
    ladder = step_ladder(CHUNK_TOKENS, running * (b.mtp_step + 1) + CHUNK_TOKENS)
    b.mixed_rows = StepRows(b.model, b.req_to_next_token_ids, ladder, False, b.rows_draft,
                            max_logit_rows=max_sampled_rows(running, b.mtp_step), context=b.rows_context)
    return eng


def test_a_finish_in_the_mixed_step_in_flight_keeps_the_padded_step_launched_under_it(models):
    """As above in the padded rows layout, each of requests 1-3 stopping in turn: the stopping request's rows stay
    in the mixed step launched under the one it stopped in (the padded shape is the plain step's), as padding
    whose commit keeps nothing; every update is the plain schedule's (log-probs to CPU rounding: the rows after
    the padding sit one place earlier in the plain step)."""
    m = models["llama"]
    prompts = _mix_prompts(m, range(5, 7))
    max_new = [6, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW]
    kw = dict(MIX_ARGS, running_max_req_size=4)
    ref = _run(_rows_layout(_engine(m["target"], False, **kw), 4), _greedy_specs(prompts, max_new)).tokens()
    for stopper in (1, 2, 3):
        at = _first_new_ngram_end(ref[stopper], 8, 10, STOP_NGRAM)  # in one of prompt 4's mixed steps
        specs = _greedy_specs(prompts, max_new)
        specs[stopper].params["stop_token_ids"] = [ref[stopper][at - STOP_NGRAM + 1:at + 1]]
        plain = _run(_rows_layout(_engine(m["target"], False, **kw), 4), specs)
        overlap = _run(_rows_layout(_engine(m["target"], True, **kw), 4), specs)
        assert _without_logprobs(overlap) == _without_logprobs(plain)
        _assert_same_outputs(plain, overlap)
        assert plain.last()[stopper].finish_reason == "stop" and len(plain.tokens()[stopper]) == at + 1
        b = overlap.backend
        assert (b.mixed_kept_past_finish, b.mixed_undone) == (1, 0) and b.mixed_early >= 2, stopper
        _assert_pools_whole(plain, overlap)


def test_a_finish_at_the_last_chunk_keeps_the_padded_decode_step_launched_under_it(models):
    """Request 1 stops in the mixed step of prompt 4's last chunk, with CUDA's padding for decode steps too: the
    decode step launched under that mixed step keeps request 1's rows as padding (the padded size is the plain
    step's), and every update is the plain schedule's (log-probs to CPU rounding)."""
    m = models["llama"]
    prompts = _mix_prompts(m, range(5, 7))
    max_new = [6, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW, MIX_MAX_NEW]
    kw = dict(MIX_ARGS, running_max_req_size=4)
    ladder = GraphLadder.from_flags(4, 4, 4)

    def engine(overlap: bool):
        return _rows_layout(_engine(m["target"], overlap, ladder, **kw), 4)

    ref = _run(engine(False), _greedy_specs(prompts, max_new)).tokens()
    at = _first_new_ngram_end(ref[1], 12, 13, STOP_NGRAM)  # its token in the last chunk's mixed step
    specs = _greedy_specs(prompts, max_new)
    specs[1].params["stop_token_ids"] = [ref[1][at - STOP_NGRAM + 1:at + 1]]
    plain, overlap = _run(engine(False), specs), _run(engine(True), specs)
    assert _without_logprobs(overlap) == _without_logprobs(plain)
    _assert_same_outputs(plain, overlap)
    assert plain.last()[1].finish_reason == "stop" and len(plain.tokens()[1]) == at + 1
    b = overlap.backend
    assert b.decode_kept_past_finish == 1 and b.decode_early >= 1
    _assert_pools_whole(plain, overlap)


STRESS_REQUESTS = 10
STRESS_PROMPT_LENS = range(3, 30)  # up to 8 chunks of CHUNK_TOKENS: consecutive mixed steps


def _stress_case(m, layout: str, seed: int, **kw):
    """(engine(overlap, **more), specs): ten requests through four slots in small chunks, each ended by a stop sequence,
    an EOS token or its length at a point of its own (``seed``); ``kw``: more engine arguments."""
    g = random.Random(seed)
    prompts = random_prompts(m["vocab"], STRESS_REQUESTS, STRESS_PROMPT_LENS, seed)
    max_new = [g.randrange(4, MIX_MAX_NEW) for _ in prompts]
    kw = dict(MIX_ARGS, running_max_req_size=4, **kw)

    def engine(overlap: bool, **more):  # rows: CUDA's padding for mixed and decode steps alike
        if layout == "rows":
            return _rows_layout(_engine(m["target"], overlap, GraphLadder.from_flags(4, 4, 4), **kw, **more), 4)
        return _engine(m["target"], overlap, **kw, **more)

    ref = _run(engine(False), _greedy_specs(prompts, max_new)).tokens()
    specs = _greedy_specs(prompts, max_new)
    for i, spec in enumerate(specs):
        end, n = g.choice(["stop", "eos", "length"]), max_new[i]
        if end != "length" and n >= 4:
            at = _first_new_ngram_end(ref[i], 1, n - 1, STOP_NGRAM if end == "stop" else 1)
            if end == "stop":
                spec.params["stop_token_ids"] = [ref[i][at - STOP_NGRAM + 1:at + 1]]
            else:
                spec.params["ignore_eos"] = False
                spec.eos = [ref[i][at]]
    return engine, specs


@pytest.mark.parametrize("wait", [0, 1, 4])
@pytest.mark.parametrize("seed", [90, 91, 92])
@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["plain", "mtp", "asd", "dspark_asd"])
def test_mixed_steps_under_finishes_and_joins_give_the_plain_schedules_updates(models, mode, layout, seed, wait):
    """Ten requests through four slots in small chunks, each ended by a stop sequence, an EOS token or its
    length at a point of its own: mixed steps launched under (or, with MTP, right after) the ones before them are
    kept (padding rows) or taken back, and every update, step by step, is the plain schedule's (with MTP: the
    accept lengths and the ASD ledger too)."""
    m = models["llama"]
    engine, specs = _stress_case(m, layout, seed, router_max_wait_tokens=wait, **_mode_args(m, mode))
    plain, overlap = _run(engine(False), specs), _run(engine(True), specs)
    if layout == "items":  # CPU's layout: nothing kept past a finish, every update equal
        assert overlap.groups == plain.groups
    else:  # rows kept past a finish move the others: log-probs equal to CPU rounding there
        assert _without_logprobs(overlap) == _without_logprobs(plain)
        _assert_same_outputs(plain, overlap)
    b = overlap.backend
    assert (b.mixed_early if mode == "plain" else b.mixed_left) > 0
    _assert_pools_whole(plain, overlap)


PACE_STEPS = 8  # the stress prompts (up to 30 tokens, 4 a step) pace below the budget


@pytest.mark.parametrize("seed", [90, 91])
@pytest.mark.parametrize("layout", ["items", "rows"])
@pytest.mark.parametrize("mode", ["plain", "mtp", "asd"])
def test_paced_mixed_steps_under_finishes_and_joins_give_the_plain_schedules_updates(models, mode, layout, seed,
                                                                                     monkeypatch):
    """--mixed_prefill_pace_steps (the floor lowered to 1 token for the tiny prompts): mixed steps staged under the
    ones before them are paced from the tokens those leave, so the overlap schedule's updates are still the plain
    schedule's, step by step, and some steps take fewer prompt tokens than the budget allows."""
    m = models["llama"]
    engine, specs = _stress_case(m, layout, seed, router_max_wait_tokens=0, mixed_prefill_pace_steps=PACE_STEPS,
                                 **_mode_args(m, mode))
    paced_steps = []

    def spy(remaining, pace_steps, budget, floor):
        out = paced_budget(remaining, pace_steps, budget, floor)
        paced_steps.append(out < min(budget, sum(remaining)))
        return out

    monkeypatch.setattr(chunked_prefill_impl, "paced_budget", spy)

    def paced(overlap: bool):
        eng = engine(overlap)
        eng.backend.pace_min_tokens = 1
        return eng

    plain, overlap = _run(paced(False), specs), _run(paced(True), specs)
    if layout == "items":
        assert overlap.groups == plain.groups
    else:
        assert _without_logprobs(overlap) == _without_logprobs(plain)
        _assert_same_outputs(plain, overlap)
    assert any(paced_steps)
    _assert_pools_whole(plain, overlap)


@pytest.mark.parametrize("seed", [90, 91, 92])
@pytest.mark.parametrize("layout", ["items", "rows"])
def test_admission_behind_the_step_in_flight_under_finishes_and_joins_keeps_every_output(models, layout, seed):
    """--router_admit_behind_step: waiting requests join the step after the one launched ahead, so the steps
    differ from the plain schedule's; every request's tokens, log-probs (to CPU rounding) and finish reason
    do not, and more steps are launched before the commit of the one before."""
    engine, specs = _stress_case(models["llama"], layout, seed, router_max_wait_tokens=0)
    plain, overlap = _run(engine(False), specs), _run(engine(True), specs)
    behind = _run(engine(True, router_admit_behind_step=True), specs)
    _assert_same_outputs(plain, behind)
    early = lambda b: b.mixed_early + b.decode_early  # noqa: E731
    assert early(behind.backend) > early(overlap.backend)
    _assert_pools_whole(plain, behind)


def _join_mid_run(model_dir: str, overlap: bool, specs: List[Spec], late: List[Spec], join_after: int) -> Run:
    """``specs`` from the start; ``late`` added once request 0 has ``join_after`` tokens (the queue is
    empty then: they join at the next call, while a decode step is in flight with overlap)."""
    eng = _engine(model_dir, overlap, **MIX_ARGS)
    router = eng.router
    before = hold_rows(eng.backend)
    _add(router, specs)
    tokens, groups = {}, []
    _step_until(router, tokens, 0, join_after, groups)
    _add(router, late, first_id=len(specs))
    _drive(router, groups)
    return _finished_run(eng, groups, before)


def _assert_same_outputs(plain: Run, overlap: Run) -> None:
    """Each request's tokens, and its log-probs up to CPU rounding (the schedules batch rows differently)."""
    assert overlap.tokens() == plain.tokens()
    lp_plain, lp_overlap = plain.logprobs(), overlap.logprobs()
    for i in lp_plain:
        assert lp_overlap[i] == pytest.approx(lp_plain[i], abs=CPU_POSITION_ROUNDING), i
    assert {i: u.finish_reason for i, u in overlap.last().items()} == {i: u.finish_reason for i, u in plain.last().items()}


def test_a_prompt_joining_mid_run_is_staged_under_the_decode_step_in_flight(models):
    """Prompts that join while a decode step is in flight: their first mixed step is staged while that step
    runs and launched right after its commit; the same tokens as the plain schedule (which, with nothing in
    flight, mixes them in one decode step earlier: log-probs to CPU rounding)."""
    m = models["llama"]
    prompts = random_prompts(m["vocab"], 3, range(5, 9), seed=82)
    specs = _greedy_specs(prompts, [MIX_MAX_NEW] * 3)
    late = _greedy_specs(random_prompts(m["vocab"], 2, range(2, 3), seed=83), [6, 6])  # both in one chunk
    plain = _join_mid_run(m["target"], False, specs, late, JOIN_AFTER_TOKENS)
    overlap = _join_mid_run(m["target"], True, specs, late, JOIN_AFTER_TOKENS)
    _assert_same_outputs(plain, overlap)
    assert overlap.backend.mixed_staged == 1 and overlap.backend.mixed_dropped == 0
    _assert_pools_whole(plain, overlap)


@pytest.mark.parametrize("extra", [1, 2])
def test_a_length_finish_in_the_step_in_flight_leaves_the_mixed_step_staged(models, extra):
    """Request 1 reaches max_new_tokens around the decode step in flight when prompts join: a finish known in
    advance, so the mixed step staged under that step leaves it out (as the plain schedule's next step does)
    and is launched, not dropped."""
    m = models["llama"]
    prompts = random_prompts(m["vocab"], 3, range(5, 9), seed=82)
    specs = _greedy_specs(prompts, [MIX_MAX_NEW, JOIN_AFTER_TOKENS + extra, MIX_MAX_NEW])
    late = _greedy_specs(random_prompts(m["vocab"], 2, range(2, 3), seed=83), [6, 6])  # both in one chunk
    plain = _join_mid_run(m["target"], False, specs, late, JOIN_AFTER_TOKENS)
    overlap = _join_mid_run(m["target"], True, specs, late, JOIN_AFTER_TOKENS)
    _assert_same_outputs(plain, overlap)
    assert plain.last()[1].finish_reason == "length"
    assert overlap.backend.mixed_staged == 1 and overlap.backend.mixed_dropped == 0
    _assert_pools_whole(plain, overlap)


def test_a_finish_in_the_step_in_flight_drops_the_staged_mixed_step(models):
    """The decode step in flight when prompts join finishes a request (its stop sequence): the mixed step
    staged under it is dropped (its slots back) and the plain schedule's step runs instead."""
    m = models["llama"]
    prompts = random_prompts(m["vocab"], 3, range(5, 9), seed=86)
    ref = _run(_engine(m["target"], False, **MIX_ARGS), _greedy_specs(prompts, [MIX_MAX_NEW] * 3)).tokens()
    at = _first_new_ngram_end(ref[1], JOIN_AFTER_TOKENS + 1, MIX_MAX_NEW - 1, STOP_NGRAM)
    specs = _greedy_specs(prompts, [MIX_MAX_NEW] * 3)
    specs[1].params["stop_token_ids"] = [ref[1][at - STOP_NGRAM + 1:at + 1]]
    late = _greedy_specs(random_prompts(m["vocab"], 1, range(3, 4), seed=85), [6])
    # request 0 and 1 commit a token a step: join when the step in flight is the one with request 1's stop
    plain = _join_mid_run(m["target"], False, specs, late, at)
    overlap = _join_mid_run(m["target"], True, specs, late, at)
    _assert_same_outputs(plain, overlap)
    assert plain.last()[1].finish_reason == "stop"
    assert overlap.backend.mixed_dropped == 1
    _assert_pools_whole(plain, overlap)


# ---- 5. the router's step clock ----


class ClockWatch:
    """Per router step: the step clock's change and whether the call only committed a step."""

    def __init__(self, router):
        self.prev = self._read(router)
        # (commit_only, decode updates, d steps, d decode_steps, d seconds, d decode_seconds); commit_only: the
        # call committed a decode step launched earlier and launched none (a step launched without the requests
        # that finish before it is counted as launched_decode_reqs); mixed_left: it launched a mixed step
        # and left it in flight (counted when the next call commits it)
        self.calls = []
        self.mixed_left = []  # (d steps, d decode_steps, d seconds)

    @staticmethod
    def _read(router):
        t = router.timing
        return t.steps, t.decode_steps, t.seconds, t.decode_seconds

    def __call__(self, router, ups) -> None:
        now = self._read(router)
        delta = tuple(a - b for a, b in zip(now, self.prev))
        self.prev = now
        decoded = sum(1 for u in ups if u.accept_len)
        result = router.last_result
        if result.steps == 0 and result.prefilled:
            self.mixed_left.append(delta[:3])
        commit_only = result.steps == 0 and not result.prefilled and not result.launched_decode_reqs
        self.calls.append((commit_only, decoded) + delta)


def _decode_steps_and_reqs(run: Run) -> Tuple[int, int]:
    """(committed steps that decoded: decode and mixed steps, request decode steps) of a run: from its updates."""
    decode_groups = [g for g in run.groups if any(u.accept_len for u in g)]
    return len(decode_groups), sum(1 for g in decode_groups for u in g if u.accept_len)


def test_a_decode_step_from_idle_that_ends_a_request_is_left_in_flight(models):
    """Three prompts prefilled in one step, then decoding; request 0's second token (max_new_tokens 2) comes in the
    first decode step. That step is still left in flight (its finish is known in advance), so every decode step
    but the first is launched before the commit of the one before it, and the updates are the plain schedule's."""
    m = models["llama"]
    specs = _greedy_specs(random_prompts(m["vocab"], 3, range(5, 7), seed=80), [2, 5, 9])
    (plain, overlap), (plain_t, overlap_t) = _timed_runs(m, specs, running_max_req_size=4, batch_max_tokens=32)
    assert overlap.groups == plain.groups
    _assert_pools_whole(plain, overlap)
    assert overlap_t.decode_steps == plain_t.decode_steps
    assert overlap.backend.steps_ahead == plain_t.decode_steps - 1 and overlap.backend.discarded_steps == 0


@pytest.mark.parametrize("ends", [
    "length",
    "stop",
])
def test_step_clock_counts_each_committed_decode_step_once(models, ends):
    """With overlap, StepTiming counts every committed decode step once, as the plain schedule
    does (the steps of the same workload); a call that only commits a step launched earlier
    adds time but no step."""
    m = models["llama"]
    specs = _parity_specs(m["target"], m["vocab"], seed=70, **COMMON)
    if ends == "length":
        specs = [Spec(s.prompt, dict(max_new_tokens=s.params["max_new_tokens"], ignore_eos=True)) for s in specs]
    timings, watches, runs = [], [], []
    for overlap in (False, True):
        eng = _engine(m["target"], overlap, **COMMON)
        eng.router.take_timing()
        watch = ClockWatch(eng.router)
        runs.append(_run(eng, specs, watch))
        timings.append(eng.router.take_timing())
        watches.append(watch)
    (plain_t, overlap_t), (plain, overlap), watch = timings, runs, watches[1]
    assert overlap.groups == plain.groups
    steps, req_steps = _decode_steps_and_reqs(overlap)
    assert plain_t.decode_steps + plain_t.mixed_steps == steps
    assert plain_t.decode_batch_reqs + plain_t.mixed_decode_reqs == req_steps
    assert overlap.backend.steps_ahead > 0
    # requests reaching max_new_tokens: the next step was launched ahead without them
    assert overlap.backend.successors_without_last > 0
    assert (overlap_t.decode_steps, overlap_t.decode_batch_reqs) == (plain_t.decode_steps, plain_t.decode_batch_reqs)
    assert (overlap_t.mixed_steps, overlap_t.mixed_decode_reqs) == (plain_t.mixed_steps, plain_t.mixed_decode_reqs)
    assert sum(c.steps for c in overlap_t.decode_by_batch.values()) == plain_t.decode_steps
    commit_only = [c for c in watch.calls if c[0]]
    assert any(decoded for _, decoded, *_ in commit_only)  # calls that committed a step, launching none
    for _, _, d_steps, d_decode, d_seconds, d_decode_seconds in commit_only:
        assert d_steps == d_decode == 0 and d_seconds > 0 and d_decode_seconds > 0
    assert len(watch.mixed_left) == overlap.backend.mixed_left
    for d_steps, d_decode, d_seconds in watch.mixed_left:
        assert d_steps == d_decode == 0 and d_seconds > 0


def test_a_commit_only_call_adds_time_but_no_step():
    t = StepTiming()
    t.add(0.5, 3, decode=True, decoded_reqs=3)  # launched a step
    t.add(0.25, 3, decode=True, decoded_reqs=3, steps=0)  # only committed it
    assert (t.steps, t.decode_steps, t.batch_reqs, t.decode_batch_reqs) == (1, 1, 3, 3)
    assert (t.seconds, t.decode_seconds) == (0.75, 0.75)
    assert t.decode_by_batch == {3: BatchClock(0.75, 1, 3)}
