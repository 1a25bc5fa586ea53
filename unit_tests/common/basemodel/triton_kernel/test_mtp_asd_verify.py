"""The properties of the ASD rule (docs/asd.md, "The rule"), one test each, on hand-made logits.

Vocabulary of 4 tokens. Every regret is computed by hand in a comment:
r_j = max(0, z_j[t_j] - z_j[d_j]), suffix value v_j = K - j. All values are exact
binary fractions, so fp32 arithmetic is exact and the expected ledger is exact.
"""
import math
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from unit_tests.devices import KERNEL_DEVICES

from lightllm.common.basemodel.triton_kernel.mtp_utils import (
    NO_DRAFT_TOKEN_ID,
    mtp_asd_verify,
    mtp_scatter_next_token_ids,
    mtp_verify,
)
from unit_tests.common.basemodel.triton_kernel.mtp_cases import TABLE_WIDTH, VerifyBatch

pytestmark = pytest.mark.spread  # kernel variants to compile, no shared fixtures: one test per worker

DEVICES = KERNEL_DEVICES

VOCAB = 4
MAX_REQ = 4
HOLD_REQ_IDX = MAX_REQ  # the padding req_idx: budget 0
LAST_TOKEN = 0  # column 0 of the table: the last committed token (not read by verify)
UNSET_RATIO = math.inf
UNSET_CAP = None
BIG_BUDGET = 100.0
# Logits past the vocabulary (and before the first row) in the padded layout: a wrong
# read there would make any draft look like a zero-regret token.
POISON_LOGIT = 1e4


@dataclass
class Req:
    req_idx: int
    drafts: List[int]  # [K] d_0..d_{K-1}
    rows: List[List[float]]  # [K + 1, VOCAB] processed logits z_0..z_K
    targets: Optional[List[int]] = None  # [K + 1] t_j; default: the row argmax (greedy)


@dataclass
class Step(VerifyBatch):
    """A verify batch (table [MAX_REQ + 1, TABLE_WIDTH]) with its processed logits."""

    logits: torch.Tensor  # [batch, VOCAB] fp32


