"""MTP and ASD flag validation in _launch_subprocesses (validate_start_args)."""
import math

import pytest

from lightllm.server.api_start import StartArgsError, validate_start_args
from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.server.start_args_util import fake_draft_dir, fake_model_dir


def _mtp(tmp_path, **kw):
    base = dict(model_dir=fake_model_dir(tmp_path), mtp_mode="eagle_with_att", mtp_step=3,
                mtp_draft_model_dir=[fake_draft_dir(tmp_path)])
    base.update(kw)
    return StartArgs(**base)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"mtp_step": 0}, "--mtp_step"),
        ({"mtp_step": 8}, "--mtp_step"),
        ({"mtp_draft_model_dir": ["/nope"]}, "--mtp_draft_model_dir"),
        ({"mtp_asd_regret_budget": -1.0}, "--mtp_asd_regret_budget"),
        ({"mtp_asd_regret_budget": math.nan}, "--mtp_asd_regret_budget"),
        ({"mtp_asd_regret_budget": math.inf}, "--mtp_asd_regret_budget"),
        ({"mtp_asd_regret_budget": 1.0, "mtp_asd_local_regret_ratio": -0.1}, "--mtp_asd_local_regret_ratio"),
        ({"mtp_asd_regret_budget": 1.0, "mtp_asd_local_regret_ratio": math.inf}, "--mtp_asd_local_regret_ratio"),
        ({"mtp_asd_regret_budget": 1.0, "mtp_asd_block_max_mismatch": -1}, "--mtp_asd_block_max_mismatch"),
        ({"mtp_asd_regret_budget": 1.0, "mtp_asd_block_max_mismatch": 1.5}, "--mtp_asd_block_max_mismatch"),
        ({"mtp_asd_local_regret_ratio": 0.25}, "--mtp_asd_local_regret_ratio"),  # no budget: ASD is off
    ],
)
def test_bad_mtp_or_asd_flag(tmp_path, kwargs, flag):
    with pytest.raises(StartArgsError) as e:
        validate_start_args(_mtp(tmp_path, **kwargs))
    assert str(e.value).startswith(flag + ":")


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"mtp_step": 2}, "--mtp_step"),
        ({"mtp_draft_model_dir": ["x"]}, "--mtp_draft_model_dir"),
        ({"mtp_asd_regret_budget": 1.0}, "--mtp_asd_regret_budget"),
        ({"mtp_asd_block_max_mismatch": 1}, "--mtp_asd_block_max_mismatch"),
    ],
)
def test_mtp_and_asd_flags_need_a_mode(tmp_path, kwargs, flag):
    with pytest.raises(StartArgsError) as e:
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), **kwargs))
    assert str(e.value).startswith(flag + ":")


def test_eagle_takes_exactly_one_draft(tmp_path):
    with pytest.raises(StartArgsError, match="--mtp_draft_model_dir"):
        validate_start_args(_mtp(tmp_path, mtp_draft_model_dir=[fake_draft_dir(tmp_path, "a"), fake_draft_dir(tmp_path, "b")]))


@pytest.mark.parametrize("mode, draft, message", [
    ("eagle_with_att", dict(model_type="llama"), "is not an MTP draft: .*model_type must be 'llama_mtp'"),
    ("eagle_no_att", dict(), "with_attention=True, which does not fit --mtp_mode eagle_no_att"),
    ("eagle_with_att", dict(hidden_size=32), "has hidden_size 32, the target model 64"),
    ("eagle_with_att", dict(vocab_size=99), "has vocab_size 99, the target model 256"),
])
def test_a_draft_that_does_not_fit_is_refused_at_start(tmp_path, mode, draft, message):
    """Before: the worker found out after loading the target, with a traceback."""
    target = fake_model_dir(tmp_path, "target", hidden_size=64, vocab_size=256)
    with pytest.raises(StartArgsError, match="^--mtp_draft_model_dir: .*" + message):
        validate_start_args(_mtp(tmp_path, model_dir=target, mtp_mode=mode,
                                 mtp_draft_model_dir=[fake_draft_dir(tmp_path, "bad", **draft)]))


def test_valid_asd_flags(tmp_path):
    args = validate_start_args(_mtp(tmp_path, mtp_asd_regret_budget=0.0, mtp_asd_local_regret_ratio=0.25,
                                    mtp_asd_block_max_mismatch=2))
    assert args.asd_enabled and args.mtp_asd_regret_budget == 0.0
    assert not validate_start_args(_mtp(tmp_path)).asd_enabled
