"""OpenAI request bodies parsed without a server: hand-written bodies against the fields the docs
promise (README "HTTP API", docs/limits.md)."""
import pytest

from lightllm.server.core.objs.sampling_params import SamplingParamsError
from lightllm.server.openai_protocol import (ModelNotFound, check_token_ids, client_error, client_text, error_body,
                                             fill_max_tokens, openai_names, parse_openai_request)

MODEL = "served-model"


def test_chat_defaults_and_roles():
    body = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]},
                         {"role": "user", "content": "hi"}]}
    req = parse_openai_request(body, chat=True, served_model=MODEL)
    assert req.messages == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}]
    assert req.prompts is None
    assert req.params.do_sample  # OpenAI's default temperature 1
    # no max_tokens: chat may fill the context (OpenAI's and vLLM's default), once the prompt's length is known
    assert req.fill_max_tokens
    filled = fill_max_tokens(req, prompt_tokens=10, max_model_len=256)
    assert filled.params.max_new_tokens == 246 and [p.max_new_tokens for p in filled.choice_params] == [246]
    assert fill_max_tokens(req, prompt_tokens=256, max_model_len=256).params.max_new_tokens == 1  # then refused
    assert (req.stream, req.include_usage) == (False, False)
    assert (req.choices.n, req.choices.logprobs, req.choices.top_logprobs) == (1, False, 0)
    assert req.choice_params == [req.params]


def test_completion_choices_seeds_and_logprobs():
    body = {"prompt": ["once"], "n": 3, "seed": 7, "temperature": 0.5, "logprobs": 2, "max_completion_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}, "model": MODEL}
    req = parse_openai_request(body, chat=False, served_model=MODEL)
    assert req.prompts == ["once"] and req.messages is None and not req.fill_max_tokens
    assert req.params.max_new_tokens == 5 and req.params.top_logprobs == 2
    assert [p.seed for p in req.choice_params] == [7, 8, 9]  # choice i samples with seed + i
    assert (req.stream, req.include_usage) == (True, True)


def test_max_tokens_given_or_completions_default():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for body in ({**chat, "max_tokens": 7}, {**chat, "max_completion_tokens": 7}):
        req = parse_openai_request(body, chat=True, served_model=MODEL)
        assert not req.fill_max_tokens and fill_max_tokens(req, 10, 256).params.max_new_tokens == 7
    req = parse_openai_request({"prompt": "x"}, chat=False, served_model=MODEL)
    assert req.params.max_new_tokens == 16 and not req.fill_max_tokens  # OpenAI's completions default


@pytest.mark.parametrize("prompt, prompts", [
    ("a", ["a"]),
    (["a"], ["a"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    (["a", [3]], ["a", [3]]),
])
def test_completion_prompts_as_openai_takes_them(prompt, prompts):
    assert parse_openai_request({"prompt": prompt}, chat=False, served_model=MODEL).prompts == prompts


@pytest.mark.parametrize("prompt, message", [
    ([], "must be a string, a list of token ids"),
    ([[]], "prompt: must be a string or a non-empty list of token ids"),
    ([True, 2], "[0] must be a string or a non-empty list of token ids"),
    (["a", 2.5], "[1] must be a string or a non-empty list of token ids"),
    (["a", "\ud800"], "[1] is not valid Unicode"),
])
def test_bad_prompts_say_which(prompt, message):
    with pytest.raises(SamplingParamsError) as e:
        parse_openai_request({"prompt": prompt}, chat=False, served_model=MODEL)
    assert e.value.field_name == "prompt" and message in str(e.value)


def test_prompts_times_n_is_bounded():
    parse_openai_request({"prompt": ["a"] * 64, "n": 2}, chat=False, served_model=MODEL)  # 128 choices
    with pytest.raises(SamplingParamsError, match="at most 128 choices"):
        parse_openai_request({"prompt": ["a"] * 65, "n": 2}, chat=False, served_model=MODEL)


def test_token_ids_must_be_in_the_vocabulary():
    check_token_ids([0, 99], vocab_size=100)
    for bad in (100, -1):
        with pytest.raises(SamplingParamsError, match=f"token id {bad} is not in the vocabulary"):
            check_token_ids([0, bad], vocab_size=100)


def test_fields_without_effect_are_accepted():
    chat = {"messages": [{"role": "user", "content": "x"}], "store": False, "metadata": {"k": "v"}, "user": "u",
            "service_tier": "auto", "parallel_tool_calls": True, "tools": None, "tool_choice": "none",
            "functions": [], "function_call": None, "modalities": ["text"], "audio": None, "prediction": None}
    parse_openai_request(chat, chat=True, served_model=MODEL)
    parse_openai_request({"prompt": "x", "store": True, "echo": False, "suffix": None}, chat=False, served_model=MODEL)


@pytest.mark.parametrize("body, chat, field, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True, "tools", "tool calls are not supported"),
    ({"tool_choice": "auto"}, True, "tool_choice", "tool calls are not supported"),
    ({"modalities": ["text", "audio"]}, True, "modalities", "only text output"),
    ({"tools": []}, False, "tools", "unknown field"),  # not a completions field
    ({"reasoning_effort": "low"}, True, "reasoning_effort", "unknown field"),
])
def test_unsupported_fields_say_why(body, chat, field, message):
    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    with pytest.raises(SamplingParamsError) as e:
        parse_openai_request({**base, **body}, chat=chat, served_model=MODEL)
    assert e.value.field_name == field and message in str(e.value)


def test_error_body_is_openais_error_object():
    assert error_body(400, "max_tokens", "must be >= 1, got 0") == {"error": {
        "message": "max_tokens: must be >= 1, got 0", "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    assert error_body(503, None, "busy") == {"error": {
        "message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert error_body(400, "a\ud800", "x")["error"]["param"] == "a\\ud800"  # safe for JSON


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


def test_a_field_name_with_a_colon_keeps_its_message():
    """The message is kept apart from the field (before, it was split off the text at the first ": ",
    inside such a field's name)."""
    with pytest.raises(SamplingParamsError) as e:
        parse_openai_request({"prompt": "x", "a: b": 1}, chat=False, served_model=MODEL)
    renamed = client_error(e.value, openai_names({}, "prompt"))
    assert (renamed.field_name, renamed.message) == ("a: b", "unknown field")
    assert error_body(400, renamed.field_name, renamed.message)["error"]["message"] == "a: b: unknown field"


def test_client_text_escapes_and_shortens():
    assert client_text("a\ud800b") == "a\\ud800b"
    assert client_text("abcdef", 3) == "abc..."
