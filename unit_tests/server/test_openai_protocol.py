"""OpenAI request bodies parsed without a server: hand-written bodies against the fields the docs
promise (README "HTTP API", docs/limits.md)."""
import pytest

from lightllm.server.core.objs.sampling_params import SamplingParamsError
from lightllm.server.openai_protocol import (ModelNotFound, client_error, client_text, openai_names,
                                             parse_openai_request)

MODEL = "served-model"


def test_chat_defaults_and_roles():
    body = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]},
                         {"role": "user", "content": "hi"}]}
    req = parse_openai_request(body, chat=True, served_model=MODEL)
    assert req.messages == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}]
    assert req.prompt is None
    assert req.params.max_new_tokens == 16 and req.params.do_sample  # OpenAI's defaults: 16 tokens, temperature 1
    assert (req.stream, req.include_usage) == (False, False)
    assert (req.choices.n, req.choices.logprobs, req.choices.top_logprobs) == (1, False, 0)
    assert req.choice_params == [req.params]


def test_completion_choices_seeds_and_logprobs():
    body = {"prompt": ["once"], "n": 3, "seed": 7, "temperature": 0.5, "logprobs": 2, "max_completion_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}, "model": MODEL}
    req = parse_openai_request(body, chat=False, served_model=MODEL)
    assert req.prompt == "once" and req.messages is None
    assert req.params.max_new_tokens == 5 and req.params.top_logprobs == 2
    assert [p.seed for p in req.choice_params] == [7, 8, 9]  # choice i samples with seed + i
    assert (req.stream, req.include_usage) == (True, True)


def test_temperature_zero_is_greedy():
    req = parse_openai_request({"prompt": "x", "temperature": 0}, chat=False, served_model=MODEL)
    assert not req.params.do_sample


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "x", "frobnicate": 1}, False, "frobnicate"),
    ({"prompt": "x", "echo": True}, False, "echo"),
    ({"prompt": "x", "n": 0}, False, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, False, "best_of"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),
    ({"prompt": 3}, False, "prompt"),
])
def test_refusals_name_the_field(body, chat, field):
    with pytest.raises(SamplingParamsError) as e:
        parse_openai_request(body, chat=chat, served_model=MODEL)
    assert e.value.field_name == field


def test_other_model_is_not_found():
    with pytest.raises(ModelNotFound, match="other"):
        parse_openai_request({"prompt": "x", "model": "other"}, chat=False, served_model=MODEL)


def test_client_error_uses_the_clients_names():
    body = {"prompt": "x", "max_completion_tokens": -1}
    with pytest.raises(SamplingParamsError) as e:
        parse_openai_request(body, chat=False, served_model=MODEL)
    renamed = client_error(e.value, openai_names(body, "prompt"))
    assert renamed.field_name == "max_completion_tokens"
    assert "max_new_tokens" not in str(renamed)


def test_client_text_escapes_and_shortens():
    assert client_text("a\ud800b") == "a\\ud800b"
    assert client_text("abcdef", 3) == "abc..."
