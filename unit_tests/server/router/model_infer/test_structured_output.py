"""JSON Schema output (response_format, docs/structured_output.md) on the embedded model: CPU, fp32,
greedy, GSM8K test questions. Every output validates with ``jsonschema`` (an independent validator);
strict MTP under the grammar gives plain decoding's tokens under the same grammar; ASD usage stays
valid; grammar batches never overlap, other batches still do."""
import json
from unittest import mock

import pytest

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from lightllm.server.router.model_infer.infer_batch import FinishReason
from unit_tests.data_paths import embedded_gsm8k_prompts
from unit_tests.server.router.model_infer.embedded_modes import MODES
from unit_tests.server.router.model_infer.structured_cases import PARAMS, SCHEMA

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NUM_QUESTIONS = 20
NUM_MTP_QUESTIONS = 8  # the first ones: plain decoding of all 20 is the reference
NUM_ASD_QUESTIONS = 4
# fewer running requests than questions: later prompts are prefilled beside running decodes (mixed steps)
RUNNING = 8
COMMON = dict(running_max_req_size=RUNNING, max_req_total_len=512)


@pytest.fixture(scope="module")
def questions():
    _, tok, prompts = embedded_gsm8k_prompts(NUM_QUESTIONS)
    return tok, prompts


def _run(args: StartArgs, prompts):
    """(engine, results, mixed steps run) of ``prompts`` under PARAMS."""
    eng = OfflineEngine(args, device="cpu", dtype="float32")
    with mock.patch.object(eng.backend, "mixed", wraps=eng.backend.mixed) as mixed:
        res = eng.generate(prompts, [PARAMS] * len(prompts), eos_token_ids=eng.eos_token_ids())
    return eng, res, mixed.call_count


@pytest.fixture(scope="module")
def plain(questions):
    _, prompts = questions
    return _run(StartArgs(**COMMON), prompts)


def _validate(tok, results):
    for r in results:
        assert r.finish_reason == FinishReason.STOP, tok.decode(r.token_ids)
        jsonschema.validate(json.loads(tok.decode(r.token_ids, skip_special_tokens=True)), SCHEMA)


def test_every_output_validates_against_the_schema(questions, plain):
    tok, _ = questions
    eng, res, mixed_steps = plain
    _validate(tok, res)
    assert mixed_steps > 0  # first tokens were sampled in mixed steps too
    assert eng.backend.steps_ahead == 0  # grammar batches run synchronously


def test_batches_without_a_grammar_still_overlap_and_pay_nothing(questions, plain):
    _, prompts = questions
    eng, _, _ = plain
    with mock.patch("lightllm.server.router.model_infer.decode_step.rows_bitmask") as masks:
        eng.generate(prompts[:2], [{"max_new_tokens": 8, "ignore_eos": True}] * 2)
    assert eng.backend.steps_ahead > 0 and masks.call_count == 0


@pytest.mark.parametrize("count", [NUM_MTP_QUESTIONS, pytest.param(NUM_QUESTIONS, marks=pytest.mark.slow)])
def test_strict_mtp_equals_plain_decoding_under_the_grammar(questions, plain, count):
    _, prompts = questions
    _, ref, _ = plain
    # half as many running as questions: first tokens and their drafts in mixed steps too
    args = StartArgs(**MODES["mtp"], **dict(COMMON, running_max_req_size=count // 2))
    _, res, mixed_steps = _run(args, prompts[:count])
    assert [r.token_ids for r in res] == [r.token_ids for r in ref[:count]]
    assert mixed_steps > 0
    assert sum(r.mtp_accepted_token_num for r in res) > 0  # the draft is really used


# slow on CPU (21 s); test_grammar checks that ASD never relaxes a forbidden draft
@pytest.mark.slow
def test_asd_usage_output_stays_valid(questions):
    tok, prompts = questions
    _, res, _ = _run(StartArgs(**MODES["asd_usage"], **COMMON), prompts[:NUM_ASD_QUESTIONS])
    _validate(tok, res)


@pytest.mark.slow
def test_strict_dspark_equals_plain_decoding_under_the_grammar(questions, plain):
    from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir

    if default_draft_dir_for(get_default_model_dir(), "dspark") is None:
        pytest.skip("the embedded model's dspark draft is not packaged")
    _, prompts = questions
    _, ref, _ = plain
    _, res, _ = _run(StartArgs(mtp_mode="dspark", mtp_step=3, **COMMON), prompts)
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
