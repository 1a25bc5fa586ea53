"""--mtp_mode dspark on CUDA, embedded model, bf16: CUDA graphs equal the eager step for strict,
B = 0 and a large ASD budget (accept lengths of every size); B = 0 equals strict; with
--enable_deterministic_inference strict dspark equals plain decoding token for token.
Uses the packaged dspark draft when there is one, else a random one. GPU CI only."""
import pytest

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import run_embedded

pytestmark = [needs_cuda, pytest.mark.slow]

K = 3
NUM_REQS = 11
LARGE_BUDGET = 1e6  # relaxes almost every draft: anchors move by whole blocks
ENGINE = dict(running_max_req_size=6, max_req_total_len=512, max_total_token_num=8192, graph_max_batch_size=8)
DSPARK_MODES = {
    "strict": {},
    "asd0": dict(mtp_asd_regret_budget=0.0),
    "asd_large": dict(mtp_asd_regret_budget=LARGE_BUDGET),
}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from transformers import AutoConfig

    from lightllm.models.dspark.train_module import random_dspark_draft
    from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir

    model_dir = get_default_model_dir()
    packaged = default_draft_dir_for(model_dir, "dspark")
    if packaged is not None:
        return packaged
    return random_dspark_draft(AutoConfig.from_pretrained(model_dir), str(tmp_path_factory.mktemp("dspark")), seed=0,
                               block_size=K + 1, std=0.02)


# Everyday requests of several kinds (no dataset needed), in the chat template.
QUESTIONS = ["Write a Python function that reverses a string.", "Give me three tips for sleeping better.",
             "Explain why the sky is blue.", "What is 17 times 23?", "Write a haiku about autumn.",
             "How do I make a cup of tea?", "Summarise the plot of Romeo and Juliet.",
             "What is a prime number?", "List the planets of the solar system.",
             "How does a bicycle stay upright?", "Tom has 5 apples and eats 2. How many are left?"]


def _prompts():
    from transformers import AutoTokenizer

    from lightllm.tools.prompts import chat_prompt_ids
    from lightllm.utils.embedded_model import get_default_model_dir

    return chat_prompt_ids(AutoTokenizer.from_pretrained(get_default_model_dir()), QUESTIONS[:NUM_REQS])


def _run(draft_dir, graphs: bool, **kw):
    args = StartArgs(mtp_mode="dspark", mtp_step=K, mtp_draft_model_dir=[draft_dir], disable_cudagraph=not graphs,
                     **ENGINE, **kw)
    res, captured = run_embedded(args, _prompts())
    return [(r.token_ids, r.logprobs) for r in res], captured, res


@pytest.fixture(scope="module")
def outputs(draft_dir):
    return {(m, g): _run(draft_dir, g, **kw) for m, kw in DSPARK_MODES.items() for g in (True, False)}


@pytest.mark.parametrize("mode", list(DSPARK_MODES))
def test_dspark_graphs_equal_eager(outputs, mode):
    (graph_out, captured, _), (eager_out, eager_captured, _) = outputs[(mode, True)], outputs[(mode, False)]
    assert captured and not eager_captured
    assert graph_out == eager_out  # tokens and log-probs, bit-exact


def test_dspark_b0_equals_strict_and_a_budget_relaxes(outputs):
    assert [t for t, _ in outputs[("asd0", True)][0]] == [t for t, _ in outputs[("strict", True)][0]]
    res = outputs[("asd_large", True)][2]
    assert sum(r.asd_relaxed_token_num for r in res) > 0
    assert max(a for r in res for a in r.accept_lens) == K + 1  # whole blocks accepted: anchors move by K+1


def test_dspark_confidences_come_back_every_step(outputs):
    for r in outputs[("strict", True)][2]:
        assert len(r.draft_confidences) == len(r.accept_lens)
        assert all(len(c) == K and all(0.0 <= x <= 1.0 for x in c) for c in r.draft_confidences)


def test_deterministic_strict_dspark_equals_plain(draft_dir):
    det = dict(enable_deterministic_inference=True)
    plain, _ = run_embedded(StartArgs(**ENGINE, **det), _prompts())
    dspark, _, _ = _run(draft_dir, True, **det)
    assert [t for t, _ in dspark] == [r.token_ids for r in plain]
