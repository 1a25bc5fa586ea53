"""Where tests find GSM8K: $LIGHTLLM_GSM8K_DIR, else ../shared/data/gsm8k beside the checkout."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gsm8k_path(split: str) -> str:
    root = os.environ.get("LIGHTLLM_GSM8K_DIR") or os.path.join(REPO, "..", "shared", "data", "gsm8k")
    return os.path.join(root, f"{split}.jsonl")
