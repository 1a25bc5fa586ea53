"""Strict MTP with the trained draft is lossless on the embedded model (fp32, CPU, GSM8K test questions)."""
import json

import pytest
from transformers import AutoTokenizer

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir
from unit_tests.data_paths import gsm8k_path

NUM_QUESTIONS = 4
MAX_NEW_TOKENS = 40


def test_strict_mtp_equals_plain_decoding_on_gsm8k():
    import os

    model_dir = get_default_model_dir()
    if default_draft_dir_for(model_dir, "eagle_with_att") is None:
        pytest.skip("the embedded model's trained draft is not packaged")
    if not os.path.exists(gsm8k_path("test")):
        pytest.skip("GSM8K test set not found")
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(gsm8k_path("test")) as f:
        questions = [json.loads(line)["question"] for line in f][:NUM_QUESTIONS]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in questions]
    params = [{"max_new_tokens": MAX_NEW_TOKENS}] * len(prompts)
    common = dict(running_max_req_size=NUM_QUESTIONS, max_req_total_len=512)
    plain_eng = OfflineEngine(StartArgs(**common), device="cpu", dtype="float32")
    eos = plain_eng.eos_token_ids()
    plain = plain_eng.generate(prompts, params, eos_token_ids=eos)
    del plain_eng
    mtp = OfflineEngine(StartArgs(mtp_mode="eagle_with_att", mtp_step=3, **common), device="cpu", dtype="float32")
    res = mtp.generate(prompts, params, eos_token_ids=eos)
    for p, m in zip(plain, res):
        assert m.token_ids == p.token_ids
    assert sum(r.mtp_accepted_token_num for r in res) > 0  # the trained draft is really used
