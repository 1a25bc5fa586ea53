"""The OpenAI API as clients use it (issue 29), through real servers over a tiny random fp32 Llama
(unit_tests/models/tiny_checkpoints) with a byte-level tokenizer: log-probs against transformers'
own forward over the returned tokens (plain, strict MTP, ASD; streamed and not), n > 1, text parts,
the developer role, the served model name and max_model_len."""
import json
import time

import httpx
import pytest
import torch

from lightllm.utils.server_launcher import launch_server, sse_data, strict_json
from unit_tests.models.tiny_checkpoints import MAX_POSITIONS, tiny_model
from unit_tests.server.http.tiny_tokenizer import write_tokenizer

MAX_REQ_TOTAL_LEN = 512  # above the tiny model's MAX_POSITIONS (256): max_model_len is 256
MAX_TOKENS = 12
# fp32 on both sides (the servers run --data_type float32: on CUDA the default is bf16, whose
# rounding moves log-probs by ~0.04); the engine's kernels sum in another order
LOGPROB_TOL = 2e-3
MODEL_NAME = "tiny-llama"
CHAT = [{"role": "user", "content": "hello there, what is the time?"}]
PROMPT = "the rain in spain stays"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_model("llama", tmp_path_factory.mktemp("tiny_openai"))
    write_tokenizer(model.model_dir, model.vocab_size)
    return model


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """name -> server: plain, strict MTP, ASD (a weak random draft: many mismatches, so relaxations)."""
    logs = tmp_path_factory.mktemp("tiny_openai_logs")
    base = ["--model_dir", tiny.model_dir, "--max_req_total_len", str(MAX_REQ_TOTAL_LEN),
            "--running_max_req_size", "8", "--max_total_token_num", "4096", "--data_type", "float32",
            # the tests resend prompts and compare log-probs and usage exactly: every prefill from token 0
            "--disable_dynamic_prompt_cache"]
    draft = tiny.draft("draft", with_attention=True, std=0.02)
    mtp = ["--mtp_mode", "eagle_with_att", "--mtp_step", "2", "--mtp_draft_model_dir", draft]
    flags = {"plain": base + ["--model_name", MODEL_NAME], "mtp": base + mtp,
             "asd": base + mtp + ["--mtp_asd_regret_budget", "4.0"]}
    started = {}
    try:
        for name, f in flags.items():
            started[name] = launch_server(f, str(logs / f"{name}.log"))
        yield started
    finally:
        for s in started.values():
            s.stop()


def _post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return strict_json(r.text)


def _stream(server, path, body):
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    return [strict_json(d) for d in data[:-1]]


def _prompt_ids(tok, chat: bool):
    if chat:
        return tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    return tok.encode(PROMPT, add_special_tokens=True)


def _engine_ids(server, tok, chat: bool):
    """The returned token ids, through /generate with the same prompt ids' text (greedy)."""
    text = tok.decode(_prompt_ids(tok, chat)) if chat else PROMPT
    out = _post(server, "/generate", {"inputs": text, "parameters": {
        "max_new_tokens": MAX_TOKENS, "ignore_eos": True, "return_details": True}})
    return [t["id"] for t in out["tokens"]]


