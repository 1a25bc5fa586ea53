"""--tp 2, --tp 2 --dp 2, each with and without --enable_decode_microbatch_overlap, on two CPU
ranks (gloo): greedy outputs equal the single-process engine's, without MTP, with strict MTP
and with ASD at B = 0; HOLD (padding) rows never reach a response nor change a table.

All the two-rank runs share one spawn (``runs`` fixture): the ranks build one engine per case
in turn, with new process groups for each, and step their routers in lockstep.
"""
from typing import Dict, List

import pytest
import torch

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq, RouterManager
from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend
from lightllm.server.router.model_infer.mode_backend.dp_backend.impl import (
    microbatch_blocks,
    microbatch_row_index,
)
from unit_tests.dist_util import run_ranks
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import changed_hold_rows, hold_rows, make_engine

K = 2
COMMON = dict(max_req_total_len=64, running_max_req_size=4, batch_max_tokens=40, max_total_token_num=300)
PARALLEL = {
    "tp2": dict(tp=2),
    "tp2_overlap": dict(tp=2, enable_decode_microbatch_overlap=True),
    "tp2_dp2": dict(tp=2, dp=2),
    "tp2_dp2_overlap": dict(tp=2, dp=2, enable_decode_microbatch_overlap=True),
    # --enable_tp_cudagraph's DP layout, eagerly: each group's decode rows padded to LADDER's size of the fullest
    "tp2_dp2_ladder": dict(tp=2, dp=2, enable_tp_cudagraph=True),
}
LADDER = GraphLadder.from_flags(4, 4, 4)  # 1, 2, 4 requests
# Greedy requests of different lengths, so that one DP group runs out of requests while the
# other still decodes (it then runs padding only); one stops at prefill, one uses a penalty.
GREEDY = [
    {"max_new_tokens": 11, "ignore_eos": True},
    {"max_new_tokens": 3, "ignore_eos": True},
    {"max_new_tokens": 14, "ignore_eos": True, "repetition_penalty": 1.3},
    {"max_new_tokens": 1, "ignore_eos": True},
]
# An unseeded sampled request: the ranks of a DP group must still agree on its tokens.
SAMPLED = {"max_new_tokens": 7, "ignore_eos": True, "do_sample": True, "temperature": 1.0, "top_k": 40}
PARAMS = GREEDY + [SAMPLED]


def _prompts(vocab: int, seed: int = 0) -> List[List[int]]:
    return random_prompts(vocab, len(PARAMS), range(3, 30), seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    out = {}
    for kind, seed in (("llama", 2), ("qwen3_kv2", 3)):
        m = tiny_model(kind, seed=seed, root=root / kind)
        out[kind] = dict(
            tiny=m,
            target=m.model_dir,
            vocab=m.vocab_size,
            # the TP cases' eagle draft reads fc of two target layers (feature fusion)
            eagle=m.draft("eagle", True, 1, seed=4, target_layer_ids=[0, 2] if kind == "qwen3_kv2" else ()),
            vanilla_no_att=m.draft("no_att", False, K, seed=5),
        )
    return out


def _mode_args(m: dict, mode: str) -> dict:
    if mode == "plain":
        return {}
    if mode == "mtp_no_att":
        return dict(mtp_mode="vanilla_no_att", mtp_step=K, mtp_draft_model_dir=[m["vanilla_no_att"]])
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[m["eagle"]])
    return mtp if mode == "mtp" else dict(mtp, mtp_asd_regret_budget=0.0)


def _cases():
    """(parallel, model kind, mode) of every two-rank run."""
    cases = [(par, "llama", mode) for par in PARALLEL for mode in ("plain", "mtp", "asd0")]
    cases.append(("tp2_dp2_overlap", "llama", "mtp_no_att"))
    cases += [("tp2", "qwen3_kv2", "plain"), ("tp2", "qwen3_kv2", "mtp"), ("tp2_dp2", "qwen3_kv2", "mtp")]
    return cases


