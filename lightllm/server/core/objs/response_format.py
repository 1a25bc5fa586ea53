"""A request's ``response_format`` (JSON output, docs/structured_output.md): parsed and checked once.

Both processes import this module: the HTTP process parses the client's object and checks that
xgrammar takes the schema (a 400 otherwise), the worker compiles it (router/model_infer/grammar.py).
xgrammar is optional: it is imported only when a request asks for JSON output.
"""
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

TEXT = "text"  # the default: no grammar
JSON_OBJECT = "json_object"  # any JSON object
JSON_SCHEMA = "json_schema"  # JSON that validates against the given schema
TYPES = (TEXT, JSON_OBJECT, JSON_SCHEMA)
# what {"type": "json_object"} compiles to: an object with any members
OBJECT_SCHEMA = '{"type":"object"}'
XGRAMMAR_MISSING = "JSON output needs xgrammar, which is not installed (pip install --no-deps xgrammar)"


class ResponseFormatError(ValueError):
    """The client's response_format is refused (SamplingParams names the field)."""


@dataclass(frozen=True)
class ResponseFormat:
    """JSON output: ``schema`` is the canonical JSON text (``canonical_json``) of the schema the
    output must validate against; it is also the worker's compile cache key."""

    type: str  # JSON_OBJECT or JSON_SCHEMA
    schema: str
    name: Optional[str] = None  # json_schema.name (kept for the record)
    # json_schema.strict: the grammar always follows the schema exactly (members not in
    # ``properties`` are refused unless it allows them); kept for the record
    strict: Optional[bool] = None

    @property
    def strict_mode(self) -> bool:
        """xgrammar's strict_mode: json_object takes any members, a schema only those it lists."""
        return self.type == JSON_SCHEMA


def canonical_json(obj: Any) -> str:
    """Compact JSON text, ASCII only. Keys keep their order: xgrammar emits properties in it."""
    return json.dumps(obj, separators=(",", ":"))


def parse_response_format(v: Any) -> Optional[ResponseFormat]:
    """The client's object -> None (text) or a ResponseFormat; ResponseFormatError says what is wrong.
    A ResponseFormat (a copy of parsed parameters) is returned as it is."""
    if v is None or isinstance(v, ResponseFormat):
        return v
    if not isinstance(v, dict) or v.get("type") not in TYPES:
        raise ResponseFormatError(f"must be an object with type one of {', '.join(TYPES)}")
    kind = v["type"]
    extra = sorted(set(v) - {"type", JSON_SCHEMA})
    if extra or (kind != JSON_SCHEMA and JSON_SCHEMA in v):
        raise ResponseFormatError(f"unknown key {extra[0] if extra else JSON_SCHEMA!r} for type {kind}")
    if kind == TEXT:
        return None
    if kind == JSON_OBJECT:
        fmt = ResponseFormat(JSON_OBJECT, OBJECT_SCHEMA)
        check_grammar(fmt)
        return fmt
    spec = v.get(JSON_SCHEMA)
    if not isinstance(spec, dict):
        raise ResponseFormatError("json_schema must be an object with a schema")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ResponseFormatError(f"json_schema has an unknown key {unknown[0]!r}")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise ResponseFormatError("json_schema.name must be a string")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError("json_schema.strict must be true or false")
    if not isinstance(schema, dict):
        raise ResponseFormatError("json_schema.schema must be a JSON Schema object")
    fmt = ResponseFormat(JSON_SCHEMA, canonical_json(schema), name, strict)
    check_grammar(fmt)
    return fmt


@functools.lru_cache(maxsize=256)
def _grammar_error(schema: str, strict_mode: bool) -> Optional[str]:
    """Why xgrammar refuses ``schema`` (None: it takes it). No tokenizer: the grammar only."""
    try:
        import xgrammar
    except ImportError:
        return XGRAMMAR_MISSING
    try:
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode)
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        return f"json_schema.schema is not supported: {_xgrammar_message(e)}"
    return None


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0] if lines else type(e).__name__)


def check_grammar(fmt: ResponseFormat) -> None:
    """ResponseFormatError unless xgrammar is installed and takes the schema (cached per schema)."""
    error = _grammar_error(fmt.schema, fmt.strict_mode)
    if error is not None:
        raise ResponseFormatError(error)
