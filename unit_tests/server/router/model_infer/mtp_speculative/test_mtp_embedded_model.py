"""Strict MTP with the trained draft is lossless on the embedded model (fp32, CPU, GSM8K test questions)."""
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from unit_tests.data_paths import embedded_gsm8k_prompts

NUM_QUESTIONS = 4
MAX_NEW_TOKENS = 40


def test_strict_mtp_equals_plain_decoding_on_gsm8k():
    _, _, prompts = embedded_gsm8k_prompts(NUM_QUESTIONS)
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
