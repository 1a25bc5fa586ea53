"""benchmarks/asd_arms_inprocess.py: arm parsing and the per-arm arithmetic, on hand-made results."""
import argparse
import importlib.util
import os

import pytest

from lightllm.server.offline_engine import GenResult

_spec = importlib.util.spec_from_file_location(
    "asd_arms_inprocess", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "asd_arms_inprocess.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)


def test_parse_arm():
    assert arms.parse_arm("strict").start_args() == {}
    assert arms.parse_arm("2.0625:0.25:2").start_args() == dict(
        mtp_asd_regret_budget=2.0625, mtp_asd_local_regret_ratio=0.25, mtp_asd_block_max_mismatch=2)
    with pytest.raises(argparse.ArgumentTypeError, match="B:g:m"):
        arms.parse_arm("8:0.25")


def test_summarize_by_hand():
    # 10 tokens, 6 accepted drafts (2 of them relaxed): 4 steps -> 2.5 tokens/step, 1.0 exact/step;
    # 3 tokens, 1 accepted draft: 2 steps. Together: 13 tokens in 6 steps.
    res = [GenResult(token_ids=list(range(10)), mtp_accepted_token_num=6, asd_relaxed_token_num=2),
           GenResult(token_ids=[1, 2, 3], mtp_accepted_token_num=1)]
    r = arms.summarize("x", res, 1.5)
    assert (r.output_tokens, r.accepted_drafts, r.relaxed_tokens) == (13, 7, 2)
    assert r.tokens_per_step == pytest.approx(13 / 6)
    assert r.exact_matches_per_step == pytest.approx(5 / 6)
    assert r.token_ids == [list(range(10)), [1, 2, 3]]