def _reference_logprobs(hf, prompt_ids, out_ids):
    """log p(out token i | prompt, out[:i]) by transformers' forward over prompt + output."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(out_ids).unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.model_dir)


@pytest.mark.parametrize("name", ["plain", "mtp", "asd"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_logprobs_equal_transformers_forward(servers, tiny, tok, name, chat):
    server = servers[name]
    model = {"model": MODEL_NAME} if name == "plain" else {}
    if chat:
        path, body = "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 0}
    else:
        path, body = "/v1/completions", {"prompt": PROMPT, "logprobs": 0}
    body.update(model, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = _post(server, path, body)
    ids = _engine_ids(server, tok, chat)
    assert len(ids) == MAX_TOKENS
    if name == "mtp":  # strict MTP is plain greedy decoding
        assert ids == _engine_ids(servers["plain"], tok, chat)
    ref = _reference_logprobs(tiny.hf, _prompt_ids(tok, chat), ids)
    lp = out["choices"][0]["logprobs"]
    texts = [tok.decode([t]) for t in ids]
    if chat:
        got = [e["logprob"] for e in lp["content"]]
        assert [e["token"] for e in lp["content"]] == texts
        assert all(e["bytes"] == list(e["token"].encode("utf-8")) and e["top_logprobs"] == [] for e in lp["content"])
    else:
        got = lp["token_logprobs"]
        assert lp["tokens"] == texts and lp["top_logprobs"] == [None] * MAX_TOKENS
        assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(MAX_TOKENS)]
    assert got == pytest.approx(ref, abs=LOGPROB_TOL)
    # streamed: the chunks' log-probs, in order, are the same
    streamed = []
    for c in _stream(server, path, body):
        if c["choices"] and c["choices"][0]["logprobs"] is not None:
            part = c["choices"][0]["logprobs"]
            streamed += [e["logprob"] for e in part["content"]] if chat else part["token_logprobs"]
    assert streamed == got
    if name == "asd":
        assert out["mtp_accepted_token_num"] >= 0 and out["asd_regret_spent"] is not None


def _reference_top(hf, prompt_ids, out_ids, k):
    """(values [n, k + 1], ids [n, k + 1]): transformers' top k + 1 log-probs at each returned position."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return torch.topk(lp, k + 1, dim=-1)


TOP_K = {True: 5, False: 3}  # chat top_logprobs, completions logprobs


