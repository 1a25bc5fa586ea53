"""Grammar masks of a step's rows (grammar.py) on a hand-made 11-token vocabulary, read bit by bit,
and the request's commit through its matcher (InferReq.append_token)."""
import json

import pytest
import torch

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.grammar import RequestGrammar, rows_bitmask
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from unit_tests.devices import needs_cuda, needs_triton_cpu

xgr = pytest.importorskip("xgrammar")

VOCAB = ["{", "}", '"', "a", ":", "1", "2", ",", " ", "<eos>", "b"]
EOS = VOCAB.index("<eos>")
# {"a": <integer>}: xgrammar without free whitespace writes exactly {"a": 12}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OUTPUT = ["{", '"', "a", '"', ":", " ", "1", "2", "}", "<eos>"]
# what the grammar allows after each prefix of OUTPUT (by hand)
ALLOWED_AFTER = [{"{"}, {'"'}, {"a"}, {'"'}, {":"}, {" "}, {"1", "2"}, {"1", "2", "}"}, {"1", "2", "}"}, {"<eos>"}]


def ids(tokens):
    return [VOCAB.index(t) for t in tokens]


def _grammar() -> RequestGrammar:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    return RequestGrammar(xgr.GrammarMatcher(compiled))


def _allowed(bitmask: torch.Tensor, row: int):
    """The tokens row ``row`` allows, bit by bit (one word: the vocabulary has 11 tokens)."""
    return {VOCAB[t] for t in range(len(VOCAB)) if (int(bitmask[row, 0]) >> t) & 1}


def test_verify_rows_follow_the_drafts_and_the_matcher_is_restored():
    g = _grammar()
    for t in ids(OUTPUT[:2]):  # committed: {"
        assert g.accept(t)
    drafts = ids(["a", '"', ":"])  # all three allowed
    # one entry without a grammar (2 rows, all ones) before the grammar's 4 rows
    mask = rows_bitmask([None, g], [[0], drafts], len(VOCAB))
    assert mask.shape == (6, 1) and mask[:2].eq(-1).all()
    assert [_allowed(mask, 2 + j) for j in range(4)] == ALLOWED_AFTER[2:6]
    assert _allowed(rows_bitmask([g], [[]], len(VOCAB)), 0) == ALLOWED_AFTER[2]  # rolled back


def test_a_refused_draft_leaves_the_rows_after_it_unmasked():
    g = _grammar()
    mask = rows_bitmask([g], [ids(["{", "}", '"'])], len(VOCAB))  # "}" is refused after "{"
    assert _allowed(mask, 0) == {"{"} and _allowed(mask, 1) == {'"'}
    assert mask[2:].eq(-1).all()  # never committed: row 1 forbids "}"
    assert _allowed(rows_bitmask([g], [[]], len(VOCAB)), 0) == {"{"}


def test_no_grammar_no_mask():
    assert rows_bitmask([None, None], [[1, 2], [3, 4]], len(VOCAB)) is None


def _req(eos_ids) -> InferReq:
    """A request whose backend gave it the grammar (the backend compiles response_format itself)."""
    req = InferReq(0, [1], SamplingParams(max_new_tokens=50, ignore_eos=True), eos_ids)
    req.grammar = _grammar()
    return req


def test_the_grammar_end_finishes_with_stop():
    req = _req([])  # ignore_eos and no eos ids: only the grammar ends it
    for t in ids(OUTPUT[:-1]):
        assert not req.append_token(t, 0.0)
    assert req.append_token(EOS, 0.0) and req.finish_reason == FinishReason.STOP


def test_a_refused_token_fails_the_request():
    req = _req([])
    assert req.append_token(VOCAB.index("}"), 0.0)
    assert req.finish_reason == FinishReason.ERROR and "refused" in req.error


@pytest.mark.parametrize("kernel,device", [("torch", "cpu"), pytest.param("triton", "cpu", marks=needs_triton_cpu),
                                           pytest.param("triton", "cuda", marks=needs_cuda)])
def test_asd_never_relaxes_a_forbidden_draft(kernel, device):
    """Regret is taken over the allowed tokens: a draft the mask forbids has logit -inf, so even the
    largest budget does not relax it (an allowed mismatching draft with the same budget is relaxed)."""
    from lightllm.common.basemodel.mtp_verify_torch import mtp_asd_verify_torch
    from lightllm.common.basemodel.triton_kernel.mtp_utils import mtp_asd_verify
    from lightllm.server.core.objs.sampling_params import MAX_ASD_REGRET_BUDGET

    verify = mtp_asd_verify_torch if kernel == "torch" else mtp_asd_verify
    k, vocab = 2, 8
    table = torch.tensor([[0, 5, 6], [0, 3, 1]], dtype=torch.int64, device=device)  # [req, pending + 2 drafts]
    logits = torch.zeros(2 * (k + 1), vocab, device=device)
    logits[:, 1] = 2.0  # the target's choice on every row: token 1
    logits[0, 5] = float("-inf")  # request 0: its first draft (5) is forbidden
    logits[3, 3] = 1.0  # request 1: its first draft (3) is allowed, regret 1
    b_req_idx = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32, device=device)
    next_ids = torch.argmax(logits, dim=-1)
    budget = torch.full((2,), MAX_ASD_REGRET_BUDGET, device=device)
    spent = torch.zeros(2, device=device)
    start = torch.tensor([0, 3], dtype=torch.int32, device=device)
    accept_len, _ = verify(table, start, next_ids, b_req_idx, logits, spent, budget, float("inf"), k)
    assert accept_len.tolist() == [1, 3] and spent.tolist() == [0.0, 1.0]
    assert next_ids[0].item() == 1 and next_ids[3].item() == 3  # the target's token / the relaxed draft
