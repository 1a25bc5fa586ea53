"""mtp_utils kernels vs the PyTorch references of mtp_reference.py, on the random batches
and ASD cases of mtp_cases.py.

Every comparison is exact (torch.equal). Kernels run in the Triton interpreter on CPU
(see conftest.py) and natively on CUDA.
"""
import math

import pytest
import torch

from unit_tests.devices import KERNEL_DEVICES

from lightllm.common.basemodel.triton_kernel.mtp_utils import (
    gen_b_req_mtp_start_loc,
    mtp_asd_verify,
    mtp_scatter_next_token_ids,
    mtp_verify,
)
from unit_tests.common.basemodel.triton_kernel.mtp_cases import (
    ASD_CASES,
    LOGIT_DTYPES,
    AsdCase,
    make_asd_inputs,
    make_verify_batch,
    ref_asd_verify,
)
from unit_tests.common.basemodel.triton_kernel.mtp_reference import ref_mtp_scatter, ref_mtp_verify

pytestmark = pytest.mark.spread  # kernel variants to compile, no shared fixtures: one test per worker

DEVICES = KERNEL_DEVICES
WIDE_TABLE_WIDTH = 16  # wider than the engine's table (mtp_cases.TABLE_WIDTH)


# ----------------------------------------------------------------------------- strict verify


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["random", "all_match", "first_mismatch", "no_draft"])
@pytest.mark.parametrize("num_drafts", range(1, 8))
def test_mtp_verify_matches_reference(device, mode, num_drafts):
    batch = make_verify_batch(seed=num_drafts, num_reqs=5, num_drafts=num_drafts, vocab_size=4, mode=mode).to(device)
    new_next_token_ids = batch.new_next_token_ids.clone()
    accept_len, accepted_index = mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, new_next_token_ids, batch.b_req_idx
    )
    ref_accept_len, ref_accepted_index = ref_mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
    )
    assert torch.equal(accept_len, ref_accept_len)
    assert torch.equal(accepted_index, ref_accepted_index)
    assert torch.equal(new_next_token_ids, batch.new_next_token_ids)  # strict never writes
    if mode == "all_match":
        assert torch.all(accept_len == num_drafts + 1)
    if mode == "first_mismatch":
        assert torch.all(accept_len == 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_drafts", [1, 7, 15])
def test_mtp_verify_wide_table_and_hold_rows(device, num_drafts):
    """W = 16 > K + 1 (columns past K are ignored), plus padding requests on the HOLD row."""
    batch = make_verify_batch(
        seed=100 + num_drafts, num_reqs=3, num_drafts=num_drafts, vocab_size=3, width=WIDE_TABLE_WIDTH, num_hold_reqs=2
    ).to(device)
    accept_len, accepted_index = mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
    )
    ref_accept_len, ref_accepted_index = ref_mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
    )
    assert torch.equal(accept_len, ref_accept_len)
    assert torch.equal(accepted_index, ref_accepted_index)


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_verify_rejects_bad_inputs(device):
    batch = make_verify_batch(seed=0, num_reqs=2, num_drafts=2, vocab_size=5).to(device)
    table, start_loc, next_ids, b_req_idx = (
        batch.req_to_next_token_ids,
        batch.b_req_mtp_start_loc,
        batch.new_next_token_ids,
        batch.b_req_idx,
    )
    with pytest.raises(TypeError, match="new_next_token_ids"):
        mtp_verify(table, start_loc, next_ids.int(), b_req_idx)
    with pytest.raises(ValueError, match="req_to_next_token_ids"):
        mtp_verify(table[:, ::2], start_loc, next_ids, b_req_idx)
    with pytest.raises(ValueError, match="b_req_idx"):
        mtp_verify(table, start_loc, next_ids, b_req_idx[:-1])
    with pytest.raises(ValueError, match="columns"):
        mtp_verify(torch.zeros((3, 17), dtype=torch.int64, device=device), start_loc, next_ids, b_req_idx)


