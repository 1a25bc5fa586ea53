"""Paths the tests share: the repository root, and where GSM8K is.

GSM8K is read from ``$LIGHTLLM_GSM8K_DIR`` when set (even to a folder that does not
exist: a wrong setting is not silently replaced), else from ``../shared/data/gsm8k``
beside the checkout (``lightllm.tools.prompts.gsm8k_path``). Tests that need it skip
when neither has it.
"""
import os

from lightllm.tools.prompts import GSM8K_DIR_ENV, gsm8k_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_gsm8k(split: str) -> str:
    """gsm8k_path, or skip the calling test when the file is not there."""
    import pytest

    path = gsm8k_path(split)
    if not os.path.exists(path):
        pytest.skip(f"GSM8K {split} set not found at {path} (set {GSM8K_DIR_ENV})")
    return path


def embedded_gsm8k_prompts(num_questions: int):
    """(model_dir, tokenizer, prompts): the first GSM8K test questions in the embedded model's
    chat template, as token ids. Skips the test without the packaged draft or the data."""
    import json

    import pytest
    from transformers import AutoTokenizer

    from lightllm.tools.prompts import chat_prompt_ids
    from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir

    model_dir = get_default_model_dir()
    if default_draft_dir_for(model_dir, "eagle_with_att") is None:
        pytest.skip("the embedded model's trained draft is not packaged")
    path = require_gsm8k("test")
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(path) as f:
        questions = [json.loads(line)["question"] for line in f][:num_questions]
    return model_dir, tok, chat_prompt_ids(tok, questions)
