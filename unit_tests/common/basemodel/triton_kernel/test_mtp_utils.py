"""mtp_utils kernels vs the PyTorch references of mtp_reference.py, on random batches.

Every comparison is exact (torch.equal). Kernels run in the Triton interpreter on CPU
(see conftest.py) and natively on CUDA.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from unit_tests.devices import KERNEL_DEVICES

from lightllm.common.basemodel.triton_kernel.mtp_utils import (
    NO_DRAFT_TOKEN_ID,
    gen_b_req_mtp_start_loc,
    mtp_asd_verify,
    mtp_scatter_next_token_ids,
    mtp_verify,
)
from unit_tests.common.basemodel.triton_kernel.mtp_reference import (
    ref_mtp_asd_verify,
    ref_mtp_scatter,
    ref_mtp_verify,
)

DEVICES = KERNEL_DEVICES

# Next-token table width of the engine (K <= 7) and a wider one.
TABLE_WIDTH = 8
WIDE_TABLE_WIDTH = 16
MAX_REQ = 12  # table rows are MAX_REQ + 1; the last is the HOLD row
HOLD_REQ_IDX = MAX_REQ


@dataclass
class VerifyBatch:
    req_to_next_token_ids: torch.Tensor  # [MAX_REQ + 1, W] int64
    b_req_mtp_start_loc: torch.Tensor  # [num_reqs] int32
    new_next_token_ids: torch.Tensor  # [batch] int64
    b_req_idx: torch.Tensor  # [batch] int32

    def to(self, device: str) -> "VerifyBatch":
        return VerifyBatch(*(t.to(device) for t in vars(self).values()))


def make_verify_batch(
    seed: int,
    num_reqs: int,
    num_drafts: int,
    vocab_size: int,
    mode: str = "random",
    width: int = TABLE_WIDTH,
    num_hold_reqs: int = 0,
) -> VerifyBatch:
    """``num_reqs`` real requests on distinct req_idx plus ``num_hold_reqs`` padding
    requests on the HOLD row, all with ``num_drafts`` drafts. ``mode`` picks the drafts:
    random (a random matching prefix, then random tokens), all_match, first_mismatch,
    no_draft (NO_DRAFT_TOKEN_ID columns)."""
    gen = torch.Generator().manual_seed(seed)
    rows_per_req = num_drafts + 1
    req_ids = torch.randperm(MAX_REQ, generator=gen)[:num_reqs].tolist() + [HOLD_REQ_IDX] * num_hold_reqs
    total_reqs = len(req_ids)
    batch_size = total_reqs * rows_per_req
    b_req_idx = torch.tensor(req_ids, dtype=torch.int32).repeat_interleave(rows_per_req)
    b_req_mtp_start_loc = torch.arange(total_reqs, dtype=torch.int32) * rows_per_req
    new_next_token_ids = torch.randint(0, vocab_size, (batch_size,), generator=gen)
    table = torch.randint(0, vocab_size, (MAX_REQ + 1, width), generator=gen)
    for r, req_idx in enumerate(req_ids):
        start = r * rows_per_req
        targets = new_next_token_ids[start : start + num_drafts]
        if mode == "all_match":
            num_match = num_drafts
        elif mode == "first_mismatch":
            num_match = 0
        else:
            num_match = int(torch.randint(0, num_drafts + 1, (1,), generator=gen))
        table[req_idx, 1 : 1 + num_match] = targets[:num_match]
        if num_match < num_drafts:  # a guaranteed mismatch after the prefix
            table[req_idx, 1 + num_match] = (targets[num_match] + 1) % vocab_size
        if mode == "no_draft":
            no_draft = torch.rand(num_drafts, generator=gen) < 0.5
            table[req_idx, 1 : 1 + num_drafts][no_draft] = NO_DRAFT_TOKEN_ID
    return VerifyBatch(table, b_req_mtp_start_loc, new_next_token_ids, b_req_idx)


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

LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class AsdCase:
    seed: int
    num_drafts: int
    vocab_size: int
    dtype: torch.dtype
    local_regret_ratio: float
    block_max_mismatch: int
    tied_logits: bool  # coarse logits: many exact ties between tokens
    padded_rows: bool  # logits rows wider than the vocab (row stride > vocab)

    def __str__(self):
        return (
            f"s{self.seed}-K{self.num_drafts}-V{self.vocab_size}-{str(self.dtype)[6:]}-g{self.local_regret_ratio}"
            f"-m{self.block_max_mismatch}{'-tied' if self.tied_logits else ''}{'-padded' if self.padded_rows else ''}"
        )


def _random_asd_cases(count: int):
    gen = torch.Generator().manual_seed(1234)
    ratios = [math.inf, 0.0, 0.05, 0.25, 1.0, 4.0]
    cases = []
    for seed in range(count):
        num_drafts = int(torch.randint(1, 8, (1,), generator=gen))
        mismatch_caps = [0, 1, 2, num_drafts, 100]
        cases.append(
            AsdCase(
                seed=seed,
                num_drafts=num_drafts,
                vocab_size=[5, 16, 64][seed % 3],
                dtype=LOGIT_DTYPES[seed % len(LOGIT_DTYPES)],
                local_regret_ratio=ratios[int(torch.randint(0, len(ratios), (1,), generator=gen))],
                block_max_mismatch=mismatch_caps[int(torch.randint(0, len(mismatch_caps), (1,), generator=gen))],
                tied_logits=seed % 2 == 0,
                padded_rows=seed % 4 == 1,
            )
        )
    # Boundary vocabularies (a power of two plus one, and Qwen's 151936).
    cases.append(AsdCase(900, 7, 8193, torch.bfloat16, math.inf, 100, False, True))
    cases.append(AsdCase(901, 3, 8193, torch.float32, 0.5, 2, True, False))
    cases.append(AsdCase(902, 2, 151936, torch.bfloat16, math.inf, 2, False, False))
    return cases


def make_asd_inputs(case: AsdCase, num_reqs: int = 4, num_hold_reqs: int = 1):
    """Random ASD inputs: targets are the row argmax (greedy), drafts are a mix of the
    target, the runner-up token, random tokens, NO_DRAFT_TOKEN_ID and out-of-vocabulary ids."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = make_verify_batch(
        case.seed, num_reqs, case.num_drafts, case.vocab_size, mode="random", num_hold_reqs=num_hold_reqs
    )
    batch_size = batch.b_req_idx.shape[0]
    if case.tied_logits:
        logits = torch.randint(-3, 4, (batch_size, case.vocab_size), generator=gen).float() * 0.25
    else:
        logits = torch.randn(batch_size, case.vocab_size, generator=gen) * 0.5
    logits = logits.to(case.dtype)
    # Greedy targets; a few rows keep a random (non-argmax) target, like a sampled row.
    targets = logits.float().argmax(dim=-1)
    keep_random = torch.rand(batch_size, generator=gen) < 0.2
    new_next_token_ids = torch.where(keep_random, batch.new_next_token_ids, targets)
    if case.padded_rows:
        # Poison columns past the vocab: a wrong read would look like a zero-regret draft.
        wide = torch.full((batch_size, case.vocab_size + 3), 1e4, dtype=case.dtype)
        wide[:, : case.vocab_size] = logits
        logits = wide[:, : case.vocab_size]

    runner_up = logits.float().topk(2, dim=-1).indices[:, 1]  # small-regret drafts
    table = batch.req_to_next_token_ids.clone()
    rows_per_req = case.num_drafts + 1
    for r, start in enumerate(batch.b_req_mtp_start_loc.tolist()):
        req_idx = int(batch.b_req_idx[start])
        for j in range(case.num_drafts):
            u = float(torch.rand(1, generator=gen))
            if u < 0.45:
                table[req_idx, j + 1] = new_next_token_ids[start + j]
            elif u < 0.7:
                table[req_idx, j + 1] = runner_up[start + j]
            elif u < 0.9:
                table[req_idx, j + 1] = int(torch.randint(0, case.vocab_size, (1,), generator=gen))
            elif u < 0.95:
                table[req_idx, j + 1] = NO_DRAFT_TOKEN_ID
            else:
                table[req_idx, j + 1] = case.vocab_size + int(torch.randint(0, 3, (1,), generator=gen))
        assert start == r * rows_per_req

    budget = torch.rand(MAX_REQ + 1, generator=gen) * 3.0
    budget[torch.rand(MAX_REQ + 1, generator=gen) < 0.2] = 0.0
    spent = budget * torch.rand(MAX_REQ + 1, generator=gen)
    exhausted = torch.rand(MAX_REQ + 1, generator=gen) < 0.15
    spent[exhausted] = budget[exhausted]
    budget[HOLD_REQ_IDX] = 0.0  # padding rows are strict
    spent[HOLD_REQ_IDX] = 0.0
    return VerifyBatch(table, batch.b_req_mtp_start_loc, new_next_token_ids, batch.b_req_idx), logits, spent, budget