def _rank_main(rank: int, case_args: List[dict], prompts: Dict[str, list]) -> List[dict]:
    """One rank: every case in turn; returns what this rank saw of each."""
    from lightllm.server.api_start import validate_start_args
    from lightllm.server.router.manager import build_backend
    from lightllm.utils.dist_utils import build_parallel_context

    out = []
    for kind, kwargs in case_args:
        args = validate_start_args(StartArgs(**kwargs))
        parallel = build_parallel_context(args.dp, "cpu", 2 if args.enable_decode_microbatch_overlap else 1)
        backend = build_backend(args, "cpu", "float32", parallel)
        if args.enable_tp_cudagraph:  # CPU has no ladder: pad as CUDA's graphs would
            backend.decode_step.ladder, backend.ladder_rows = LADDER, True
        layouts = []  # (real rows, all rows) of every decode forward
        prepare = backend.prepare_decode_rows

        def recording_prepare(reqs, num_rows=None, **kw):
            rows = prepare(reqs, num_rows, **kw)
            layouts.append((rows.num_real_rows, int(rows.b_req_idx.shape[0])))
            return rows

        backend.prepare_decode_rows = recording_prepare  # test instrumentation only
        before = hold_rows(backend)
        router = RouterManager(backend)
        for i, (p, sp) in enumerate(zip(prompts[kind], PARAMS)):
            sp = SamplingParams.from_request(dict(sp))
            budget = args.mtp_asd_regret_budget if args.asd_enabled and sp.is_greedy else 0.0
            router.add_req(AddReq(i, p, sp, [], budget))
        tokens: Dict[int, list] = {}
        accept_lens: Dict[int, list] = {}
        finish = {}
        while router.has_work:
            for u in router.step():
                tokens.setdefault(u.req_id, []).extend(u.token_ids)
                if u.accept_len:
                    accept_lens.setdefault(u.req_id, []).append(u.accept_len)
                finish[u.req_id] = u.finish_reason
        mem, reqm = backend.mem_manager, backend.req_manager
        out.append(dict(
            backend=type(backend).__name__,
            dp_rank=parallel.dp_rank,
            tokens=tokens,
            accept_lens=accept_lens,
            finish=finish,
            layouts=layouts,
            changed_hold_rows=changed_hold_rows(backend, before),
            all_freed=mem.available_size == mem.size and reqm.can_alloc_num == reqm.max_request_num,
        ))
    return out


@pytest.fixture(scope="module")
def runs(models):
    prompts = {kind: _prompts(m["vocab"], seed=i) for i, (kind, m) in enumerate(models.items())}
    cases = _cases()
    case_args = [
        (kind, dict(model_dir=models[kind]["target"], **COMMON, **PARALLEL[par], **_mode_args(models[kind], mode)))
        for par, kind, mode in cases
    ]
    per_rank = run_ranks(_rank_main, 2, case_args, prompts)
    refs = {}
    for _, kind, mode in cases:
        if (kind, mode) not in refs:
            eng = make_engine(models[kind]["target"], **COMMON, **_mode_args(models[kind], mode))
            refs[(kind, mode)] = eng.generate(prompts[kind], PARAMS)
    return {case: (per_rank[0][i], per_rank[1][i], refs[case[1:]]) for i, case in enumerate(cases)}


def test_greedy_outputs_match_the_single_process_engine(runs):
    for case, (r0, r1, ref) in runs.items():
        for i in range(len(GREEDY)):
            assert r0["tokens"][i] == ref[i].token_ids, (case, i)
            assert r0["finish"][i] == "length"
        # every rank reports the same (sampled request included: its ranks agreed on every draw)
        assert r1["tokens"] == r0["tokens"] and r1["accept_lens"] == r0["accept_lens"], case
        assert len(r0["tokens"][len(GREEDY)]) == SAMPLED["max_new_tokens"]


def test_asd_with_zero_budget_is_strict_step_by_step(runs):
    for par in PARALLEL:
        strict, asd0 = runs[(par, "llama", "mtp")][0], runs[(par, "llama", "asd0")][0]
        greedy = range(len(GREEDY))
        assert [asd0["accept_lens"].get(i) for i in greedy] == [strict["accept_lens"].get(i) for i in greedy], par


def test_hold_rows_never_reach_a_response_nor_change_a_table(runs):
    for case, (r0, r1, _) in runs.items():
        for r in (r0, r1):
            assert set(r["tokens"]) == set(range(len(PARAMS))), case  # no update for anything but a request
            assert r["changed_hold_rows"] == [], case
            assert r["all_freed"], case  # every KV slot and req_idx row back (HOLD_SLOT never handed out)


def test_dp_groups_pad_to_equal_rows_and_an_idle_group_runs_padding_only(runs):
    for (par, kind, mode), (r0, r1, _) in runs.items():
        dp2 = "dp2" in par
        expected = "DPBackend" if dp2 or "overlap" in par else "ChunkedPrefillBackend"
        assert r0["backend"] == r1["backend"] == expected
        # every decode forward had the same number of rows on both ranks
        assert [total for _, total in r0["layouts"]] == [total for _, total in r1["layouts"]]
        if par == "tp2_dp2_ladder":  # every decode forward padded to a ladder size
            k1 = K + 1 if mode != "plain" else 1
            assert {total for _, total in r0["layouts"]} <= {n * k1 for n in LADDER.sizes}
            assert any(total > real for real, total in r0["layouts"] if real)
        if dp2:
            assert (r0["dp_rank"], r1["dp_rank"]) == (0, 1)
            real = [l[0] for l in r0["layouts"] + r1["layouts"]]
            assert 0 in real, (par, kind, mode)  # a rank with no request ran padding only
            assert any(0 < a < b for a, b in r0["layouts"] + r1["layouts"])  # and padding after real rows


