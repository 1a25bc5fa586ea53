"""response_format over HTTP on the embedded model (docs/structured_output.md): json_schema and
json_object on /v1/chat/completions, /v1/completions (streamed too) and /generate's parameters;
a schema xgrammar refuses is a 400 naming response_format, and the server keeps serving."""
import json

import httpx
import pytest

from lightllm.utils.server_launcher import launch_server, sse_data, strict_json

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 64
MAX_POPULATION = 10**9  # bounded: a runaway number would not close within MAX_TOKENS
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0, "maximum": MAX_POPULATION}},
    "required": ["city", "population"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
QUESTION = [{"role": "user", "content": "What is the largest city of France and its population? Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured_output") / "server.log"
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", "4"], str(log))
    yield s
    s.stop()


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == status, r.text
    return strict_json(r.text)


def _chat(server, response_format, **extra):
    body = {"messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0, "response_format": response_format}
    return _post(server, "/v1/chat/completions", dict(body, **extra))["choices"][0]


def test_chat_json_schema_validates(server):
    c = _chat(server, JSON_SCHEMA)
    assert c["finish_reason"] == "stop"
    jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)


def test_chat_json_object_is_an_object(server):
    c = _chat(server, {"type": "json_object"})
    assert c["finish_reason"] == "stop"
    assert isinstance(json.loads(c["message"]["content"]), dict)


def test_completions_streamed_and_generate(server):
    prompt = "The largest city of France, as JSON with its population:"
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "response_format": JSON_SCHEMA}
    text = _post(server, "/v1/completions", body)["choices"][0]["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=300) as r:
        assert r.status_code == 200
        chunks = [strict_json(d) for d in sse_data(r.iter_lines())[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    native = _post(server, "/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": MAX_TOKENS, "response_format": JSON_SCHEMA}})
    assert native["generated_text"][0] == text and native["finish_reason"] == "stop"


@pytest.mark.parametrize("response_format,message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, 'Unsupported type "bogus"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}, "Regex"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be"),
    ({"type": "json_object", "json_schema": {}}, "unknown key"),
])
def test_bad_schema_is_a_400_and_the_server_keeps_serving(server, response_format, message):
    body = {"messages": QUESTION, "max_tokens": 4, "response_format": response_format}
    err = _post(server, "/v1/chat/completions", body, status=400)
    assert err["error"]["param"] == "response_format" and err["error"]["message"].startswith("response_format:")
    assert message in err["error"]["message"]
    assert _chat(server, {"type": "text"}, max_tokens=2)["message"]["content"]
