"""What an OpenAI-compatible request asks for: its fields checked and mapped onto SamplingParams, its
choices, stream flags and prompt (``/v1/completions``, ``/v1/chat/completions``; vLLM's
``entrypoints/openai/protocol.py``). Pure functions of the JSON body: every refusal is a
SamplingParamsError naming the client's own field (``client_error``). api_http.py reads them and
builds the answers."""
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from lightllm.server.core.objs.sampling_params import (MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError,
                                                       is_utf8_text, quote)

# Longest field name an error quotes in full
MAX_FIELD_NAME_CHARS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's newer names for roles the chat templates know by their older ones
CHAT_ROLE_ALIASES = {"developer": "system"}
# A message's content may be a list of parts; only text parts are supported. vLLM joins them so.
CHAT_TEXT_PART = "text"
CHAT_TEXT_PART_SEPARATOR = "\n"


def client_text(s: str, limit: Optional[int] = None) -> str:
    """``s`` made safe for a JSON answer: lone surrogates escaped, optionally shortened."""
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s if limit is None or len(s) <= limit else s[:limit] + "..."


def need_text(field: str, v: Any) -> str:
    if not isinstance(v, str):
        raise SamplingParamsError(field, "must be a string")
    if not is_utf8_text(v):
        raise SamplingParamsError(field, "is not valid Unicode (a lone surrogate)")
    return v


# OpenAI request fields and our sampling parameter names
OPENAI_PARAM_MAP = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop_sequences",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "ignore_eos": "ignore_eos",
    "asd_regret_budget": "asd_regret_budget",
    "response_format": "response_format",  # JSON output through xgrammar: docs/structured_output.md
}
OPENAI_MAX_TOKENS_ALIAS = "max_completion_tokens"  # what current clients send instead of max_tokens
OPENAI_IGNORED = {"user"}
OPENAI_STREAM_FIELDS = {"stream", "stream_options"}
# Fields of OpenAI's choices and log-probs (read by _openai_choices)
OPENAI_CHOICE_FIELDS = {"model", "n", "best_of", "logprobs"}
OPENAI_CHAT_ONLY_FIELDS = {"top_logprobs"}
# Fields we do not implement: accepted only at these (default) values, refused otherwise
OPENAI_DEFAULT_ONLY = {
    "echo": (None, False),
    "suffix": (None,),
}
OPENAI_DEFAULT_MAX_TOKENS = 16
OPENAI_DEFAULT_TEMPERATURE = 1.0
OPENAI_MAX_N = 128  # OpenAI's own bound on n
# Bounds on top-k alternatives: OpenAI's chat top_logprobs 0..20; completions logprobs 0..20 as vLLM
# (OpenAI itself stops at 5), the most the engine keeps per token (MAX_TOP_LOGPROBS)
OPENAI_MAX_TOP_LOGPROBS = MAX_TOP_LOGPROBS
OPENAI_MAX_COMPLETION_LOGPROBS = MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class OpenAIChoices:
    """How many choices a request asks for and what each carries (besides its text)."""

    n: int = 1
    logprobs: bool = False  # the log-prob of each returned token
    top_logprobs: int = 0  # and its most likely alternatives (chat top_logprobs, completions logprobs N)


class ModelNotFound(Exception):
    """An OpenAI request names a ``model`` this server does not serve (404, as vLLM)."""

    def __init__(self, model: str, served: str):
        super().__init__(f"The model `{client_text(model, MAX_FIELD_NAME_CHARS)}` does not exist: "
                         f"this server serves `{served}`")


