"""Inputs of the MTP verify kernel tests: random verify batches and random ASD cases, shared
by the Triton kernels' tests (test_mtp_utils.py) and their PyTorch twins' tests
(unit_tests/common/basemodel/test_mtp_verify_torch.py). ``ref_asd_verify`` runs the readable
reference of mtp_reference.py on one case's inputs."""
import math
from dataclasses import dataclass

import torch

from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID
from unit_tests.common.basemodel.triton_kernel.mtp_reference import ref_mtp_asd_verify

TABLE_WIDTH = 8  # the engine's next-token table width (K <= 7)
MAX_REQ = 12  # table rows are MAX_REQ + 1; the last is the HOLD row
HOLD_REQ_IDX = MAX_REQ
LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class VerifyBatch:
    req_to_next_token_ids: torch.Tensor  # [max_req + 1, W] int64, the last row is the HOLD row
    b_req_mtp_start_loc: torch.Tensor  # [num_reqs] int32
    new_next_token_ids: torch.Tensor  # [batch] int64
    b_req_idx: torch.Tensor  # [batch] int32

    def to(self, device: str) -> "VerifyBatch":
        return type(self)(*(t.to(device) for t in vars(self).values()))


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


ASD_CASES = _random_asd_cases(24)


def ref_asd_verify(batch: VerifyBatch, logits: torch.Tensor, spent: torch.Tensor, budget: torch.Tensor,
                   case: AsdCase):
    """ref_mtp_asd_verify on make_asd_inputs(case)'s tensors with the case's g and m:
    (accept_len, accepted_index, committed next_token_ids, updated ledger)."""
    return ref_mtp_asd_verify(
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
