"""--mtp_mode dspark in the engine: strict decoding equals plain decoding, B = 0 equals strict,
and every block proposal (tokens and confidences) equals the readable PyTorch module's
(``lightllm/models/dspark/train_module.py``), step after step, with the context the engine kept."""
import pytest
import torch

from lightllm.models.dspark.config import DSparkConfig
from lightllm.models.dspark.train_module import DSparkTrainModule, propose_greedy, random_dspark_draft, target_aux_hidden
from lightllm.server.api_start import StartArgsError, validate_start_args
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.tools.train_mtp_draft import TargetHead
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine

K = 3
BLOCK_SIZE = K + 2  # the block's last position is drafted but never proposed at this K
COMMON = dict(max_req_total_len=96, running_max_req_size=4, batch_max_tokens=48, max_total_token_num=600)
# a budget large enough that ASD accepts drafts of a random draft: accept lengths of every size
LARGE_BUDGET = 1e6


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_" + request.param)
    m = tiny_model(request.param, seed=2, root=root)
    draft = random_dspark_draft(m.hf.config, str(root / "dspark"), seed=3, block_size=BLOCK_SIZE)
    return m.hf, m.model_dir, draft


def _engine(model_dir, draft, **kw):
    return make_engine(model_dir, mtp_mode="dspark", mtp_step=K, mtp_draft_model_dir=[draft], **COMMON, **kw)


def _workload(vocab, n=7, seed=0):
    prompts = random_prompts(vocab, n, range(1, 30), seed)
    return prompts, [{"max_new_tokens": 4 + 3 * i, "ignore_eos": True} for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_strict_dspark_is_token_identical_to_plain_decoding(tiny, overlap):
    """Also with --enable_decode_microbatch_overlap (the DP backend's two micro-batches on one rank)."""
    hf, d, draft = tiny
    prompts, params = _workload(hf.config.vocab_size)
    plain = make_engine(d, **COMMON).generate(prompts, params)
    eng = _engine(d, draft, enable_decode_microbatch_overlap=overlap)
    out = eng.generate(prompts, params)
    for i in range(len(prompts)):
        assert out[i].token_ids == plain[i].token_ids == hf_greedy(hf, prompts[i], params[i]["max_new_tokens"])
        assert all(1 <= a <= K + 1 for a in out[i].accept_lens)
    assert eng.backend.mem_manager.available_size == eng.backend.mem_manager.size


def test_budget_zero_is_identical_to_strict_and_a_budget_relaxes(tiny):
    hf, d, draft = tiny
    prompts, params = _workload(hf.config.vocab_size, seed=1)
    strict = _engine(d, draft).generate(prompts, params)
    zero = _engine(d, draft, mtp_asd_regret_budget=0.0).generate(prompts, params)
    assert [r.token_ids for r in zero] == [r.token_ids for r in strict]
    assert all(r.asd_relaxed_token_num == 0 for r in zero)
    relaxed = _engine(d, draft, mtp_asd_regret_budget=LARGE_BUDGET).generate(prompts, params)
    assert sum(r.asd_relaxed_token_num for r in relaxed) > 0
    assert [len(r.token_ids) for r in relaxed] == [p["max_new_tokens"] for p in params]


def test_every_block_proposal_matches_the_reference_module(tiny):
    """One request, ASD with a large budget so that accept lengths vary: before every verify
    step the drafts equal propose_greedy over the committed sequence (anchor = the last
    committed token), and the reported confidences are the reference's."""
    hf, d, draft = tiny
    prompt = random_prompts(hf.config.vocab_size, 1, range(12, 13), seed=5)[0]
    eng = _engine(d, draft, mtp_asd_regret_budget=LARGE_BUDGET)
    drafts_per_step = []
    eng.backend.verify_observer = lambda rec: drafts_per_step.append(rec.drafts[:K].tolist())
    res = eng.generate([prompt], [{"max_new_tokens": 24, "ignore_eos": True}])[0]
    assert len(set(res.accept_lens)) > 1, "accept lengths should vary"
    assert len(res.draft_confidences) == len(res.accept_lens) == len(drafts_per_step)

    module = DSparkTrainModule.load_draft(hf.config, draft).eval()
    head = TargetHead(hf)
    layer_ids = DSparkConfig.load(draft).target_layer_ids
    seq = prompt + res.token_ids
    aux = target_aux_hidden(hf, torch.tensor([seq]), layer_ids)[0]  # causal: a prefix's rows are its own
    committed = 1  # the token sampled at prefill
    for step, (drafts, conf) in enumerate(zip(drafts_per_step, res.draft_confidences)):
        p = len(prompt) + committed - 1  # the anchor: the last committed token
        ref_tokens, ref_conf = propose_greedy(module, head, aux[:p], seq[p], p, K)
        assert drafts == ref_tokens, f"step {step}"
        assert conf == pytest.approx(ref_conf, abs=1e-4), f"step {step}"
        committed += res.accept_lens[step]


def test_confidences_are_probabilities_for_every_request(tiny):
    hf, d, draft = tiny
    prompts, params = _workload(hf.config.vocab_size, n=4, seed=2)
    for r in _engine(d, draft).generate(prompts, params):
        assert len(r.draft_confidences) == len(r.accept_lens)
        assert all(len(c) == K and all(0.0 < x < 1.0 for x in c) for c in r.draft_confidences)


@pytest.mark.parametrize("change, message", [
    (dict(mtp_step=BLOCK_SIZE), "block_size - 1"),
    (dict(tp=2), "one rank"),
])
def test_start_up_errors_name_the_flag(tiny, change, message):
    _, d, draft = tiny
    args = dict(model_dir=d, mtp_mode="dspark", mtp_step=K, mtp_draft_model_dir=[draft], **COMMON)
    args.update(change)
    with pytest.raises(StartArgsError, match=message):
        validate_start_args(StartArgs(**args))


def test_a_non_dspark_draft_dir_is_a_start_up_error(tiny, tmp_path):
    _, d, _ = tiny
    other = tmp_path / "eagle"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama_mtp"}')
    with pytest.raises(StartArgsError, match="not a dspark draft"):
        validate_start_args(StartArgs(model_dir=d, mtp_mode="dspark", mtp_step=K, mtp_draft_model_dir=[str(other)]))
