"""The prompt cache on CUDA (the embedded model in bf16, CUDA graphs and mixed steps on): with
--enable_deterministic_inference a token's logits do not depend on its batch or chunk, so
two-turn conversations (turn 2 resends turn 1's prompt and answer, then a new question) give the
token ids of the same engine with --disable_dynamic_prompt_cache, for plain decoding, strict MTP
and B = 0, while turn 2 takes its history from the cache. Log-probs agree to LOGPROB_TOL (see
test_mixed_steps_cuda.py). ASD usage is checked against the uncached engine on CPU
(test_prompt_cache.py). Runs in the GPU CI (skips without CUDA)."""
import gc

import pytest

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import MODES

pytestmark = [needs_cuda, pytest.mark.slow]

CONVERSATIONS = 6
RUNNING = 4  # requests join while others decode
NEW_TOKENS = 24
LOGPROB_TOL = 1e-4
ENGINE = dict(max_req_total_len=768, max_total_token_num=16384, graph_max_batch_size=8,
              enable_deterministic_inference=True, batch_max_tokens=96, running_max_req_size=RUNNING)


def _chat(mode: str, questions, **extra):
    import torch

    from lightllm.server.offline_engine import OfflineEngine

    eng = OfflineEngine(StartArgs(**MODES[mode], **ENGINE, **extra), device="cuda", dtype="bfloat16")
    params = [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * CONVERSATIONS
    first = eng.generate(questions[:CONVERSATIONS], params)
    second_prompts = [q + r.token_ids + nxt for q, r, nxt in zip(questions, first, questions[CONVERSATIONS:])]
    second = eng.generate(second_prompts, params)
    window = eng.backend.prompt_cache.window if eng.backend.prompt_cache is not None else 0
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return first, second, window


@pytest.mark.parametrize("mode", ["plain", "mtp", "asd0"])
def test_conversations_equal_the_uncached_engine(mode):
    from unit_tests.data_paths import embedded_gsm8k_prompts

    questions = embedded_gsm8k_prompts(2 * CONVERSATIONS)[2]
    off = _chat(mode, questions, disable_dynamic_prompt_cache=True)
    on = _chat(mode, questions)
    for a, b in zip(off[:2], on[:2]):
        assert [r.token_ids for r in b] == [r.token_ids for r in a]
        assert [x for r in b for x in r.logprobs] == pytest.approx([x for r in a for x in r.logprobs], abs=LOGPROB_TOL)
    window = on[2]
    for q, r1, r2 in zip(questions, on[0], on[1]):
        kept = len(q) - window if window else len(q) + len(r1.token_ids) - 1
        assert r2.prompt_cached_tokens >= kept  # turn 2 prefilled only what follows turn 1
    assert all(r.prompt_cached_tokens == 0 for turn in off[:2] for r in turn)
