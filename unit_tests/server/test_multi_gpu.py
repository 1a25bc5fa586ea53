"""Two GPUs over NCCL (skipped with fewer than two CUDA devices): --tp 2 and --tp 2 --dp 2, each
with and without --enable_decode_microbatch_overlap, through the server's own worker processes
(OfflineEngine -> start_worker, one process per GPU).

- --enable_tp_cudagraph (--tp 2, --tp 2 --dp 2): graphs (NCCL collectives captured) equal the eager ranks bit
  for bit.

- Greedy outputs (fp32) equal the one-GPU engine's, with strict MTP and with ASD at B = 0.
  Tensor parallelism sums partial products in another order, so a differing token is accepted
  only where the one-GPU model itself sees a near-tie between the two tokens (checked with
  transformers' model, an independent reference); anything else fails.
- ASD at a positive budget: every request spends at most its budget.
- HOLD (padding) rows never reach a response: every request gets its own tokens only, as many
  as the reference.

The embedded model has 3 KV heads, which do not split over 2 attention ranks, so --tp 2 runs a
tiny random Llama; --tp 2 --dp 2 (whole heads per DP group) runs the embedded model and its
trained draft on GSM8K test questions.
"""
from typing import List, Sequence

import pytest
import torch

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import GenResult, OfflineEngine
from lightllm.utils.server_launcher import free_port
from unit_tests.data_paths import embedded_gsm8k_prompts
from unit_tests.models.tiny_checkpoints import tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices (NCCL)"),
]

RANKS = 2
K = 3
# |z(a) - z(b)| below this (fp32 logits of the one-GPU model) counts as a tie that a different
# summation order may break either way.
NEAR_TIE = 1e-3
EMBEDDED_QUESTIONS = 12  # an even count over 2 DP groups still finishes unevenly (HOLD rows)
EMBEDDED_NEW_TOKENS = 96
TINY_COMMON = dict(max_req_total_len=64, running_max_req_size=4, max_total_token_num=300)
EMBEDDED_COMMON = dict(max_req_total_len=512, running_max_req_size=EMBEDDED_QUESTIONS)
PARALLEL = {
    "tp2": dict(tp=2),
    "tp2_overlap": dict(tp=2, enable_decode_microbatch_overlap=True),
    "tp2_dp2": dict(tp=2, dp=2),
    "tp2_dp2_overlap": dict(tp=2, dp=2, enable_decode_microbatch_overlap=True),
}
ASD_POSITIVE = dict(mtp_asd_regret_budget=0.75, mtp_asd_local_regret_ratio=0.75, mtp_asd_block_max_mismatch=1)


def _run(args: StartArgs, prompts, params, eos=()) -> List[GenResult]:
    with OfflineEngine(args, device="cuda", dtype="float32") as eng:
        return eng.generate(prompts, params, eos_token_ids=eos)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _assert_equal_or_near_tie(model_dir: str, prompts, ref: List[GenResult], got: List[GenResult]) -> None:
    """Equal tokens, or a first difference where the one-GPU model's two candidates nearly tie."""
    from transformers import AutoModelForCausalLM

    diffs = [i for i, (r, g) in enumerate(zip(ref, got)) if r.token_ids != g.token_ids]
    assert len(got) == len(ref)
    if not diffs:
        return
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0").eval()
    for i in diffs:
        pos = _first_difference(ref[i].token_ids, got[i].token_ids)
        assert pos < min(len(ref[i].token_ids), len(got[i].token_ids)), f"request {i}: lengths differ, tokens do not"
        ids = torch.tensor([prompts[i] + ref[i].token_ids[:pos]], device="cuda:0")
        with torch.no_grad():
            z = model(ids).logits[0, -1].float()
        a, b = ref[i].token_ids[pos], got[i].token_ids[pos]
        gap = abs(float(z[a] - z[b]))
        assert gap < NEAR_TIE, f"request {i}, token {pos}: {a} vs {b} is no near-tie (logit gap {gap:.3g})"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 4 q heads, 2 kv heads: splits over 2 ranks
    m = tiny_model("llama", seed=2, root=tmp_path_factory.mktemp("multi_gpu"))
    vocab = m.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(vocab, (int(n),), generator=g).tolist() for n in (5, 17, 9, 26, 3)]
    # different lengths: one DP group runs out of requests first and pads with HOLD rows
    params = [{"max_new_tokens": n, "ignore_eos": True} for n in (12, 3, 20, 7, 1)]
    return dict(target=m.model_dir, draft=m.draft("draft", True, 1, seed=4), prompts=prompts, params=params)


