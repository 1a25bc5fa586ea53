"""Mixed steps on CUDA (the embedded model in bf16, CUDA graphs on): with
--enable_deterministic_inference a token's logits do not depend on its batch, so a workload
whose steps mix decode rows with prompt chunks gives the token ids the same engine gives one
request at a time, and what --disable_mixed_steps gives, for plain decoding, strict MTP
and B = 0 (eagle and dspark drafts). Log-probs agree to LOGPROB_TOL: their log_softmax over the
vocabulary is a torch reduction whose order depends on the number of rows (H200: differences of ~2e-6). ASD's usage budget is
left out here: its relaxations read the draft's guesses and the log-probs, so such a difference
may move one; test_mixed_steps.py checks it against one request at a time on CPU.
Runs in the GPU CI (skips without CUDA)."""
import gc

import pytest

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import MODES as EMBEDDED_MODES

pytestmark = [needs_cuda, pytest.mark.slow]

NUM_REQS = 9
RUNNING = 4  # requests join while others decode
CHUNK = 48  # prompt tokens per step: GSM8K prompts take several chunks
LOGPROB_TOL = 1e-4
DSPARK = dict(mtp_mode="dspark", mtp_step=3)  # the packaged dspark draft
MODES = dict(EMBEDDED_MODES, dspark=DSPARK, dspark_asd0=dict(DSPARK, mtp_asd_regret_budget=0.0))
ENGINE = dict(max_req_total_len=512, max_total_token_num=8192, graph_max_batch_size=8,
              enable_deterministic_inference=True, batch_max_tokens=CHUNK)


def _prompts():
    from unit_tests.data_paths import embedded_gsm8k_prompts

    return embedded_gsm8k_prompts(NUM_REQS)[2]


def _run(mode: str, prompts, running: int, **extra):
    import torch

    from lightllm.server.offline_engine import OfflineEngine

    eng = OfflineEngine(StartArgs(**MODES[mode], **ENGINE, running_max_req_size=running, **extra),
                        device="cuda", dtype="bfloat16")
    mixed_calls = []
    launch = eng.backend.launch_mixed  # every mixed step's launch (run at once, or left in flight with overlap)

    def spy(step):
        mixed_calls.append(step.rows_owner.graphs is not None)
        return launch(step)

    eng.backend.launch_mixed = spy
    params = [{"max_new_tokens": 20 + 7 * i, "ignore_eos": True} for i in range(len(prompts))]
    res = eng.generate(prompts, params)
    out = ([r.token_ids for r in res], [r.logprobs for r in res], mixed_calls)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("mode", ["plain", "mtp", "asd0", "dspark", "dspark_asd0"])
def test_mixed_steps_equal_one_request_at_a_time(mode):
    prompts = _prompts()
    alone_ids, alone_lps, alone_calls = _run(mode, prompts, 1)
    ids, lps, calls = _run(mode, prompts, RUNNING)
    alt_ids, alt_lps, alt_calls = _run(mode, prompts, RUNNING, disable_mixed_steps=True)
    assert not alone_calls and not alt_calls
    assert calls and all(calls)  # mixed steps ran, each a graph replay
    assert ids == alone_ids and alt_ids == alone_ids
    for got in (lps, alt_lps):
        assert [x for r in got for x in r] == pytest.approx([x for r in alone_lps for x in r], abs=LOGPROB_TOL)


def test_admission_behind_the_step_in_flight_equals_one_request_at_a_time():
    """--router_admit_behind_step (plain decoding, padded rows kept past finishes): the same token ids as one
    request at a time, log-probs to LOGPROB_TOL."""
    prompts = _prompts()
    alone_ids, alone_lps, _ = _run("plain", prompts, 1)
    ids, lps, calls = _run("plain", prompts, RUNNING, router_admit_behind_step=True)
    assert calls and all(calls)
    assert ids == alone_ids
    assert [x for r in lps for x in r] == pytest.approx([x for r in alone_lps for x in r], abs=LOGPROB_TOL)
