"""The overlap schedule against --disable_overlap_schedule on the embedded model, CUDA graphs,
bf16: plain, strict MTP, ASD B = 0 and ASD at the usage setting (eagle), dspark strict and usage. Requests end at EOS (unknown
in advance) and at max_new_tokens, more requests than run at once, so that steps launched
ahead are kept (a finished request's rows dropped, the padded size unchanged) and undone (the
size changes). Token ids and log-probs must be bit-identical. Runs in the GPU CI."""

import pytest

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import MODES

pytestmark = [needs_cuda, pytest.mark.slow]

DSPARK = dict(MODES["mtp"], mtp_mode="dspark")
OVERLAP_MODES = dict(MODES, dspark=DSPARK, dspark_usage=dict(MODES["asd_usage"], mtp_mode="dspark"))

NUM_REQS = 14
RUNNING = 6  # between the captured sizes 4 and 8
ENGINE = dict(running_max_req_size=RUNNING, max_req_total_len=768, max_total_token_num=16384,
              graph_max_batch_size=8)


def _params():
    """Most requests stop at EOS (the target's own answer end); every third runs to its length."""
    return [{"max_new_tokens": 40 + 17 * i, "ignore_eos": i % 3 == 2} for i in range(NUM_REQS)]


def _run(mode_args: dict, overlap: bool):
    import gc

    import torch

    from lightllm.server.offline_engine import OfflineEngine
    from unit_tests.data_paths import embedded_gsm8k_prompts

    prompts = embedded_gsm8k_prompts(NUM_REQS)[2]
    eng = OfflineEngine(StartArgs(**mode_args, **ENGINE, disable_overlap_schedule=not overlap),
                        device="cuda", dtype="bfloat16")
    res = eng.generate(prompts, _params(), eos_token_ids=eng.eos_token_ids())
    b = eng.backend
    stats = dict(ahead=b.steps_ahead, undone=b.discarded_steps, graphs=b.decode_step.graphs is not None,
                 eos=sum(r.finish_reason == "eos" for r in res))
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return [(r.token_ids, r.logprobs) for r in res], stats


@pytest.fixture(scope="module")
def outputs():
    return {(mode, o): _run(OVERLAP_MODES[mode], o) for mode in OVERLAP_MODES for o in (True, False)}


@pytest.mark.parametrize("mode", list(OVERLAP_MODES))
def test_overlap_equals_the_plain_schedule(outputs, mode, record_property):
    (over, st), (ref, ref_st) = outputs[(mode, True)], outputs[(mode, False)]
    record_property("overlap_stats", st)  # steps ahead, undone, EOS finishes (in the JUnit XML)
    assert st["graphs"] and ref_st["graphs"]
    assert [t for t, _ in over] == [t for t, _ in ref]
    assert [lp for _, lp in over] == [lp for _, lp in ref]  # bit-exact, not close
    assert ref_st["ahead"] == 0 and st["ahead"] > 0, st
    assert st["eos"] > 0, st  # finishes the host learns only at commit


def test_b0_equals_strict_with_overlap(outputs):
    mtp, asd0 = (outputs[(m, True)][0] for m in ("mtp", "asd0"))
    assert [t for t, _ in asd0] == [t for t, _ in mtp]
