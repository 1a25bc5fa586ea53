"""The HTTP API on the embedded SmolLM2-135M-Instruct, through a real server process."""
import json
import threading

import httpx
import pytest

from lightllm.utils.server_launcher import launch_server, scrape

CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = launch_server(["--max_req_total_len", "512", "--running_max_req_size", "8"], str(log))
    yield s
    s.stop()


def _gen(c, text, **params):
    r = c.post("/generate", json={"inputs": text, "parameters": {"return_details": True, **params}})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_and_chat_give_sensible_text(server):
    with server.client() as c:
        out = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 20, "temperature": 0}).json()
        assert "Paris" in out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] >= 1
        g = _gen(c, CHAT_PROMPT.format("What is the capital of France?"), max_new_tokens=20)
        assert "Paris" in g["generated_text"][0]
        assert g["finish_reason"] == "eos" and g["tokens"][-1]["id"] == 2  # <|im_end|>
        assert g["count_output_tokens"] == len(g["tokens"]) and g["prompt_tokens"] > 5


def test_stream_matches_non_stream(server):
    prompt = CHAT_PROMPT.format("Name three colors.")
    with server.client() as c:
        full = _gen(c, prompt, max_new_tokens=24)
        ids = []
        with c.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 24}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if ev["token"] is not None:
                        ids.append(ev["token"]["id"])
                    last = ev
        assert ids == [t["id"] for t in full["tokens"]]
        assert last["finished"] and last["generated_text"] == full["generated_text"][0]
        # OpenAI streaming: deltas concatenate to the non-streamed text
        body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24, "temperature": 0}
        text = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        deltas = []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = [l for l in r.iter_lines() if l.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for l in lines[:-1]:
            deltas.append(json.loads(l[6:])["choices"][0]["delta"]["content"])
        assert "".join(deltas) == text


def test_completions_models_health_metrics(server):
    with server.client() as c:
        out = c.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 6, "temperature": 0}).json()
        assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 6
        assert c.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        assert c.get("/health").json() == {"status": "ok"}
        metrics = c.get("/metrics").text
        for name in ("lightllm_request_count_total", "lightllm_generation_tokens_total",
                     "lightllm_mtp_accept_len_bucket", "lightllm_asd_relaxed_tokens_total"):
            assert name in metrics


def test_batch_step_metrics_count_the_engine_steps(server):
    names = ("lightllm_batch_steps_total", "lightllm_batch_step_requests_total", "lightllm_batch_step_seconds_total")
    before_page = scrape(server.url)
    before = {n: server.metric(n) for n in names}
    with server.client() as c:
        out = _gen(c, "1, 2, 3, 4,", max_new_tokens=6, ignore_eos=True)
    assert len(out["tokens"]) == 6
    delta = {n: server.metric(n) - before[n] for n in names}
    # no MTP, a one-chunk prompt, alone: one prefill step and five decode steps, batch size 1
    assert delta["lightllm_batch_steps_total"] == 6
    assert delta["lightllm_batch_step_requests_total"] == 6
    assert delta["lightllm_batch_step_seconds_total"] > 0
    grown = scrape(server.url) - before_page
    assert grown.value("lightllm_decode_steps_by_batch_total", 0.0, batch="1") == 5
    assert grown.value("lightllm_decode_step_requests_by_batch_total", 0.0, batch="1") == 5
    assert grown.value("lightllm_decode_step_seconds_by_batch_total", 0.0, batch="1") > 0


def test_concurrent_requests_each_get_their_own_answer(server):
    questions = [f"What is {a} plus {b}?" for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (6, 1)]]
    with server.client() as c:
        alone = [_gen(c, CHAT_PROMPT.format(q), max_new_tokens=16)["tokens"] for q in questions]
    together = [None] * len(questions)

    def run(i):
        with server.client() as c:
            together[i] = _gen(c, CHAT_PROMPT.format(questions[i]), max_new_tokens=16)["tokens"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # batched fp32 CPU numerics equal the one-at-a-time ones on these prompts
    assert [[t["id"] for t in x] for x in together] == [[t["id"] for t in x] for x in alone]


def test_stop_sequences(server):
    with server.client() as c:
        g = _gen(c, "1, 2, 3, 4, 5, 6,", max_new_tokens=20, stop_sequences=["9"])
        assert g["finish_reason"] == "stop" and "9" not in g["generated_text"][0]
        assert "8" in g["generated_text"][0]


@pytest.mark.parametrize("params,field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": 100000}, "max_new_tokens"),
    ({"repetition_penalty": "x"}, "repetition_penalty"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"asd_regret_budget": 1.0}, "asd_regret_budget"),  # valid value, but this server runs without ASD
    ({"bogus": 1}, "bogus"),
])
def test_bad_parameters_are_400_and_server_keeps_serving(server, params, field):
    with server.client() as c:
        r = c.post("/generate", json={"inputs": "hi", "parameters": params})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)
        if field == "asd_regret_budget":
            assert "--mtp_asd_regret_budget" in r.json()["error"]["message"]
        assert c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"inputs": 5}', b'{"inputs": ""}'])
def test_bad_bodies_are_400(server, body):
    with server.client() as c:
        r = c.post("/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = c.post("/v1/chat/completions", json={"messages": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.post("/v1/completions", json={"prompt": "x", "n": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_client_disconnect_frees_kv(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate_stream",
                      json={"inputs": "Count to one thousand:", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i > 6:
                    break  # hang up mid-stream
    import time
    deadline = time.time() + 30
    while time.time() < deadline and (server.metric("lightllm_kv_used_tokens") > 0
                                      or server.metric("lightllm_running_requests") > 0):
        time.sleep(0.2)
    assert server.metric("lightllm_kv_used_tokens") == 0
    assert server.metric('lightllm_request_count_total{finish_reason="abort"}') >= 1