@pytest.mark.parametrize("name", ["plain", "mtp", "asd"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_top_logprobs_equal_transformers_forward(servers, tiny, tok, name, chat):
    """Each returned token's alternatives are the top k of transformers' log-softmax at its position
    (ASD: the target's, also where the committed token is a relaxed draft), streamed and not."""
    server, k = servers[name], TOP_K[chat]
    if chat:
        path, body = "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": k}
    else:
        path, body = "/v1/completions", {"prompt": PROMPT, "logprobs": k}
    body.update(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = _post(server, path, body)
    ids = _engine_ids(server, tok, chat)
    prompt_ids = _prompt_ids(tok, chat)
    ref_vals, ref_ids = _reference_top(tiny.hf, prompt_ids, ids, k)
    chosen = _reference_logprobs(tiny.hf, prompt_ids, ids)
    lp = out["choices"][0]["logprobs"]
    text = lambda t: tok.decode([t])
    clear_ranks = 0  # ranks whose text is compared (not in a near tie)
    for pos in range(MAX_TOKENS):
        vals, alt = ref_vals[pos].tolist(), [text(int(t)) for t in ref_ids[pos]]
        # ranks whose order rounding cannot swap (neighbours more than 2 tolerances apart)
        clear = [j for j in range(k) if (j == 0 or vals[j - 1] - vals[j] > 2 * LOGPROB_TOL)
                 and vals[j] - vals[j + 1] > 2 * LOGPROB_TOL]
        if chat:
            entry = lp["content"][pos]
            assert entry["token"] == text(ids[pos]) and entry["logprob"] == pytest.approx(chosen[pos], abs=LOGPROB_TOL)
            top = entry["top_logprobs"]
            assert len(top) == k and all(set(e) == {"token", "logprob", "bytes"} for e in top)
            assert all(e["bytes"] == list(e["token"].encode("utf-8")) for e in top)
            assert [e["logprob"] for e in top] == pytest.approx(vals[:k], abs=LOGPROB_TOL)
            assert all(top[j]["token"] == alt[j] for j in clear), (pos, top, alt)
            clear_ranks += len(clear)
        else:
            assert lp["token_logprobs"][pos] == pytest.approx(chosen[pos], abs=LOGPROB_TOL)
            got = lp["top_logprobs"][pos]
            want = {}
            for t, v in zip(alt[:k] + [text(ids[pos])], vals[:k] + [chosen[pos]]):
                want.setdefault(t, v)  # same text: the likelier one's
            if vals[k - 1] - vals[k] > 2 * LOGPROB_TOL:  # the k-th and the next are not a near tie
                assert list(got) == list(want), (pos, got, want)
                clear_ranks += k
            assert len(got) <= k + 1
            for t, v in got.items():
                if t in want:
                    assert v == pytest.approx(want[t], abs=LOGPROB_TOL), (pos, t, got, want)
    assert clear_ranks >= MAX_TOKENS * k // 2  # the ties skipped are few
    if name == "asd":  # some committed tokens are relaxed drafts: their lists are still the target's
        assert out["asd_relaxed_token_num"] > 0
        assert any(ids[pos] != int(ref_ids[pos, 0]) for pos in range(MAX_TOKENS))
    # streamed: the chunks' alternatives, in order, are the same
    streamed = []
    for c in _stream(server, path, body):
        if c["choices"] and c["choices"][0]["logprobs"] is not None:
            part = c["choices"][0]["logprobs"]
            streamed += [e["top_logprobs"] for e in part["content"]] if chat else part["top_logprobs"]
    assert streamed == ([e["top_logprobs"] for e in lp["content"]] if chat else lp["top_logprobs"])


def test_generate_details_top_logprobs(servers, tiny, tok):
    """/generate: parameters.top_logprobs adds each token's alternatives (ids, text, log-prob) to its details."""
    out = _post(servers["plain"], "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "ignore_eos": True, "return_details": True, "top_logprobs": 2}})
    ids = [t["id"] for t in out["tokens"]]
    ref_vals, ref_ids = _reference_top(tiny.hf, tok.encode(PROMPT, add_special_tokens=True), ids, 2)
    for pos, t in enumerate(out["tokens"]):
        alts = t["top_logprobs"]
        assert [a["logprob"] for a in alts] == pytest.approx(ref_vals[pos, :2].tolist(), abs=LOGPROB_TOL)
        assert alts[0]["id"] == t["id"] == int(ref_ids[pos, 0]) and alts[0]["text"] == tok.decode([t["id"]])
    plain = _post(servers["plain"], "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "return_details": True}})
    assert all("top_logprobs" not in t for t in plain["tokens"])


def test_no_logprobs_unless_asked(servers):
    out = _post(servers["plain"], "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert out["choices"][0]["logprobs"] is None
    out = _post(servers["plain"], "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert out["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/generate", {"inputs": PROMPT, "parameters": {"top_logprobs": 21}}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "bogus"}}}}, "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 250}, "max_tokens"),
])
def test_refusals_name_the_field(servers, path, body, field):
    r = httpx.post(servers["plain"].url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field + ":")
    if field == "max_tokens":
        assert "max_model_len 256" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,message", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs: must be an integer in 0..20, got 21"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs: must be an integer in 0..20, got 21"),
    ("/generate", {"inputs": PROMPT, "parameters": {"top_logprobs": 21}}, "top_logprobs: must be <= 20, got 21"),
])
def test_top_logprobs_over_20_is_a_clear_400(servers, path, body, message):
    r = httpx.post(servers["mtp"].url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text


def test_response_format_text_is_the_default(servers):
    """``{"type": "text"}`` (what some clients send every time) is served as no response_format (JSON
    output: unit_tests/server/http/test_structured_output_http.py)."""
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})):
        r = httpx.post(servers["plain"].url + path, json=dict(body, max_tokens=2, response_format={"type": "text"}),
                       timeout=60)
        assert r.status_code == 200, r.text


def test_model_name_404_and_models_list(servers, tiny):
    plain, mtp = servers["plain"], servers["mtp"]
    models = httpx.get(plain.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME]
    assert models[0]["max_model_len"] == min(MAX_REQ_TOTAL_LEN, MAX_POSITIONS)
    # default name: the model dir's basename
    assert httpx.get(mtp.url + "/v1/models").json()["data"][0]["id"] == "target"
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})):
        r = httpx.post(plain.url + path, json={**body, "model": "gpt-4", "max_tokens": 2}, timeout=60)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == 404 and err["type"] == "NotFoundError" and err["param"] == "model"
        assert "gpt-4" in err["message"]
        assert _post(plain, path, {**body, "model": MODEL_NAME, "max_tokens": 2})["model"] == MODEL_NAME


