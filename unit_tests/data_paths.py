"""Where tests find GSM8K: $LIGHTLLM_GSM8K_DIR, else ../shared/data/gsm8k beside the checkout,
else this workplace's shared data folder. Tests that need it skip when none has it."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKPLACE_GSM8K_DIR = "/work/shared/data/gsm8k"


def _gsm8k_dirs():
    env = os.environ.get("LIGHTLLM_GSM8K_DIR")
    return ([env] if env else []) + [os.path.join(REPO, "..", "shared", "data", "gsm8k"), WORKPLACE_GSM8K_DIR]


def gsm8k_path(split: str) -> str:
    """The first existing ``{split}.jsonl`` of the candidate dirs (else the first candidate's path)."""
    paths = [os.path.join(d, f"{split}.jsonl") for d in _gsm8k_dirs()]
    return next((p for p in paths if os.path.exists(p)), paths[0])


def require_gsm8k(split: str) -> str:
    """gsm8k_path, or skip the calling test when no candidate dir has the file."""
    import pytest

    path = gsm8k_path(split)
    if not os.path.exists(path):
        pytest.skip(f"GSM8K {split} set not found (set LIGHTLLM_GSM8K_DIR)")
    return path


def embedded_gsm8k_prompts(num_questions: int):
    """(model_dir, tokenizer, prompts): the first GSM8K test questions in the embedded model's
    chat template, as token ids. Skips the test without the packaged draft or the data."""
    import json

    import pytest
    from transformers import AutoTokenizer

    from lightllm.tools.train_mtp_draft import build_prompt_ids
    from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir

    model_dir = get_default_model_dir()
    if default_draft_dir_for(model_dir, "eagle_with_att") is None:
        pytest.skip("the embedded model's trained draft is not packaged")
    path = require_gsm8k("test")
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(path) as f:
        questions = [json.loads(line)["question"] for line in f][:num_questions]
    return model_dir, tok, build_prompt_ids(tok, questions)
