"""plan_chunks: which prompts one step prefills and how many tokens each, by hand."""

import pytest

from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import plan_chunks


@pytest.mark.parametrize(
    "remaining,budget,plan",
    [
        ([3000, 90, 120], 512, [(0, 302), (1, 90), (2, 120)]),  # the short prompts whole, the long one the rest
        ([3000, 90, 120], 200, [(0, 110), (1, 90)]),  # 120 no longer fits whole after 90: the oldest gets 110
        ([100, 200], 512, [(0, 100), (1, 200)]),  # everything fits
        ([600, 700], 512, [(0, 512)]),  # nothing fits whole: the oldest alone
        ([600, 50, 700, 60], 100, [(0, 50), (1, 50)]),  # 60 does not fit after 50: the oldest takes the 50 left
        ([600, 50, 700, 40], 100, [(0, 10), (1, 50), (3, 40)]),
        ([5], 1, [(0, 1)]),
    ],
)
def test_short_prompts_whole_first_then_the_oldest_partial(remaining, budget, plan):
    assert plan_chunks(remaining, budget) == plan
    assert sum(n for _, n in plan) <= budget


def test_every_token_of_the_budget_is_used_while_prompts_last():
    remaining = [700, 30, 2000, 64]
    steps = 0
    while any(remaining):
        plan = plan_chunks(remaining, 256)
        assert sum(n for _, n in plan) == min(256, sum(remaining))
        for i, n in plan:
            remaining[i] -= n
        remaining = [n for n in remaining if n]
        steps += 1
    assert steps == -(-2794 // 256)
