"""JSON Schema output on CUDA (embedded model, bf16, docs/structured_output.md): the mask is applied
after the forward graphs, so graph and eager decoding give the same tokens under the grammar; every
output validates; strict MTP equals plain decoding under the grammar; requests without a grammar
decode exactly as before when a grammar request runs beside them in other steps. Runs in the GPU CI
(skips without CUDA or xgrammar)."""
import gc
import json

import pytest
import torch

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import MODES
from unit_tests.server.router.model_infer.structured_cases import ANSWER_BOUND, PARAMS, REASONING_CHARS

pytestmark = [needs_cuda, pytest.mark.slow]
pytest.importorskip("xgrammar")

NUM_REQS = 11
RUNNING = 6  # a size between the captured 4 and 8; waiting requests join while others decode
# every run prefills from token 0, so a run's schedule does not depend on the runs before it
ENGINE = dict(running_max_req_size=RUNNING, max_req_total_len=512, max_total_token_num=8192, graph_max_batch_size=8,
              disable_dynamic_prompt_cache=True)
PLAIN_PARAMS = {"max_new_tokens": 24, "ignore_eos": True}


def _check(obj) -> None:
    """test_structured_output.SCHEMA by hand (the GPU image has no jsonschema)."""
    assert isinstance(obj, dict) and list(obj) == ["reasoning", "answer"]
    assert isinstance(obj["reasoning"], str) and len(obj["reasoning"]) <= REASONING_CHARS
    answer = obj["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool) and -ANSWER_BOUND <= answer <= ANSWER_BOUND


def _prompts():
    from unit_tests.data_paths import embedded_gsm8k_prompts

    _, tok, prompts = embedded_gsm8k_prompts(NUM_REQS)
    return tok, prompts


def _generate(mode: str, graphs: bool, params):
    from lightllm.server.offline_engine import OfflineEngine

    tok, prompts = _prompts()
    eng = OfflineEngine(StartArgs(**MODES[mode], **ENGINE, disable_cudagraph=not graphs), device="cuda",
                        dtype="bfloat16")
    eos = eng.eos_token_ids()
    res = [eng.generate(prompts, [p] * len(prompts), eos_token_ids=eos) for p in params]
    captured = eng.backend.decode_step.graphs is not None
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return tok, res, captured


@pytest.fixture(scope="module")
def outputs():
    """(mode, graphs) -> (tokenizer, [grammar results, plain results, grammar results again], captured)."""
    return {(m, g): _generate(m, g, [PARAMS, PLAIN_PARAMS, PARAMS]) for m in ("plain", "mtp") for g in (True, False)}


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_graphs_equal_eager_under_the_grammar_and_outputs_validate(outputs, mode):
    tok, with_graphs, captured = outputs[(mode, True)]
    _, eager, eager_captured = outputs[(mode, False)]
    assert captured and not eager_captured
    for a, b in zip(with_graphs, eager):
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for run in (with_graphs[0], with_graphs[2]):
        assert [r.token_ids for r in run] == [r.token_ids for r in with_graphs[0]]
        for r in run:
            assert r.finish_reason == "stop"
            _check(json.loads(tok.decode(r.token_ids, skip_special_tokens=True)))


def test_strict_mtp_equals_plain_under_the_grammar_up_to_bf16_near_ties(outputs):
    """As test_cuda_graph_decode's: a request that differs must differ first at a near-tie of the fp32
    reference (both tokens allowed by the grammar there)."""
    from unit_tests.server.router.model_infer.test_cuda_graph_decode import NEAR_TIE_LOGIT_GAP, _first_divergence_gaps

    plain, mtp = ([r.token_ids for r in outputs[(m, True)][1][0]] for m in ("plain", "mtp"))
    gaps = _first_divergence_gaps(_prompts()[1], plain, mtp)
    print(f"grammar: strict MTP vs plain (graphs, bf16): {len(gaps)} of {NUM_REQS} differ; fp32 gaps {gaps}")
    assert all(g < NEAR_TIE_LOGIT_GAP for g in gaps), gaps


def test_requests_without_a_grammar_are_unchanged(outputs):
    """The plain run between two grammar runs equals a fresh engine's run of the same requests."""
    _, fresh, _ = _generate("plain", True, [PLAIN_PARAMS])
    assert [r.token_ids for r in outputs[("plain", True)][1][1]] == [r.token_ids for r in fresh[0]]
