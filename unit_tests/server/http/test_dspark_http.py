"""The DSpark usage line through HTTP on the embedded model:

    api_server --mtp_mode dspark --mtp_step 3 --mtp_asd_regret_budget 2.0625
               --mtp_asd_local_regret_ratio 0.25 --mtp_asd_block_max_mismatch 2

with the packaged dspark draft (no --mtp_draft_model_dir), or a random one when none is packaged.
Both APIs answer, and /metrics has the drafts' confidence and acceptance by depth."""
import httpx
import pytest

from lightllm.utils.embedded_model import default_draft_dir_for, get_default_model_dir
from lightllm.utils.server_launcher import launch_server, scrape

K = 3
USAGE_LINE = ["--mtp_mode", "dspark", "--mtp_step", str(K), "--mtp_asd_regret_budget", "2.0625",
              "--mtp_asd_local_regret_ratio", "0.25", "--mtp_asd_block_max_mismatch", "2"]
SMALL = ["--max_req_total_len", "512", "--running_max_req_size", "8"]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoConfig

    from lightllm.models.dspark.train_module import random_dspark_draft

    model_dir = get_default_model_dir()
    extra = []
    if default_draft_dir_for(model_dir, "dspark") is None:
        draft = random_dspark_draft(AutoConfig.from_pretrained(model_dir), str(tmp_path_factory.mktemp("dspark")),
                                    seed=0, block_size=K + 1, std=0.02)
        extra = ["--mtp_draft_model_dir", draft]
    s = launch_server(USAGE_LINE + SMALL + extra, str(tmp_path_factory.mktemp("dspark_log") / "server.log"))
    yield s
    s.stop()


def test_usage_line_serves_generate_and_chat(server):
    r = httpx.post(server.url + "/generate", timeout=300, json={
        "inputs": "The capital of France is", "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "return_details": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["generated_text"] and out["count_output_tokens"] == len(out["tokens"]) > 0
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": MAX_NEW_TOKENS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_metrics_report_confidence_next_to_acceptance_by_depth(server):
    before = scrape(server.url)
    httpx.post(server.url + "/generate", timeout=300, json={
        "inputs": "Count: one, two, three,", "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}})
    grown = scrape(server.url) - before
    for depth in range(1, K + 1):
        verified = grown.value("lightllm_mtp_draft_confidence_count", depth=str(depth))
        assert verified > 0
        assert 0.0 <= grown.value("lightllm_mtp_draft_confidence_sum", depth=str(depth)) <= verified
        assert grown.value("lightllm_mtp_draft_depth_accepted_total", 0.0, depth=str(depth)) <= verified


def test_acceptance_by_depth_counts_committed_drafts():
    """Hand case: accept_len 3 commits the drafts of depths 1 and 2; accept_len 1 commits none."""
    from prometheus_client import generate_latest

    from lightllm.server.metrics import ServerMetrics
    from lightllm.utils.server_launcher import MetricsPage

    m = ServerMetrics()
    m.observe_step(3, [0.75, 0.5, 0.25])
    m.observe_step(1, [0.5, 0.25, 0.125])
    page = MetricsPage.parse(generate_latest(m.registry).decode())
    assert [page.value("lightllm_mtp_draft_depth_accepted_total", 0.0, depth=str(d)) for d in (1, 2, 3)] == [1, 1, 0]
    assert [page.value("lightllm_mtp_draft_confidence_sum", depth=str(d)) for d in (1, 2, 3)] == [1.25, 0.75, 0.375]
    assert page.value("lightllm_mtp_draft_confidence_count", depth="1") == 2
