"""ASD end to end through HTTP on the embedded model and its trained draft."""
import json
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir
from lightllm.utils.server_launcher import launch_server, scrape
from unit_tests.data_paths import require_gsm8k

NUM_QUESTIONS = 4
MAX_NEW_TOKENS = 32
SERVER_BUDGET = 2.0
# bf16's spacing of logits in [32, 64): a batch of another shape (two clients in one step) may round a
# logit one step apart on a GPU, and a regret is a difference of two logits
LOGIT_ULP = 0.25
MTP_FLAGS = ["--mtp_mode", "eagle_with_att", "--mtp_step", "3", "--max_req_total_len", "512"]


def _draft_or_skip():
    draft = default_draft_dir_for(get_default_model_dir(), "eagle_with_att")
    if draft is None:
        pytest.skip("the embedded model's trained draft is not packaged")
    return draft


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    _draft_or_skip()
    logs = tmp_path_factory.mktemp("asd_servers")
    strict = launch_server(MTP_FLAGS, str(logs / "strict.log"))
    try:
        asd = launch_server(MTP_FLAGS + ["--mtp_asd_regret_budget", str(SERVER_BUDGET),
                                         "--mtp_asd_local_regret_ratio", "0.25",
                                         "--mtp_asd_block_max_mismatch", "2"], str(logs / "asd.log"))
    except Exception:
        strict.stop()
        raise
    yield strict, asd
    strict.stop()
    asd.stop()


@pytest.fixture(scope="module")
def prompts():
    path = require_gsm8k("test")
    tok = AutoTokenizer.from_pretrained(get_default_model_dir())
    with open(path) as f:
        qs = [json.loads(line)["question"] for line in f][:NUM_QUESTIONS]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in qs]


def _gen(server, prompt, **params):
    r = httpx.post(server.url + "/generate", timeout=600, json={
        "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "return_details": True, **params}})
    assert r.status_code == 200, r.text
    out = r.json()
    out["ids"] = [t["id"] for t in out["tokens"]]
    return out


def _tokens_per_step(outs):
    n = sum(o["count_output_tokens"] for o in outs)
    return n / (n - sum(o["mtp_accepted_token_num"] for o in outs))


def test_budget_zero_is_token_identical_to_strict(servers, prompts):
    strict, asd = servers
    for p in prompts:
        s, z = _gen(strict, p), _gen(asd, p, asd_regret_budget=0)
        assert z["ids"] == s["ids"]
        assert z["asd_relaxed_token_num"] == 0 and z["asd_regret_spent"] == 0.0


# slow on CPU (52 s); the in-process ASD tests cover the budget, the GPU suite runs this too
@pytest.mark.slow
def test_positive_budget_raises_acceptance_and_stays_within_budget(servers, prompts):
    strict, asd = servers
    s = [_gen(strict, p) for p in prompts]
    a = [_gen(asd, p, asd_regret_budget=8.0) for p in prompts]
    assert sum(o["asd_relaxed_token_num"] for o in a) > 0
    assert _tokens_per_step(a) > _tokens_per_step(s)
    assert all(0 <= o["asd_regret_spent"] <= 8.0 for o in a)
    d = [_gen(asd, p) for p in prompts]  # the server's budget
    assert all(o["asd_regret_spent"] <= SERVER_BUDGET + 1e-6 for o in d)


def test_two_clients_with_different_budgets_do_not_interact(servers, prompts):
    _, asd = servers
    solo = {b: _gen(asd, prompts[0], asd_regret_budget=b) for b in (0.5, 8.0)}
    together = {}

    def run(b):
        together[b] = _gen(asd, prompts[0], asd_regret_budget=b)

    threads = [threading.Thread(target=run, args=(b,)) for b in (0.5, 8.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in (0.5, 8.0):
        assert together[b]["ids"] == solo[b]["ids"]
        # same tokens; the spent regret may differ by the rounding of the bf16 logits it is made of
        slack = LOGIT_ULP * (together[b]["asd_relaxed_token_num"] + solo[b]["asd_relaxed_token_num"])
        assert together[b]["asd_regret_spent"] == pytest.approx(solo[b]["asd_regret_spent"], abs=slack + 1e-6)
        assert together[b]["asd_regret_spent"] <= b


@pytest.mark.parametrize("bad", [-1, "1.0", True, [1], "NaN", "Infinity"])
def test_bad_per_request_budget_is_400_and_server_keeps_serving(servers, bad):
    _, asd = servers
    raw = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2, "asd_regret_budget": "__BAD__"}})
    raw = raw.replace('"__BAD__"', bad if bad in ("NaN", "Infinity") else json.dumps(bad))
    r = httpx.post(asd.url + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "asd_regret_budget"
    r = httpx.post(asd.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "asd_regret_budget": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "asd_regret_budget"
    assert _gen(asd, "hi", max_new_tokens=2)["count_output_tokens"] >= 1


def test_metrics_export_asd_totals(servers, prompts):
    _, asd = servers
    _gen(asd, prompts[1], asd_regret_budget=8.0)
    assert asd.metric("lightllm_asd_relaxed_tokens_total") > 0
    assert asd.metric("lightllm_asd_regret_spent_total") > 0
    assert asd.metric("lightllm_mtp_mean_tokens_per_step") > 1


def test_inter_token_latency_counts_an_mtp_step_once(servers):
    """An MTP verify step commits several tokens in one update: the inter-token latency histogram
    observes its gap once (vLLM's semantics), so it counts the request's verify steps."""
    strict, _ = servers
    before = scrape(strict.url)
    out = _gen(strict, "<|im_start|>user\nCount from one to thirty.<|im_end|>\n<|im_start|>assistant\n",
               ignore_eos=True)
    grown = scrape(strict.url) - before
    tokens = out["count_output_tokens"]
    assert tokens == MAX_NEW_TOKENS
    steps = grown.value("lightllm_mtp_accept_len_count")
    assert grown.value("lightllm_mtp_accept_len_sum") == tokens - 1  # the first token comes from the prefill
    assert grown.value("lightllm_inter_token_latency_seconds_count") == steps < tokens - 1  # drafts were accepted
    assert grown.value("lightllm_time_to_first_token_seconds_count") == 1
    assert grown.value("lightllm_inter_token_latency_seconds_sum") > 0
