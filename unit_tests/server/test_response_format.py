"""response_format parsed at the edge (core/objs/response_format.py): what a client may send, what a
refusal says, and a clean refusal when xgrammar is missing."""
import json
import sys

import pytest

from lightllm.server.core.objs import response_format as rf
from lightllm.server.core.objs.sampling_params import SamplingParams, SamplingParamsError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def _fmt(raw):
    return SamplingParams.from_request({"response_format": raw}).response_format


def test_text_is_no_grammar():
    assert _fmt(None) is None and _fmt({"type": "text"}) is None


def test_json_schema_keeps_the_key_order_and_copies_keep_it():
    pytest.importorskip("xgrammar")
    fmt = _fmt({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}})
    assert fmt.type == rf.JSON_SCHEMA and fmt.name == "n" and fmt.strict is True and fmt.strict_mode
    assert fmt.schema == json.dumps(SCHEMA, separators=(",", ":"))  # properties in the client's order
    assert _fmt(fmt) is fmt  # a parsed copy (dataclasses.replace) stays as it is
    obj = _fmt({"type": "json_object"})
    assert obj.type == rf.JSON_OBJECT and obj.schema == rf.OBJECT_SCHEMA and not obj.strict_mode


@pytest.mark.parametrize("raw,message", [
    ("json", "must be an object with type one of text, json_object, json_schema"),
    ({"type": "yaml"}, "must be an object with type"),
    ({"type": "text", "extra": 1}, "unknown key 'extra'"),
    ({"type": "json_schema"}, "json_schema must be an object with a schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "nme": "x"}}, "unknown key 'nme'"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}, "strict must be true or false"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "schema must be a JSON Schema object"),
])
def test_malformed_response_format_names_the_field(raw, message):
    with pytest.raises(SamplingParamsError) as e:
        _fmt(raw)
    assert e.value.field_name == "response_format" and message in str(e.value)


def test_a_schema_xgrammar_refuses_names_the_field():
    pytest.importorskip("xgrammar")
    with pytest.raises(SamplingParamsError) as e:
        _fmt({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}})
    assert str(e.value) == 'response_format: json_schema.schema is not supported: Unsupported type "bogus"'


def test_without_xgrammar_json_output_is_refused_cleanly(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    rf._grammar_error.cache_clear()
    try:
        for raw in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}):
            with pytest.raises(SamplingParamsError) as e:
                _fmt(raw)
            assert e.value.field_name == "response_format" and "needs xgrammar" in str(e.value)
        assert _fmt({"type": "text"}) is None  # everything else works
    finally:
        rf._grammar_error.cache_clear()
