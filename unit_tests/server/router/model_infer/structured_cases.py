"""The JSON Schema the structured-output tests ask the embedded model for (CPU and CUDA files)."""
REASONING_CHARS = 16
# {"reasoning": "<= 16 characters", "answer": n}: well inside this many tokens
MAX_NEW_TOKENS = 48
ANSWER_BOUND = 10**6
SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": REASONING_CHARS},
        "answer": {"type": "integer", "minimum": -ANSWER_BOUND, "maximum": ANSWER_BOUND},
    },
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "gsm8k", "schema": SCHEMA, "strict": True}}
PARAMS = {"max_new_tokens": MAX_NEW_TOKENS, "response_format": RESPONSE_FORMAT}
