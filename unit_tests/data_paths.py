"""Where tests find GSM8K: $LIGHTLLM_GSM8K_DIR, else ../shared/data/gsm8k beside the checkout."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gsm8k_path(split: str) -> str:
    root = os.environ.get("LIGHTLLM_GSM8K_DIR") or os.path.join(REPO, "..", "shared", "data", "gsm8k")
    return os.path.join(root, f"{split}.jsonl")


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
    if not os.path.exists(gsm8k_path("test")):
        pytest.skip("GSM8K test set not found")
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(gsm8k_path("test")) as f:
        questions = [json.loads(line)["question"] for line in f][:num_questions]
    return model_dir, tok, build_prompt_ids(tok, questions)
