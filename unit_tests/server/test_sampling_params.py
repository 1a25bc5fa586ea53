import math

import pytest

from lightllm.server.core.objs.sampling_params import TOP_K_GREEDY, SamplingParams, SamplingParamsError

BAD = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": 5}, "stop_sequences"),
    ({"seed": -1}, "seed"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": math.inf}}, "logit_bias"),
    ({"asd_regret_budget": -0.5}, "asd_regret_budget"),
    ({"asd_regret_budget": math.nan}, "asd_regret_budget"),
    ({"asd_regret_budget": math.inf}, "asd_regret_budget"),
    ({"asd_regret_budget": "1"}, "asd_regret_budget"),
    ({"no_such_param": 1}, "no_such_param"),
]


@pytest.mark.parametrize("params,field", BAD)
def test_bad_parameter_names_the_field(params, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_request(params)
    assert e.value.field_name == field
    assert str(e.value).startswith(field + ":")


def test_greedy_rule_is_top_k_one():
    assert SamplingParams.from_request({}).top_k == TOP_K_GREEDY
    assert SamplingParams.from_request({"do_sample": True, "temperature": 0.0}).top_k == TOP_K_GREEDY
    sp = SamplingParams.from_request({"do_sample": True, "temperature": 0.7, "top_k": 50})
    assert sp.top_k == 50 and not sp.is_greedy


def test_valid_values_are_kept():
    sp = SamplingParams.from_request(
        {"max_new_tokens": 5, "stop_sequences": "\n", "logit_bias": {"7": 2}, "asd_regret_budget": 0, "seed": 3}
    )
    assert sp.stop_sequences == ["\n"] and sp.logit_bias == {7: 2.0} and sp.asd_regret_budget == 0.0
    with pytest.raises(SamplingParamsError):
        sp.verify_vocab(5)


# The documented limits (docs/limits.md), as literals: (base params, field, last accepted,
# first refused). Before issue 13 every "refused" value here was accepted.
EDGES = [
    ({"do_sample": True}, "top_k", 2**31 - 1, 2**31),
    ({}, "max_new_tokens", 2**31 - 1, 2**31),
    ({"do_sample": True}, "temperature", 0.01, 0.0099),
    ({"do_sample": True}, "temperature", 100.0, 100.01),
    ({}, "repetition_penalty", 0.01, 0.0099),
    ({}, "repetition_penalty", 100.0, 100.01),
    ({}, "seed", 2**63 - 2**31, 2**63 - 2**31 + 1),
    ({}, "asd_regret_budget", 1e6, 1e6 + 1),
]


@pytest.mark.parametrize("base,name,ok,bad", EDGES)
def test_range_edges(base, name, ok, bad):
    assert getattr(SamplingParams.from_request({**base, name: ok}), name) == ok
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_request({**base, name: bad})
    assert e.value.field_name == name


def test_greedy_requests_ignore_the_sampling_temperature_minimum():
    sp = SamplingParams.from_request({"temperature": 1e-3})
    assert sp.is_greedy and sp.temperature == 1.0
    assert SamplingParams.from_request({"do_sample": True, "temperature": 0}).is_greedy


@pytest.mark.parametrize("params,field", [
    ({"logit_bias": {"3": 100.5}}, "logit_bias"),
    ({"logit_bias": {"3": -100.5}}, "logit_bias"),
    ({"logit_bias": {str(2**31): 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"logit_bias": {"3": 10**400}}, "logit_bias"),
    ({"temperature": 10**400}, "temperature"),
    ({"stop_sequences": ["x" * 1025]}, "stop_sequences"),
    ({"stop_sequences": ["a\ud800"]}, "stop_sequences"),
])
def test_values_past_the_limits_name_the_field(params, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_request(params)
    assert e.value.field_name == field


def test_values_at_the_limits_are_kept():
    sp = SamplingParams.from_request({"logit_bias": {str(i): (100 if i % 2 else -100) for i in range(1024)},
                                      "stop_sequences": ["x" * 1024]})
    assert len(sp.logit_bias) == 1024 and sp.logit_bias[1] == 100.0 and sp.logit_bias[0] == -100.0


def test_error_messages_quote_bad_values_briefly():
    deep = []
    for _ in range(500):
        deep = [deep]
    for bad in ("x" * 100000, deep):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams.from_request({"top_k": bad})
        assert len(str(e.value)) < 200