# ----------------------------------------------------------------------------- scatter


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_drafts", range(0, 8))
def test_mtp_scatter_matches_reference(device, num_drafts):
    gen = torch.Generator().manual_seed(200 + num_drafts)
    batch = make_verify_batch(seed=200 + num_drafts, num_reqs=4, num_drafts=num_drafts, vocab_size=50)
    batch_size = batch.b_req_idx.shape[0]
    all_next_token_ids = torch.randint(1000, 2000, (batch_size, num_drafts + 1), generator=gen)
    accept_len = torch.randint(1, num_drafts + 2, (4,), generator=gen, dtype=torch.int32)
    ref_table = ref_mtp_scatter(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, all_next_token_ids, batch.b_req_idx, accept_len
    )
    batch = batch.to(device)
    table = batch.req_to_next_token_ids.clone()
    mtp_scatter_next_token_ids(
        table, batch.b_req_mtp_start_loc, all_next_token_ids.to(device), batch.b_req_idx, accept_len.to(device)
    )
    assert torch.equal(table.cpu(), ref_table)
    # Columns past K + 1 and untouched requests keep their values.
    assert torch.equal(table[:, num_drafts + 1 :].cpu(), batch.req_to_next_token_ids[:, num_drafts + 1 :].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_verify_then_scatter(device):
    """The decode flow: verify, then scatter the row at accept_len - 1."""
    num_drafts = 3
    batch = make_verify_batch(seed=7, num_reqs=6, num_drafts=num_drafts, vocab_size=3).to(device)
    batch_size = batch.b_req_idx.shape[0]
    all_next_token_ids = torch.arange(batch_size * (num_drafts + 1), device=device).view(batch_size, num_drafts + 1)
    accept_len, _ = mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
    )
    ref_table = ref_mtp_scatter(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, all_next_token_ids, batch.b_req_idx, accept_len
    )
    table = batch.req_to_next_token_ids.clone()
    mtp_scatter_next_token_ids(table, batch.b_req_mtp_start_loc, all_next_token_ids, batch.b_req_idx, accept_len)
    assert torch.equal(table, ref_table)


# ----------------------------------------------------------------------------- start locations


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_drafts", [0, 1, 3])
def test_gen_b_req_mtp_start_loc(device, num_drafts):
    num_reqs = 5
    b_mtp_index = torch.arange(num_drafts + 1, dtype=torch.int32).repeat(num_reqs).to(device)
    expected = (torch.arange(num_reqs, dtype=torch.int32) * (num_drafts + 1)).to(device)
    assert torch.equal(gen_b_req_mtp_start_loc(b_mtp_index), expected)
    assert torch.equal(gen_b_req_mtp_start_loc(b_mtp_index, num_reqs=num_reqs), expected)


# ----------------------------------------------------------------------------- ASD verify

def _run_asd_vs_reference(device, case: AsdCase):
    batch, logits, spent, budget = make_asd_inputs(case)
    ref_accept_len, ref_accepted_index, ref_next_token_ids, ref_spent = ref_asd_verify(
        batch, logits, spent, budget, case
    )
    batch = batch.to(device)
    new_next_token_ids = batch.new_next_token_ids.clone()
    kernel_spent = spent.to(device)
    relaxed_mask = torch.full_like(batch.b_req_idx, -1)  # every row must be written
    accept_len, accepted_index = mtp_asd_verify(
        batch.req_to_next_token_ids,
        batch.b_req_mtp_start_loc,
        new_next_token_ids,
        batch.b_req_idx,
        logits.to(device),
        kernel_spent,
        budget.to(device),
        case.local_regret_ratio,
        case.block_max_mismatch,
        relaxed_mask,
    )
    # relaxed rows: the reference committed something other than the target's token
    assert torch.equal(relaxed_mask.cpu(), (ref_next_token_ids != batch.new_next_token_ids.cpu()).to(torch.int32))
    assert torch.equal(accept_len.cpu(), ref_accept_len)
    assert torch.equal(accepted_index.cpu(), ref_accepted_index)
    assert torch.equal(new_next_token_ids.cpu(), ref_next_token_ids)
    assert torch.equal(kernel_spent.cpu(), ref_spent)
    assert torch.all(kernel_spent.cpu() <= budget.clamp_min(spent))  # spent <= B (or untouched)
    return accept_len, ref_spent, spent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ASD_CASES, ids=str)