# ---- one process: padding through the shared flow, the overlap path, micro-batch layout ----


class PaddedDecodeBackend(ChunkedPrefillBackend):
    """Chunked prefill whose every decode forward carries EXTRA_REQS requests' worth of HOLD rows."""

    EXTRA_REQS = 2

    def decode(self, reqs):
        rows = self.prepare_decode_rows(reqs, num_rows=(len(reqs) + self.EXTRA_REQS) * (self.mtp_step + 1))
        return self.verify_draft_commit(rows, self.decode_forward(rows))


def test_hold_rows_through_the_shared_flow_change_nothing(models):
    """Padding with MTP, ASD spending budget and a penalty: the same tokens, accept lengths and
    ledger as without padding; no HOLD row of any table changes; a step with padding only
    returns nothing."""
    m = models["llama"]
    kw = dict(COMMON, **_mode_args(m, "mtp"), mtp_asd_regret_budget=3.0)
    prompts = _prompts(m["vocab"])[:len(GREEDY)]
    plain = make_engine(m["target"], **kw).generate(prompts, GREEDY)
    eng = make_engine(m["target"], **kw)
    padded_backend = PaddedDecodeBackend(eng.args, "cpu", "float32")
    eng.router = RouterManager(padded_backend)
    before = hold_rows(padded_backend)
    padded = eng.generate(prompts, GREEDY)
    for a, b in zip(plain, padded):
        assert b.token_ids == a.token_ids and b.accept_lens == a.accept_lens
        assert b.asd_relaxed_token_num == a.asd_relaxed_token_num
        # the regrets come from a forward over more rows: equal up to float rounding
        assert b.asd_regret_spent == pytest.approx(a.asd_regret_spent, rel=1e-5)
    assert sum(r.asd_relaxed_token_num for r in padded) > 0  # the ledger really was in use
    rows = padded_backend.prepare_decode_rows([], num_rows=2 * (K + 1))
    assert padded_backend.verify_draft_commit(rows, padded_backend.decode_forward(rows)) == []
    assert changed_hold_rows(padded_backend, before) == []
    mem = padded_backend.mem_manager
    assert mem.available_size == mem.size


def test_overlap_streams_the_committed_token_not_the_stale_target(models):
    """Micro-batch overlap with ASD relaxing tokens: every streamed token is the token the
    verification committed (relaxed rows: the draft), never the target's pre-verification
    choice; the host copy happens after verification."""
    m = models["llama"]
    weak = m["tiny"].draft("weak", True, 1, seed=6, std=0.02)  # many mismatches
    eng = make_engine(m["target"], **COMMON, mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[weak],
                      mtp_asd_regret_budget=50.0, enable_decode_microbatch_overlap=True)
    backend = eng.backend
    assert type(backend).__name__ == "DPBackend"
    records = []
    backend.verify_observer = records.append  # one record per verify step, before commit
    router = eng.router
    for i, p in enumerate(_prompts(m["vocab"], seed=7)[:3]):
        sp = SamplingParams.from_request({"max_new_tokens": 16, "ignore_eos": True})
        router.add_req(AddReq(i, p, sp, [], 50.0))
    relaxed_streamed, relaxed_total = 0, {}
    while router.has_work:
        seen = len(records)
        updates = router.step()
        if len(records) == seen:  # a prefill step
            continue
        record = records[-1]
        # updates come in the order of the verified requests, K+1 rows each
        for r, u in enumerate(updates):
            start = r * (K + 1)
            committed = record.committed_ids[start:start + len(u.token_ids)].tolist()
            target = record.target_ids[start:start + len(u.token_ids)].tolist()
            assert u.token_ids == committed
            relaxed_streamed += sum(c != t for c, t in zip(committed, target))
            relaxed_total[u.req_id] = u.asd_relaxed_token_num
    assert relaxed_streamed > 0 and relaxed_streamed == sum(relaxed_total.values())


@pytest.mark.parametrize("num_reqs,most", [(0, 1), (1, 1), (1, 3), (3, 3), (4, 5)])
def test_microbatch_rows_cover_every_row_once_and_keep_requests_whole(num_reqs, most):
    k1 = K + 1
    blocks = microbatch_blocks(most)
    assert min(blocks) >= 1 and sum(blocks) >= most
    first, second = microbatch_row_index(num_reqs, k1, blocks)
    assert (len(first), len(second)) == (blocks[0] * k1, blocks[1] * k1)
    assert sorted(torch.cat([first, second]).tolist()) == list(range(sum(blocks) * k1))
    real = num_reqs * k1
    for idx in (first, second):  # whole requests first, then padding
        rows = [i for i in idx.tolist() if i < real]
        assert rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        assert len(rows) % k1 == 0
        assert idx.tolist() == rows + [i for i in idx.tolist() if i >= real]
