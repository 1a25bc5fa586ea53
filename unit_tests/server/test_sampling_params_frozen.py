"""SamplingParams is normalised once, at construction, and never changes after; the
per-request ASD budget rule (one place, used by the HTTP server and the offline engine)."""
import dataclasses
from types import SimpleNamespace

import pytest

from lightllm.server.core.objs.sampling_params import TOP_K_GREEDY, SamplingParams, SamplingParamsError
from lightllm.server.httpserver.manager import HttpServerManager

SERVER_BUDGET = 2.0
OWN_BUDGET = 0.5


def test_params_are_frozen_after_validation():
    sp = SamplingParams.from_request({"do_sample": True, "top_k": 50, "temperature": 0.7})
    for name, value in (("top_k", 1), ("stop_token_ids", [[1]]), ("temperature", 1.0)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sp, name, value)
    assert (sp.top_k, sp.temperature) == (50, 0.7)


def test_normalised_at_construction_whatever_the_entry_point():
    direct = SamplingParams(top_k=50, temperature=0.0, do_sample=True, stop_sequences="x", logit_bias={"3": 1})
    parsed = SamplingParams.from_request({"top_k": 50, "temperature": 0, "do_sample": True,
                                          "stop_sequences": "x", "logit_bias": {"3": 1}})
    assert direct == parsed
    assert direct.top_k == TOP_K_GREEDY and direct.temperature == 1.0
    assert direct.stop_sequences == ["x"] and direct.logit_bias == {3: 1.0}
    with pytest.raises(SamplingParamsError):
        SamplingParams(top_k=0, do_sample=True)


def test_replace_validates_again_and_leaves_the_original():
    sp = SamplingParams.from_request({"do_sample": True, "top_k": 5})
    copy = dataclasses.replace(sp, stop_token_ids=[[7, 8]])
    assert copy.stop_token_ids == [[7, 8]] and sp.stop_token_ids == []
    assert dataclasses.replace(copy, stop_token_ids=[]) == sp  # normalising twice changes nothing
    with pytest.raises(SamplingParamsError) as e:
        dataclasses.replace(sp, top_p=2.0)
    assert e.value.field_name == "top_p"


def test_http_manager_sends_stop_ids_on_a_copy():
    fake = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens: [ord(c) for c in s]))
    sp = SamplingParams.from_request({"stop_sequences": ["ab", "c"]})
    sent = HttpServerManager._worker_params(fake, sp)
    assert sent.stop_token_ids == [[97, 98], [99]] and sp.stop_token_ids == []


@pytest.mark.parametrize("raw,server_budget,expected", [
    ({}, None, 0.0),  # no ASD on the server
    ({}, SERVER_BUDGET, SERVER_BUDGET),  # greedy: the server's budget
    ({"asd_regret_budget": OWN_BUDGET}, SERVER_BUDGET, OWN_BUDGET),  # its own budget
    ({"asd_regret_budget": 0}, SERVER_BUDGET, 0.0),  # its own 0: strict
    ({"do_sample": True, "asd_regret_budget": OWN_BUDGET}, SERVER_BUDGET, 0.0),  # sampled: strict
    ({"do_sample": True, "temperature": 0}, SERVER_BUDGET, SERVER_BUDGET),  # temperature 0 is greedy
])
def test_asd_budget_rule(raw, server_budget, expected):
    assert SamplingParams.from_request(raw).asd_budget(server_budget) == expected