def test_mtp_asd_verify_matches_reference(device, case):
    _run_asd_vs_reference(device, case)


def test_random_asd_cases_exercise_relaxation():
    """Guard against a vacuous comparison: the random cases relax tokens and spend budget."""
    relaxed_reqs = 0
    charged_cases = 0
    for case in ASD_CASES:
        batch, logits, spent, budget = make_asd_inputs(case)
        strict_len, _ = ref_mtp_verify(
            batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
        )
        asd_len, _, _, new_spent = ref_asd_verify(batch, logits, spent, budget, case)
        assert torch.all(asd_len >= strict_len)
        relaxed_reqs += int(torch.count_nonzero(asd_len > strict_len))
        charged_cases += int(not torch.equal(new_spent, spent))
    assert relaxed_reqs >= 20
    assert charged_cases >= 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
def test_mtp_asd_zero_budget_equals_strict(device, dtype):
    """B = 0 for every request: bit-for-bit mtp_verify, ledger untouched."""
    case = AsdCase(77, 5, 16, dtype, math.inf, 100, True, False)
    batch, logits, spent, budget = make_asd_inputs(case)
    batch = batch.to(device)
    strict_len, strict_index = mtp_verify(
        batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx
    )
    zero_budget = torch.zeros_like(budget, device=device)
    zero_spent = torch.zeros_like(spent, device=device)
    new_next_token_ids = batch.new_next_token_ids.clone()
    asd_len, asd_index = mtp_asd_verify(
        batch.req_to_next_token_ids,
        batch.b_req_mtp_start_loc,
        new_next_token_ids,
        batch.b_req_idx,
        logits.to(device),
        zero_spent,
        zero_budget,
        math.inf,
        None,
    )
    assert torch.equal(asd_len, strict_len)
    assert torch.equal(asd_index, strict_index)
    assert torch.equal(new_next_token_ids, batch.new_next_token_ids)
    assert torch.count_nonzero(zero_spent) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_asd_verify_rejects_bad_inputs(device):
    case = AsdCase(3, 2, 8, torch.float32, math.inf, 2, False, False)
    batch, logits, spent, budget = make_asd_inputs(case)
    batch = batch.to(device)
    logits, spent, budget = logits.to(device), spent.to(device), budget.to(device)
    args = (batch.req_to_next_token_ids, batch.b_req_mtp_start_loc, batch.new_next_token_ids, batch.b_req_idx)
    with pytest.raises(TypeError, match="logits"):
        mtp_asd_verify(*args, logits.double(), spent, budget, math.inf, 2)
    with pytest.raises(TypeError, match="req_to_asd_cum_regret"):
        mtp_asd_verify(*args, logits, spent.double(), budget, math.inf, 2)
    with pytest.raises(ValueError, match="logits"):
        mtp_asd_verify(*args, logits[:-1], spent, budget, math.inf, 2)
    with pytest.raises(ValueError, match="req_to_asd_budget"):
        mtp_asd_verify(*args, logits, spent, budget[:-1], math.inf, 2)
    with pytest.raises(ValueError, match="local_regret_ratio"):
        mtp_asd_verify(*args, logits, spent, budget, -0.5, 2)
    with pytest.raises(ValueError, match="local_regret_ratio"):
        mtp_asd_verify(*args, logits, spent, budget, math.nan, 2)
    with pytest.raises(ValueError, match="block_max_mismatch"):
        mtp_asd_verify(*args, logits, spent, budget, math.inf, -1)
    with pytest.raises(TypeError, match="block_max_mismatch"):
        mtp_asd_verify(*args, logits, spent, budget, math.inf, 1.5)