def test_text_parts_and_developer_role(servers):
    plain = servers["plain"]
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    as_string = _post(plain, "/v1/chat/completions", {**base, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"}]})
    as_parts = _post(plain, "/v1/chat/completions", {**base, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]})
    assert as_parts["choices"][0]["message"]["content"] == as_string["choices"][0]["message"]["content"]
    assert as_parts["usage"] == as_string["usage"]


def test_n_choices(servers):
    plain = servers["plain"]
    base = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    greedy = _post(plain, "/v1/completions", {**base, "n": 3, "temperature": 0})
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in greedy["choices"]}) == 1  # greedy: identical, as vLLM
    assert greedy["usage"]["completion_tokens"] == 3 * 8
    # sampled with a seed: choice i is the request with seed + i
    sampled = _post(plain, "/v1/completions", {**base, "n": 3, "best_of": 3, "temperature": 1.0, "seed": 7})
    alone = [_post(plain, "/v1/completions", {**base, "temperature": 1.0, "seed": 7 + i})["choices"][0]["text"]
             for i in range(3)]
    assert [c["text"] for c in sampled["choices"]] == alone
    assert len(set(alone)) > 1
    # streamed: every chunk names its choice; each choice's deltas make its text
    chat = {"messages": CHAT, "max_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 3, "n": 2,
            "stream_options": {"include_usage": True}}
    whole = _post(plain, "/v1/chat/completions", {k: v for k, v in chat.items() if k != "stream_options"})
    chunks = _stream(plain, "/v1/chat/completions", chat)
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["delta"]["content"]
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16


LOG_WAIT_S = 5.0


def test_request_log_lines(servers):
    _post(servers["plain"], "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})

    def logged(log: str) -> bool:  # the line is written after the response has gone out
        return any("POST /v1/completions 200" in l and "output_tokens=4" in l and " ms" in l for l in log.splitlines())

    deadline = time.monotonic() + LOG_WAIT_S
    log = open(servers["plain"].log_path).read()
    while not logged(log) and time.monotonic() < deadline:
        time.sleep(0.05)
        log = open(servers["plain"].log_path).read()
    assert logged(log), log[-2000:]
    assert "Traceback" not in log


@pytest.mark.parametrize("name", ["plain", "mtp", "asd"])
def test_official_openai_client(servers, tiny, tok, name):
    """The ``openai`` package against the server: chat and completions with log-probs, streamed
    and not (equal to transformers' forward over the returned tokens), n = 3, JSON output, and a
    model the server does not serve (the client's NotFoundError)."""
    openai = pytest.importorskip("openai")
    server = servers[name]
    model = MODEL_NAME if name == "plain" else "target"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    for chat in (True, False):
        ids = _engine_ids(server, tok, chat)
        ref = _reference_logprobs(tiny.hf, _prompt_ids(tok, chat), ids)
        if chat:
            out = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **common)
            got = [e.logprob for e in out.choices[0].logprobs.content]
            assert all(len(e.top_logprobs) == 2 for e in out.choices[0].logprobs.content)
            stream = client.chat.completions.create(messages=CHAT, logprobs=True, stream=True, **common)
            streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
        else:
            out = client.completions.create(prompt=PROMPT, logprobs=2, **common)
            got = out.choices[0].logprobs.token_logprobs
            # {text: log-prob}, up to logprobs + 1 (the returned token when outside the top 2, as
            # OpenAI); two ids of the same text (partial UTF-8 bytes) share a key
            assert all(1 <= len(t) <= 3 for t in out.choices[0].logprobs.top_logprobs)
            stream = client.completions.create(prompt=PROMPT, logprobs=0, stream=True, **common)
            streamed = [lp for c in stream if c.choices and c.choices[0].logprobs
                        for lp in c.choices[0].logprobs.token_logprobs]
        assert out.usage.completion_tokens == MAX_TOKENS
        assert got == pytest.approx(ref, abs=LOGPROB_TOL) and streamed == got
    three = client.chat.completions.create(messages=CHAT, n=3, seed=5, **{**common, "temperature": 1.0})
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 3 * MAX_TOKENS
    as_json = client.chat.completions.create(messages=CHAT, response_format={"type": "json_object"},
                                             model=model, max_tokens=MAX_TOKENS, temperature=0)
    if as_json.choices[0].finish_reason == "stop":  # the grammar ended: the text is one whole object
        assert isinstance(json.loads(as_json.choices[0].message.content), dict)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(prompt=PROMPT, **{**common, "model": "gpt-4"})