def build_step(reqs: List[Req], device: str, padded_logits: bool = False) -> Step:
    table = torch.full((MAX_REQ + 1, TABLE_WIDTH), 3, dtype=torch.int64)
    starts, req_ids, targets, rows = [], [], [], []
    for req in reqs:
        assert len(req.rows) == len(req.drafts) + 1
        table[req.req_idx, 0] = LAST_TOKEN
        table[req.req_idx, 1 : 1 + len(req.drafts)] = torch.tensor(req.drafts, dtype=torch.int64)
        starts.append(len(targets))
        req_ids += [req.req_idx] * len(req.rows)
        row_logits = torch.tensor(req.rows, dtype=torch.float32)
        targets += req.targets if req.targets is not None else row_logits.argmax(dim=-1).tolist()
        rows.append(row_logits)
    logits = torch.cat(rows)
    if padded_logits:
        # Rows of a wider buffer (row stride VOCAB + 2) that starts one row late.
        storage = torch.full((logits.shape[0] + 1, VOCAB + 2), POISON_LOGIT)
        storage[1:, :VOCAB] = logits
        logits = storage[1:, :VOCAB]
    return Step(
        table.to(device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(targets, dtype=torch.int64, device=device),
        torch.tensor(req_ids, dtype=torch.int32, device=device),
        logits.to(device),
    )


def ledger(values: dict, device: str) -> torch.Tensor:
    """[MAX_REQ + 1] fp32 with ``values`` at the given req_idx, 0 elsewhere."""
    t = torch.zeros(MAX_REQ + 1, dtype=torch.float32)
    for idx, v in values.items():
        t[idx] = v
    return t.to(device)


def asd(step: Step, spent: torch.Tensor, budget: torch.Tensor, ratio=UNSET_RATIO, cap=UNSET_CAP):
    """Run mtp_asd_verify; returns (accept_len, accepted_index, committed tokens) as lists.
    ``spent`` is updated in place."""
    committed = step.new_next_token_ids.clone()
    accept_len, accepted_index = mtp_asd_verify(
        step.req_to_next_token_ids,
        step.b_req_mtp_start_loc,
        committed,
        step.b_req_idx,
        step.logits,
        spent,
        budget,
        ratio,
        cap,
    )
    return accept_len.tolist(), accepted_index.tolist(), committed.tolist()


def strict(step: Step):
    accept_len, accepted_index = mtp_verify(
        step.req_to_next_token_ids, step.b_req_mtp_start_loc, step.new_next_token_ids, step.b_req_idx
    )
    return accept_len.tolist(), accepted_index.tolist(), step.new_next_token_ids.tolist()


# Rows reused below. z = [z(0), z(1), z(2), z(3)], the target is the argmax.
ROW_TIE_0_1 = [2.0, 2.0, 0.0, 0.0]  # t = 0 (first max); draft 1 ties: r = 0
ROW_T1 = [0.0, 3.0, 1.0, 0.0]  # t = 1; draft 2: r = 2
ROW_T3 = [0.0, 0.0, 1.5, 2.0]  # t = 3; draft 2: r = 0.5
ROW_T2 = [0.0, 1.0, 2.0, 1.25]  # t = 2; draft 3: r = 0.75, draft 1: r = 1
ROW_ANY = [1.0, 0.0, 0.0, 0.0]  # t = 0, a bonus/correction row


def _equivalence_step(device):
    return build_step(
        [
            # Tie at j=0 (r_0 = 0), exact match at j=1, r_2 = 0.5 at j=2.
            Req(0, [1, 1, 2], [ROW_TIE_0_1, ROW_T1, ROW_T3, ROW_ANY]),
            # Exact match at j=0, mismatch r_1 = 0.5, then exact.
            Req(1, [1, 2, 2], [ROW_T1, ROW_T3, ROW_T2, ROW_ANY]),
            # All exact: accept_len 4.
            Req(2, [0, 1, 3], [ROW_ANY, ROW_T1, ROW_T3, ROW_ANY]),
            # No proposal at j=1.
            Req(3, [0, NO_DRAFT_TOKEN_ID, 2], [ROW_ANY, ROW_T3, ROW_T2, ROW_ANY]),
        ],
        device,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strict_arm", ["budget_0", "exhausted_budget", "cap_0", "ratio_0"])
def test_property1_strict_arms_equal_mtp_verify_including_ties(device, strict_arm):
    step = _equivalence_step(device)
    expected = strict(step)
    assert expected[0] == [1, 2, 4, 2]

    budget_value, spent_value, ratio, cap = {
        "budget_0": (0.0, 0.0, UNSET_RATIO, UNSET_CAP),
        "exhausted_budget": (1.5, 1.5, UNSET_RATIO, UNSET_CAP),  # spent == B
        "cap_0": (BIG_BUDGET, 0.0, UNSET_RATIO, 0),
        "ratio_0": (BIG_BUDGET, 0.0, 0.0, UNSET_CAP),
    }[strict_arm]
    budget = ledger({i: budget_value for i in range(MAX_REQ)}, device)
    spent = ledger({i: spent_value for i in range(MAX_REQ)}, device)
    spent_before = spent.clone()
    assert asd(step, spent, budget, ratio, cap) == expected
    assert torch.equal(spent, spent_before)

    # The same batch with a free budget relaxes the tie and the small regrets: not vacuous.
    free = asd(step, ledger({}, device), ledger({i: BIG_BUDGET for i in range(MAX_REQ)}, device))
    assert free[0] == [4, 4, 4, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_property2_budget_deduction_charges_only_accepted_prefix(device):
    step = build_step(
        [
            # B = 1, spent = 0.25 -> B - spent = 0.75.
            # j=0: d=2 vs t=3, r = 2.0 - 1.5 = 0.5; risk 0.5 <= 0.75: relaxed.
            # j=1: exact.  j=2: d=2 vs t=3, r = 0.5; risk 1.0 > 0.75: rejected, not charged.
            Req(0, [2, 1, 2], [ROW_T3, ROW_T1, ROW_T3, ROW_ANY]),
            # B = 1, spent = 0.25: j=0: d=3 vs t=2, r = 2 - 1.25 = 0.75; risk 0.75 <= 0.75 (tie of the
            # budget test): relaxed; spent reaches B = 1 exactly. j=1: tie, r = 0, but risk_before
            # = 0.75 is not < 0.75: rejected.
            Req(1, [3, 1, 0], [ROW_T2, ROW_TIE_0_1, ROW_ANY, ROW_ANY]),
            # Exhausted: spent = B = 0.5; a tie (r = 0) is still refused.
            Req(2, [1, 1, 0], [ROW_TIE_0_1, ROW_T1, ROW_ANY, ROW_ANY]),
        ],
        device,
    )
    budget = ledger({0: 1.0, 1: 1.0, 2: 0.5}, device)
    spent = ledger({0: 0.25, 1: 0.25, 2: 0.5}, device)
    accept_len, accepted_index, committed = asd(step, spent, budget)

    assert accept_len == [3, 2, 1]
    assert accepted_index == [1, 1, 1, 0] + [1, 1, 0, 0] + [1, 0, 0, 0]
    # Relaxed rows commit the draft; the correction row keeps its target.
    assert committed[0:3] == [2, 1, 3]
    assert committed[4:6] == [3, 0]
    assert committed[8] == 0
    assert spent.tolist() == [0.75, 1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_property3_local_ratio_gate_uses_suffix_value(device):
    # K = 4, g = 0.5; every mismatch is d=1 vs t=2 on ROW_T2: r = 2 - 1 = 1.
    row_r1 = ROW_T2
    step = build_step(
        [
            # j=0: v = 4, r/v = 0.25 <= 0.5: relaxed; then exact -> all accepted.
            Req(0, [1, 1, 2, 3], [row_r1, ROW_T1, ROW_T2, ROW_T3, ROW_ANY]),
            # j=2: v = 2, r/v = 0.5 <= 0.5: relaxed (the gate's equality).
            Req(1, [1, 2, 1, 3], [ROW_T1, ROW_T2, row_r1, ROW_T3, ROW_ANY]),
            # j=3: v = 1, r/v = 1 > 0.5: refused.
            Req(2, [1, 2, 3, 1], [ROW_T1, ROW_T2, ROW_T3, row_r1, ROW_ANY]),
        ],
        device,
    )
    budget = ledger({0: BIG_BUDGET, 1: BIG_BUDGET, 2: BIG_BUDGET}, device)
    spent = ledger({}, device)
    accept_len, _, committed = asd(step, spent, budget, ratio=0.5)
    assert accept_len == [5, 5, 4]
    assert committed[0] == 1 and committed[5 + 2] == 1
    assert committed[10 + 3] == 2  # refused row keeps its target (the correction)
    assert spent.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def _cap_step(device):
    # K = 3, two mismatches d=2 vs t=3 on ROW_T3: r = 0.5 each.
    return build_step(
        [
            Req(0, [2, 2, 1], [ROW_T3, ROW_T3, ROW_T1, ROW_ANY]),
            Req(1, [2, 2, 1], [ROW_T3, ROW_T3, ROW_T1, ROW_ANY]),
        ],
        device,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_property4_mismatch_cap_resets_each_step_budget_does_not(device):
    # m = 1. Request 0 has a big budget, request 1 has B = 0.75.
    budget = ledger({0: BIG_BUDGET, 1: 0.75}, device)
    spent = ledger({}, device)

    # Step 1: j=0 relaxed (relaxed = 1 <= m), j=1 refused by the cap (relaxed would be 2).
    accept_len, _, committed = asd(_cap_step(device), spent, budget, cap=1)
    assert accept_len == [2, 2]
    assert committed[0] == 2 and committed[1] == 3 and committed[4] == 2
    assert spent.tolist()[:2] == [0.5, 0.5]

    # Step 2, same drafts: the cap starts again at 0 (request 0 relaxes j=0 again);
    # the budget does not (request 1: B - spent = 0.25 < r = 0.5, refused).
    accept_len, _, committed = asd(_cap_step(device), spent, budget, cap=1)
    assert accept_len == [2, 1]
    assert committed[4] == 3
    assert spent.tolist()[:2] == [1.0, 0.5]

    # Without the cap, the same step relaxes both mismatches of request 0 (not vacuous).
    spent = ledger({}, device)
    assert asd(_cap_step(device), spent, budget)[0] == [4, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_property5_all_accepted_keeps_bonus_target(device):
    step = build_step(
        [
            # j=0 relaxed (r = 0.5), j=1 exact, j=2 relaxed (r = 0.75): bonus row 3 commits t_3 = 0.
            Req(0, [2, 1, 3], [ROW_T3, ROW_T1, ROW_T2, ROW_ANY]),
            # All exact: the same as strict, bonus row commits t_3 = 3.
            Req(1, [1, 3, 2], [ROW_T1, ROW_T3, ROW_T2, ROW_T3]),
        ],
        device,
    )
    budget = ledger({0: BIG_BUDGET, 1: BIG_BUDGET}, device)
    spent = ledger({}, device)
    accept_len, accepted_index, committed = asd(step, spent, budget)
    assert accept_len == [4, 4]
    assert accepted_index == [1] * 8
    assert committed == [2, 1, 3, 0] + [1, 3, 2, 3]
    assert spent.tolist()[:2] == [1.25, 0.0]

    # The next step's table row comes from the bonus row (accept_len - 1 = 3).
    all_next_token_ids = torch.arange(8 * 4, dtype=torch.int64, device=device).view(8, 4)
    mtp_scatter_next_token_ids(
        step.req_to_next_token_ids,
        step.b_req_mtp_start_loc,
        all_next_token_ids,
        step.b_req_idx,
        torch.tensor(accept_len, dtype=torch.int32, device=device),
    )
    assert step.req_to_next_token_ids[0, :4].tolist() == all_next_token_ids[3].tolist()
    assert step.req_to_next_token_ids[1, :4].tolist() == all_next_token_ids[7].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_property6_budget_persists_across_steps_and_resets_on_req_idx_reuse(device):
    # Request on req_idx 1, B = 0.75; every step: j=0 is d=2 vs t=3, r = 0.5.
    def one_step():
        return build_step([Req(1, [2, 1], [ROW_T3, ROW_T1, ROW_ANY])], device)

    untouched = {0: 0.125, 2: 0.375, 3: 0.625}  # other requests' ledgers
    budget = ledger({0: 1.0, 1: 0.75, 2: 1.0, 3: 1.0}, device)
    spent = ledger(untouched, device)

    assert asd(one_step(), spent, budget)[0] == [3]  # spent 0 -> 0.5
    assert spent[1].item() == 0.5
    assert asd(one_step(), spent, budget)[0] == [1]  # B - spent = 0.25 < 0.5: strict
    assert spent[1].item() == 0.5

    # The request finishes; req_idx 1 goes to a new request. init_req_sampling_params
    # zeroes its ledger row, so the new request has its full budget again.
    spent[1] = 0.0
    assert asd(one_step(), spent, budget)[0] == [3]
    assert spent[1].item() == 0.5
    # No other req_idx was ever written.
    for idx, value in untouched.items():
        assert spent[idx].item() == value
    assert spent[HOLD_REQ_IDX].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_property7_invalid_drafts_and_hold_rows(device):
    step = build_step(
        [
            # Out-of-vocabulary drafts on rows whose neighbours in memory are poison
            # (a read would give r = 0 and relax): never read, never relaxed.
            Req(0, [NO_DRAFT_TOKEN_ID, 1, 1], [ROW_T3, ROW_T3, ROW_T3, ROW_ANY]),
            Req(1, [VOCAB, 1, 1], [ROW_T3, ROW_T3, ROW_T3, ROW_ANY]),
            Req(2, [VOCAB + 1, 1, 1], [ROW_T3, ROW_T3, ROW_T3, ROW_ANY]),
            # Two padding requests on the HOLD row: their ties (r = 0) would be free,
            # but the HOLD budget is 0.
            Req(HOLD_REQ_IDX, [1, 1, 1], [ROW_TIE_0_1, ROW_TIE_0_1, ROW_TIE_0_1, ROW_ANY]),
            Req(HOLD_REQ_IDX, [1, 1, 1], [ROW_TIE_0_1, ROW_TIE_0_1, ROW_TIE_0_1, ROW_ANY]),
        ],
        device,
        padded_logits=True,
    )
    budget = ledger({0: BIG_BUDGET, 1: BIG_BUDGET, 2: BIG_BUDGET}, device)
    # Sentinel on the HOLD ledger (spent > B = 0): any write would clamp it to 0.
    spent = ledger({HOLD_REQ_IDX: 0.5}, device)
    spent_before = spent.clone()
    accept_len, _, committed = asd(step, spent, budget)
    assert accept_len == [1, 1, 1, 1, 1]
    assert committed == step.new_next_token_ids.tolist()
    assert torch.equal(spent, spent_before)
    assert (accept_len, committed) == tuple(strict(step)[i] for i in (0, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_property8_no_proposal_columns_are_never_relaxed(device):
    step = build_step(
        [
            # A request whose draft columns hold no proposal this step (first decode after prefill).
            Req(0, [NO_DRAFT_TOKEN_ID] * 3, [ROW_TIE_0_1, ROW_T1, ROW_T3, ROW_ANY]),
            # A real proposal in the same batch: the tie (r = 0) and r = 0.5 are relaxed.
            Req(1, [1, 1, 2], [ROW_TIE_0_1, ROW_T1, ROW_T3, ROW_ANY]),
        ],
        device,
    )
    budget = ledger({0: BIG_BUDGET, 1: BIG_BUDGET}, device)
    spent = ledger({}, device)
    accept_len, accepted_index, committed = asd(step, spent, budget)
    assert accept_len == [1, 4]
    assert accepted_index[:4] == [1, 0, 0, 0]
    assert committed[:4] == step.new_next_token_ids.tolist()[:4]
    assert spent.tolist()[:2] == [0.0, 0.5]


@pytest.mark.parametrize("device", DEVICES)
def test_masked_draft_token_is_never_relaxed(device):
    """A draft whose logit is -inf (masked by a logit bias or a penalty) has r = inf:
    refused by the budget test even with g unset (inf / v <= inf holds). A NaN row
    gives r = NaN, which fails every gate."""
    ninf, nan = float("-inf"), float("nan")
    step = build_step(
        [
            Req(0, [2, 1], [[0.0, 1.0, ninf, 3.0], ROW_T1, ROW_ANY]),  # t = 3: r = 3 - (-inf) = inf
            Req(1, [2, 1], [[nan, 1.0, 0.0, 3.0], ROW_T1, ROW_ANY], targets=[3, 1, 0]),  # NaN elsewhere: r = 3 - 0 = 3
            Req(2, [2, 1], [[0.0, 1.0, nan, 3.0], ROW_T1, ROW_ANY], targets=[3, 1, 0]),  # r = 3 - NaN = NaN
        ],
        device,
    )
    budget = ledger({0: BIG_BUDGET, 1: BIG_BUDGET, 2: BIG_BUDGET}, device)
    spent = ledger({}, device)
    accept_len, _, committed = asd(step, spent, budget)
    # Request 1 only has a NaN elsewhere in its row: its finite regret 3 is relaxed.
    assert accept_len == [1, 3, 1]
    assert committed == [3, 1, 0] + [2, 1, 0] + [3, 1, 0]
    assert spent.tolist() == [0.0, 3.0, 0.0, 0.0, 0.0]