def int_field(body: Dict[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    """``body[name]``: null, or an integer (not a boolean) in lo..hi."""
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
        raise SamplingParamsError(name, f"must be an integer in {lo}..{hi}, got {quote(v)}")
    return v


def openai_choices(body: Dict[str, Any], chat: bool, served_model: str) -> OpenAIChoices:
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise SamplingParamsError("model", "must be a string")
        if model != served_model:
            raise ModelNotFound(model, served_model)
    n = int_field(body, "n", 1, OPENAI_MAX_N)
    n = 1 if n is None else n
    best_of = int_field(body, "best_of", 1, OPENAI_MAX_N)
    if best_of is not None and best_of != n:
        raise SamplingParamsError("best_of", f"must equal n ({n}) or be null: choosing the best of more "
                                             f"choices is not supported, got {best_of}")
    if chat:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise SamplingParamsError("logprobs", f"must be true or false, got {quote(logprobs)}")
        top = int_field(body, "top_logprobs", 0, OPENAI_MAX_TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise SamplingParamsError("top_logprobs", "needs logprobs true")
        return OpenAIChoices(n, bool(logprobs), top or 0)
    logprobs = body.get("logprobs")
    if logprobs is False:  # what some clients send for "none"
        logprobs = None
    logprobs = int_field({"logprobs": logprobs}, "logprobs", 0, OPENAI_MAX_COMPLETION_LOGPROBS)
    return OpenAIChoices(n, logprobs is not None, logprobs or 0)


def choice_params(params: SamplingParams, n: int) -> List[SamplingParams]:
    """The parameters of each of ``n`` choices: choice i samples with seed + i when the request has
    a seed (else each draws its own noise); greedy choices are all the same, as vLLM's."""
    if n == 1 or params.seed is None:
        return [params] * n
    if params.seed + n - 1 > MAX_SEED:
        raise SamplingParamsError("seed", f"choice i uses seed + i: seed + n - 1 must be <= {MAX_SEED}")
    return [replace(params, seed=params.seed + i) for i in range(n)]


def is_one_of(v: Any, allowed: Tuple) -> bool:
    """``v`` equals one of ``allowed`` with the same JSON type (true is not 1)."""
    return any(v is a or (type(v) is type(a) and v == a) for a in allowed)


def openai_names(body: Dict[str, Any], prompt_field: str) -> Dict[str, str]:
    """Our parameter names -> the client's field names, for error messages."""
    names = {ours: theirs for theirs, ours in OPENAI_PARAM_MAP.items() if ours != theirs}
    names["inputs"] = prompt_field
    names["do_sample"] = "temperature"
    if body.get(OPENAI_MAX_TOKENS_ALIAS) is not None:
        names["max_new_tokens"] = OPENAI_MAX_TOKENS_ALIAS
    return names


def client_error(e: SamplingParamsError, names: Dict[str, str]) -> SamplingParamsError:
    """``e`` with our parameter names replaced by the client's."""
    message = str(e).split(": ", 1)[-1]
    for ours, theirs in names.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    return SamplingParamsError(names.get(e.field_name, e.field_name), message)


def openai_params(body: Dict[str, Any], prompt_field: str) -> SamplingParams:
    known = (set(OPENAI_PARAM_MAP) | {OPENAI_MAX_TOKENS_ALIAS} | OPENAI_IGNORED | OPENAI_STREAM_FIELDS
             | OPENAI_CHOICE_FIELDS | (OPENAI_CHAT_ONLY_FIELDS if prompt_field == "messages" else set()))
    unknown = sorted(set(body) - known - set(OPENAI_DEFAULT_ONLY) - {prompt_field})
    if unknown:
        raise SamplingParamsError(unknown[0], "unknown field")
    for name, allowed in OPENAI_DEFAULT_ONLY.items():
        if not is_one_of(body.get(name), allowed):
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise SamplingParamsError(name, f"is not supported: only {shown} (the default), got {quote(body[name])}")
    params = {ours: body[theirs] for theirs, ours in OPENAI_PARAM_MAP.items() if theirs in body}
    alias = body.get(OPENAI_MAX_TOKENS_ALIAS)
    if alias is not None:
        given = body.get("max_tokens")
        if given is not None and not is_one_of(given, (alias,)):
            raise SamplingParamsError(OPENAI_MAX_TOKENS_ALIAS, f"{quote(alias)} differs from max_tokens {quote(given)}")
        params["max_new_tokens"] = alias
    if params.get("max_new_tokens") is None:
        params["max_new_tokens"] = OPENAI_DEFAULT_MAX_TOKENS
    temperature = params.get("temperature", OPENAI_DEFAULT_TEMPERATURE)
    # OpenAI semantics: temperature 0 (or top_k 1) is greedy, anything else samples
    params["do_sample"] = not (temperature == 0 and not isinstance(temperature, bool)) and params.get("top_k") != 1
    return SamplingParams.from_request(params)


def openai_stream_flags(body: Dict[str, Any]) -> Tuple[bool, bool]:
    """(stream, include_usage) of an OpenAI request."""
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise SamplingParamsError("stream", "must be true or false")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise SamplingParamsError("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise SamplingParamsError("stream_options", "must be an object")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise SamplingParamsError("stream_options", f"unknown key {quote(unknown[0])} (valid: include_usage)")
    include_usage = options.get("include_usage")
    include_usage = False if include_usage is None else include_usage
    if not isinstance(include_usage, bool):
        raise SamplingParamsError("stream_options", "include_usage must be true or false")
    return stream, include_usage


def message_content(i: int, content: Any) -> str:
    """A message's content as one string: a string, or a list of text parts joined (vLLM's way)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SamplingParamsError("messages", f"[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise SamplingParamsError("messages", f"[{i}].content[{j}] must be an object with a string type")
        if part["type"] != CHAT_TEXT_PART:
            raise SamplingParamsError("messages", f"[{i}].content[{j}].type {quote(part['type'])} is not supported "
                                                  f"(only {CHAT_TEXT_PART!r} parts)")
        if not isinstance(part.get("text"), str):
            raise SamplingParamsError("messages", f"[{i}].content[{j}].text must be a string")
        texts.append(part["text"])
    return CHAT_TEXT_PART_SEPARATOR.join(texts)


def chat_messages(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The conversation as the chat template takes it: string contents, template role names."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SamplingParamsError("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SamplingParamsError("messages", f"[{i}] must be an object with a string role and a content")
        if m["role"] not in CHAT_ROLES:
            raise SamplingParamsError("messages", f"[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {quote(m['role'])}")
        m = {**m, "role": CHAT_ROLE_ALIASES.get(m["role"], m["role"]), "content": message_content(i, m.get("content"))}
        for k, v in m.items():
            if isinstance(v, str) and not is_utf8_text(v):
                raise SamplingParamsError("messages", f"[{i}].{quote(k)} is not valid Unicode (a lone surrogate)")
        out.append(m)
    return out


def completion_prompt(body: Dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise SamplingParamsError("prompt", "must be a string (or a list of one string)")
    return need_text("prompt", prompt)


@dataclass(frozen=True)
class OpenAIRequest:
    """An OpenAI request's parsed body, before its prompt is tokenized."""

    params: SamplingParams  # with the top log-probs the choices ask for
    choices: OpenAIChoices
    choice_params: List[SamplingParams]  # one per choice (``choice_params``)
    stream: bool
    include_usage: bool
    messages: Optional[List[Dict[str, Any]]]  # chat: the conversation for the chat template
    prompt: Optional[str]  # completions: the prompt text


def parse_openai_request(body: Dict[str, Any], chat: bool, served_model: str) -> OpenAIRequest:
    """Every field of ``body`` checked (SamplingParamsError with our names: ``client_error`` renames them),
    ModelNotFound for another model."""
    prompt_field = "messages" if chat else "prompt"
    params = openai_params(body, prompt_field)
    choices = openai_choices(body, chat, served_model)
    if choices.top_logprobs:  # the engine keeps each token's alternatives only for requests that ask
        params = replace(params, top_logprobs=choices.top_logprobs)
    stream, include_usage = openai_stream_flags(body)
    return OpenAIRequest(params, choices, choice_params(params, choices.n), stream, include_usage,
                         chat_messages(body) if chat else None, None if chat else completion_prompt(body))