def _run_asd_vs_reference(device, case: AsdCase):
    batch, logits, spent, budget = make_asd_inputs(case)
    ref_accept_len, ref_accepted_index, ref_next_token_ids, ref_spent = ref_mtp_asd_verify(
        batch.req_to_next_token_ids,
        batch.b_req_mtp_start_loc,
        batch.new_next_token_ids,
        batch.b_req_idx,
        logits,
        spent,
        budget,
        case.local_regret_ratio,
        case.block_max_mismatch,
    )
    batch = batch.to(device)
    new_next_token_ids = batch.new_next_token_ids.clone()
    kernel_spent = spent.to(device)
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
    )
    assert torch.equal(accept_len.cpu(), ref_accept_len)
    assert torch.equal(accepted_index.cpu(), ref_accepted_index)
    assert torch.equal(new_next_token_ids.cpu(), ref_next_token_ids)
    assert torch.equal(kernel_spent.cpu(), ref_spent)
    assert torch.all(kernel_spent.cpu() <= budget.clamp_min(spent))  # spent <= B (or untouched)
    return accept_len, ref_spent, spent


ASD_CASES = _random_asd_cases(24)


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
        asd_len, _, _, new_spent = ref_mtp_asd_verify(
            batch.req_to_next_token_ids,
            batch.b_req_mtp_start_loc,
            batch.new_next_token_ids,
            batch.b_req_idx,
            logits,
            spent,
            budget,
            case.local_regret_ratio,
            case.block_max_mismatch,
        )
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
