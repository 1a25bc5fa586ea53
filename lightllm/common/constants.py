"""Names and limits shared by the CLI, start-up validation, the model, the kernels and /metrics.

Torch-free, so `--help` and the HTTP process import it cheaply.
"""

# Most draft tokens one MTP verify step checks (--mtp_step K)
MAX_MTP_STEP = 7
# Columns of the per-request next-token table: the pending token, then K drafts
MTP_TABLE_WIDTH = MAX_MTP_STEP + 1

# --data_type names (torch dtypes of the same names)
DATA_TYPES = ("float32", "bfloat16", "float16")
# LightLLM's short spellings of them, accepted by --data_type
DATA_TYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_data_type(name: str) -> str:
    """A --data_type name or alias -> its DATA_TYPES name (unknown names are returned as they are)."""
    return DATA_TYPE_ALIASES.get(name, name)
# --load_format; dummy: random weights for the model dir's config.json (vLLM's name)
LOAD_FORMATS = ("auto", "dummy")
# HTTP/1.1 parsers of the server (uvicorn's --http): auto takes httptools when it is installed
HTTP_IMPLEMENTATIONS = ("auto", "h11", "httptools")
# Event loops of the HTTP server (uvicorn's --loop): auto takes uvloop when it is installed
LOOP_IMPLEMENTATIONS = ("auto", "asyncio", "uvloop")
