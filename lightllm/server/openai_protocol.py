"""What an OpenAI-compatible request asks for: its fields checked and mapped onto SamplingParams, its
choices, stream flags and prompts (``/v1/completions``, ``/v1/chat/completions``; vLLM's
``entrypoints/openai/protocol.py``), and the error object every refusal answers with. Pure functions
of the JSON body: every refusal is a SamplingParamsError naming the client's own field
(``client_error``). api_http.py reads them and builds the answers."""
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple, Union

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


# OpenAI's error object ({"error": {"message", "type", "param", "code"}}, what its SDK reads), the one
# shape of every refusal; its type by HTTP status, as vLLM names them
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
DEFAULT_ERROR_TYPE = "Error"


def error_body(status: int, field: Optional[str], message: str) -> Dict[str, Any]:
    """The answer to a refused request: OpenAI's error object, whose message starts with the client's
    field (``param``) when one is at fault."""
    field = None if field is None else client_text(field, MAX_FIELD_NAME_CHARS)
    text = message if field is None else f"{field}: {message}"
    return {"error": {"message": client_text(text), "type": ERROR_TYPES.get(status, DEFAULT_ERROR_TYPE),
                      "param": field, "code": status}}


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
# Fields with no effect on what this server returns: accepted and ignored (as vLLM)
OPENAI_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}
OPENAI_STREAM_FIELDS = {"stream", "stream_options"}
# Fields of OpenAI's choices and log-probs (read by _openai_choices)
OPENAI_CHOICE_FIELDS = {"model", "n", "best_of", "logprobs"}
OPENAI_CHAT_ONLY_FIELDS = {"top_logprobs"}
# Fields we do not implement: accepted only at these (default) values, refused otherwise, saying why
NOT_SUPPORTED = "is not supported"
OPENAI_COMPLETION_DEFAULT_ONLY = {
    "echo": ((None, False), NOT_SUPPORTED),
    "suffix": ((None,), NOT_SUPPORTED),
}
OPENAI_CHAT_DEFAULT_ONLY = {
    "tools": ((None, []), "tool calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "functions": ((None, []), "function calls are not supported"),
    "function_call": ((None, "none"), "function calls are not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
}
# Completions without max_tokens: OpenAI's (and vLLM's) 16. Chat without it: the room the prompt leaves
# in max_model_len (OpenAI's and vLLM's), which the router reserves KV for (docs/limits.md).
OPENAI_DEFAULT_MAX_TOKENS = 16
OPENAI_DEFAULT_TEMPERATURE = 1.0
OPENAI_MAX_N = 128  # OpenAI's own bound on n; also on prompts x n (completions may send several prompts)
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
    message = e.message
    for ours, theirs in names.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    return SamplingParamsError(names.get(e.field_name, e.field_name), message)


def openai_params(body: Dict[str, Any], chat: bool) -> SamplingParams:
    """The request's sampling parameters. Chat without max_tokens gets a placeholder of 1 here:
    ``fill_max_tokens`` sets the room its prompt leaves once it is tokenized."""
    prompt_field = "messages" if chat else "prompt"
    default_only = OPENAI_CHAT_DEFAULT_ONLY if chat else OPENAI_COMPLETION_DEFAULT_ONLY
    known = (set(OPENAI_PARAM_MAP) | {OPENAI_MAX_TOKENS_ALIAS} | OPENAI_IGNORED | OPENAI_STREAM_FIELDS
             | OPENAI_CHOICE_FIELDS | (OPENAI_CHAT_ONLY_FIELDS if chat else set()) | set(default_only))
    unknown = sorted(set(body) - known - {prompt_field})
    if unknown:
        raise SamplingParamsError(unknown[0], "unknown field")
    for name, (allowed, why) in default_only.items():
        if not is_one_of(body.get(name), allowed):
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise SamplingParamsError(name, f"{why}: only {shown} (the default), got {quote(body[name])}")
    params = {ours: body[theirs] for theirs, ours in OPENAI_PARAM_MAP.items() if theirs in body}
    alias = body.get(OPENAI_MAX_TOKENS_ALIAS)
    if alias is not None:
        given = body.get("max_tokens")
        if given is not None and not is_one_of(given, (alias,)):
            raise SamplingParamsError(OPENAI_MAX_TOKENS_ALIAS, f"{quote(alias)} differs from max_tokens {quote(given)}")
        params["max_new_tokens"] = alias
    if params.get("max_new_tokens") is None:
        params["max_new_tokens"] = 1 if chat else OPENAI_DEFAULT_MAX_TOKENS
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


def is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def completion_prompts(body: Dict[str, Any]) -> List[Union[str, List[int]]]:
    """The prompts of a completions request, as OpenAI takes them: a string, a list of token ids, or a
    list of either (several prompts). Token ids are checked against the vocabulary once the server
    knows it (``check_token_ids``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise SamplingParamsError("prompt", "must be a string, a list of token ids, or a non-empty list of those")
    for i, p in enumerate(prompts):
        at = f"[{i}] " if len(prompts) > 1 else ""
        if isinstance(p, str):
            if not is_utf8_text(p):
                raise SamplingParamsError("prompt", f"{at}is not valid Unicode (a lone surrogate)")
        elif not is_token_ids(p):
            raise SamplingParamsError("prompt", f"{at}must be a string or a non-empty list of token ids")
    return prompts


def check_token_ids(prompt: List[int], vocab_size: int) -> None:
    """A prompt given as token ids: each an id of the model's vocabulary."""
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplingParamsError("prompt", f"token id {bad} is not in the vocabulary (0..{vocab_size - 1})")


@dataclass(frozen=True)
class OpenAIRequest:
    """An OpenAI request's parsed body, before its prompts are tokenized."""

    params: SamplingParams  # with the top log-probs the choices ask for
    choices: OpenAIChoices  # per prompt
    choice_params: List[SamplingParams]  # one per choice of a prompt (``choice_params``)
    stream: bool
    include_usage: bool
    messages: Optional[List[Dict[str, Any]]]  # chat: the conversation for the chat template
    prompts: Optional[List[Union[str, List[int]]]]  # completions: the prompts, text or token ids
    fill_max_tokens: bool = False  # chat without max_tokens: the room the prompt leaves (``fill_max_tokens``)


def parse_openai_request(body: Dict[str, Any], chat: bool, served_model: str) -> OpenAIRequest:
    """Every field of ``body`` checked (SamplingParamsError with our names: ``client_error`` renames them),
    ModelNotFound for another model."""
    params = openai_params(body, chat)
    choices = openai_choices(body, chat, served_model)
    if choices.top_logprobs:  # the engine keeps each token's alternatives only for requests that ask
        params = replace(params, top_logprobs=choices.top_logprobs)
    stream, include_usage = openai_stream_flags(body)
    prompts = None if chat else completion_prompts(body)
    if prompts is not None and len(prompts) * choices.n > OPENAI_MAX_N:
        raise SamplingParamsError("prompt", f"{len(prompts)} prompts x n {choices.n} choices: at most {OPENAI_MAX_N} "
                                            f"choices in all")
    fill = chat and body.get("max_tokens") is None and body.get(OPENAI_MAX_TOKENS_ALIAS) is None
    return OpenAIRequest(params, choices, choice_params(params, choices.n), stream, include_usage,
                         chat_messages(body) if chat else None, prompts, fill)


def fill_max_tokens(req: OpenAIRequest, prompt_tokens: int, max_model_len: int) -> OpenAIRequest:
    """A chat request without max_tokens may generate up to ``max_model_len`` with its prompt (at least 1:
    a prompt with no room left is refused as too long)."""
    if not req.fill_max_tokens:
        return req
    room = max(1, max_model_len - prompt_tokens)
    return replace(req, params=replace(req.params, max_new_tokens=room), fill_max_tokens=False,
                   choice_params=[replace(p, max_new_tokens=room) for p in req.choice_params])