@pytest.fixture(scope="module")
def embedded():
    from lightllm.server.httpserver.manager import load_eos_token_ids

    model_dir, tok, prompts = embedded_gsm8k_prompts(EMBEDDED_QUESTIONS)
    # stops by EOS and by length mixed, at different steps
    params = [{"max_new_tokens": EMBEDDED_NEW_TOKENS - 7 * (i % 4)} for i in range(len(prompts))]
    return dict(model_dir=model_dir, prompts=prompts, params=params, eos=load_eos_token_ids(model_dir, tok))


@pytest.mark.parametrize("par", list(PARALLEL))
def test_tiny_model_mtp_and_asd_b0_match_one_gpu(tiny, par):
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[tiny["draft"]])
    one = StartArgs(model_dir=tiny["target"], **TINY_COMMON, **mtp)
    ref = _run(one, tiny["prompts"], tiny["params"])
    for extra in ({}, dict(mtp_asd_regret_budget=0.0)):
        args = StartArgs(model_dir=tiny["target"], nccl_port=free_port(), **TINY_COMMON, **PARALLEL[par], **mtp,
                         **extra)
        got = _run(args, tiny["prompts"], tiny["params"])
        _assert_equal_or_near_tie(tiny["target"], tiny["prompts"], ref, got)
        assert [len(r.token_ids) for r in got] == [p["max_new_tokens"] for p in tiny["params"]]


@pytest.mark.parametrize("par", ["tp2", "tp2_dp2"])
@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_tp2_graphs_equal_eager(tiny, mode, par):
    """--enable_tp_cudagraph on two ranks (--tp 2, and --tp 2 --dp 2: decode graphs, each group padded to the
    fullest one's size): the ranks capture their graphs with the NCCL collectives inside, and replaying them gives
    the eager ranks' tokens bit for bit (the same kernels on the same padded shapes); with MTP, B = 0 equals strict
    on the same graphs."""
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K, mtp_draft_model_dir=[tiny["draft"]]) if mode == "mtp" else {}
    runs, graphs = {}, {}
    arms = [("eager", dict(disable_cudagraph=True)), ("graphs", {})]
    if mode == "mtp":
        arms.append(("b0", dict(mtp_asd_regret_budget=0.0)))
    for name, extra in arms:
        args = StartArgs(model_dir=tiny["target"], nccl_port=free_port(), enable_tp_cudagraph=True,
                         **TINY_COMMON, **PARALLEL[par], **mtp, **extra)
        with OfflineEngine(args, device="cuda", dtype="float32") as eng:
            graphs[name] = eng.ready.cuda_graphs
            runs[name] = eng.generate(tiny["prompts"], tiny["params"])
    assert graphs["eager"] == 0 and graphs["graphs"] > 0
    for name in runs:
        assert [r.token_ids for r in runs[name]] == [r.token_ids for r in runs["eager"]], name
    assert [len(r.token_ids) for r in runs["graphs"]] == [p["max_new_tokens"] for p in tiny["params"]]


@pytest.mark.parametrize("par", ["tp2_dp2", "tp2_dp2_overlap"])
def test_embedded_model_strict_b0_and_budget_on_two_gpus(embedded, par):
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=K)
    e = embedded
    ref = _run(StartArgs(**EMBEDDED_COMMON, **mtp), e["prompts"], e["params"], e["eos"])
    runs = {}
    for name, extra in (("strict", {}), ("b0", dict(mtp_asd_regret_budget=0.0)), ("asd", ASD_POSITIVE)):
        args = StartArgs(nccl_port=free_port(), **EMBEDDED_COMMON, **PARALLEL[par], **mtp, **extra)
        runs[name] = _run(args, e["prompts"], e["params"], e["eos"])
    # B = 0 is the strict rule on the same ranks: bit-identical, no tie allowance
    assert [r.token_ids for r in runs["b0"]] == [r.token_ids for r in runs["strict"]]
    _assert_equal_or_near_tie(e["model_dir"], e["prompts"], ref, runs["strict"])
    assert sum(r.mtp_accepted_token_num for r in runs["strict"]) > 0  # the draft is really used
    for r, p in zip(runs["asd"], e["params"]):
        assert 0 < len(r.token_ids) <= p["max_new_tokens"]
        assert r.asd_regret_spent <= ASD_POSITIVE["mtp_asd_regret_budget"] + 1e-6
    assert sum(r.asd_relaxed_token_num for r in runs["asd"]) > 0  # the budget is really used
