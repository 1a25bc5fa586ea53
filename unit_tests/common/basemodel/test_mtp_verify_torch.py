"""The host (PyTorch) twins of the MTP kernels against the same readable reference."""
import pytest
import torch

from lightllm.common.basemodel.mtp_verify_torch import (
    mtp_asd_verify_torch,
    mtp_scatter_next_token_ids_torch,
    mtp_verify_torch,
)
from unit_tests.common.basemodel.triton_kernel.mtp_cases import (
    ASD_CASES,
    make_asd_inputs,
    make_verify_batch,
    ref_asd_verify,
)
from unit_tests.common.basemodel.triton_kernel.mtp_reference import ref_mtp_scatter, ref_mtp_verify


@pytest.mark.parametrize("mode", ["random", "all_match", "first_mismatch", "no_draft"])
@pytest.mark.parametrize("num_drafts", range(1, 8))
def test_verify_matches_reference(mode, num_drafts):
    b = make_verify_batch(seed=num_drafts, num_reqs=5, num_drafts=num_drafts, vocab_size=4, mode=mode, num_hold_reqs=1)
    got = mtp_verify_torch(b.req_to_next_token_ids, b.b_req_mtp_start_loc, b.new_next_token_ids, b.b_req_idx)
    ref = ref_mtp_verify(b.req_to_next_token_ids, b.b_req_mtp_start_loc, b.new_next_token_ids, b.b_req_idx)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))


@pytest.mark.parametrize("case", ASD_CASES, ids=str)
def test_asd_matches_reference(case):
    b, logits, spent, budget = make_asd_inputs(case)
    ref = ref_asd_verify(b, logits, spent, budget, case)
    next_ids, ledger = b.new_next_token_ids.clone(), spent.clone()
    relaxed_mask = torch.full_like(b.b_req_idx, -1)
    accept_len, accepted_index = mtp_asd_verify_torch(
        b.req_to_next_token_ids, b.b_req_mtp_start_loc, next_ids, b.b_req_idx, logits, ledger, budget,
        case.local_regret_ratio, case.block_max_mismatch, relaxed_mask)
    assert torch.equal(accept_len, ref[0]) and torch.equal(accepted_index, ref[1])
    assert torch.equal(relaxed_mask, (ref[2] != b.new_next_token_ids).to(torch.int32))
    assert torch.equal(next_ids, ref[2]) and torch.equal(ledger, ref[3])


@pytest.mark.parametrize("num_drafts", range(0, 8))
def test_scatter_matches_reference(num_drafts):
    b = make_verify_batch(seed=50 + num_drafts, num_reqs=4, num_drafts=max(num_drafts, 1), vocab_size=9)
    k1 = num_drafts + 1
    b_req_idx = b.b_req_idx[b.b_req_mtp_start_loc.long()].repeat_interleave(k1)
    start = torch.arange(4, dtype=torch.int32) * k1
    all_next = torch.randint(0, 9, (4 * k1, k1))
    accept_len = torch.randint(1, k1 + 1, (4,), dtype=torch.int32)
    table = b.req_to_next_token_ids.clone()
    mtp_scatter_next_token_ids_torch(table, start, all_next, b_req_idx, accept_len)
    assert torch.equal(table, ref_mtp_scatter(b.req_to_next_token_ids, start, all_next, b_req_idx, accept_len))