def test_everyday_client_requests(servers, tok):
    """What ordinary OpenAI clients send besides the basics: chat without max_tokens (the context
    left), the role in a stream's first delta only, prompts as token ids and several prompts at once
    (lm-eval's way), fields without effect, and errors an SDK can read."""
    plain = servers["plain"]
    max_model_len = min(MAX_REQ_TOTAL_LEN, MAX_POSITIONS)
    # chat without max_tokens may fill the context, as OpenAI and vLLM (16 is the completions default)
    out = _post(plain, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "ignore_eos": True})
    usage = out["usage"]
    assert usage["completion_tokens"] == max_model_len - usage["prompt_tokens"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert _post(plain, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True})["usage"]["completion_tokens"] == 16
    # a stream names the role in each choice's first delta only
    chunks = _stream(plain, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "n": 2, "ignore_eos": True})
    first = {}
    for c in chunks:
        (ch,) = c["choices"]
        first.setdefault(ch["index"], ch["delta"])
        assert ("role" in ch["delta"]) == (first[ch["index"]] is ch["delta"])
    assert [first[i]["role"] for i in (0, 1)] == ["assistant", "assistant"]
    # a prompt of token ids answers as its text does
    base = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids = _prompt_ids(tok, chat=False)
    as_text = _post(plain, "/v1/completions", {**base, "prompt": PROMPT})
    as_ids = _post(plain, "/v1/completions", {**base, "prompt": ids})
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"] and as_ids["usage"] == as_text["usage"]
    # several prompts: choice k * n + j is prompt k's j-th; usage counts each prompt once
    other = "hello world"
    alone = [_post(plain, "/v1/completions", {**base, "prompt": p}) for p in (other, PROMPT)]
    both = _post(plain, "/v1/completions", {**base, "prompt": [other, ids], "n": 2})
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone for _ in range(2)]
    assert both["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert both["usage"]["completion_tokens"] == 4 * 8
    texts = ["", ""]
    for c in _stream(plain, "/v1/completions", {**base, "prompt": [other, PROMPT]}):
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["text"]
    assert texts == [a["choices"][0]["text"] for a in alone]
    # token ids outside the vocabulary, and which prompt: a 400 naming the prompt
    r = httpx.post(plain.url + "/v1/completions", json={**base, "prompt": [ids, [0, 10 ** 6]]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"].startswith("prompt: [1] token id 1000000 is not in the vocabulary")
    # fields SDKs and frameworks send at values without effect
    _post(plain, "/v1/chat/completions", {**base, "messages": CHAT, "tools": None, "tool_choice": "none",
                                          "store": False, "metadata": {"run": "1"}, "parallel_tool_calls": True})
    r = httpx.post(plain.url + "/v1/chat/completions", json={**base, "messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, timeout=60)
    assert r.status_code == 400 and "tool calls are not supported" in r.json()["error"]["message"]
    # no such route or method: the same error object
    r = httpx.get(plain.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(plain.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
    assert httpx.get(plain.url + "/v1/models/" + MODEL_NAME).json()["id"] == MODEL_NAME
    assert httpx.get(plain.url + "/v1/models/gpt-4").status_code == 404


def test_openai_client_reads_errors_and_streams(servers):
    """The ``openai`` package: a 400's message, field and type reach the client's exception; its
    stream helper assembles a message whose role is the assistant's; models.retrieve."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=servers["plain"].url + "/v1", api_key="unused", timeout=300, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=0)
    assert e.value.param == "max_tokens" and str(e.value.code) == "400" and e.value.type == "BadRequestError"
    assert "max_tokens: must be" in str(e.value)
    with client.chat.completions.stream(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0) as s:
        for _ in s:
            pass
        message = s.current_completion_snapshot.choices[0].message  # the final one refuses a "length" finish
    assert message.role == "assistant" and message.content
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and isinstance(card.created, int)
