"""The pure parts of bench_e2e_throughput.py --prefix_cache (benchmarks/prefix_cache_workloads.py): the
texts and workloads, the SSE parsing, the rows, ratios, output comparison and done-means (no server)."""
import importlib.util
import json
import os
import sys

import pytest
from transformers import AutoTokenizer

from lightllm.tools.report import render_table
from lightllm.utils.server_launcher import MetricsPage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_e2e_throughput",
                                               os.path.join(REPO, "benchmarks", "bench_e2e_throughput.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
pcw = sys.modules["prefix_cache_workloads"]  # imported by the benchmark

QUESTIONS = ["Natalia sold clips to 48 of her friends in April.", "Weng earns $12 an hour for babysitting.",
             "Betty is saving money for a new wallet which costs $100.", "Julie is reading a 120-page book."]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bench.model_dir_or_embedded(None))


def test_prefix_cache_flags_and_defaults():
    args = bench.parse_args(["--prefix_cache"])
    assert (args.conversations, args.turns, args.prefix_new_tokens, args.system_tokens) == (32, 8, 64, 1000)
    assert (args.doc_tokens, args.doc_questions, args.doc_concurrency) == (3000, 64, 16)
    assert (args.resend_tokens, args.resend_times, args.resend_new_tokens) == (6000, 5, 50)
    assert (args.pressure_conversations, args.pressure_turns, args.pressure_kv_tokens) == (128, 3, None)
    assert args.prefix_arms == ["on", "off"] and args.rounds == 1 and args.prefix_workloads == list(pcw.WORKLOADS)
    assert args.out == os.path.join("docs", "data", "perf", "prefix_cache.json")
    assert bench.parse_args(["--prefix_cache", "--prefix_arms", "on"]).prefix_arms == ["on"]


@pytest.mark.parametrize("argv", [["--prefix_cache", "--serving"], ["--prefix_cache", "--turns", "0"],
                                  ["--prefix_cache", "--prefix_arms", "on", "on"],
                                  ["--prefix_cache", "--prefix_workloads", "nope"],
                                  ["--prefix_cache", "--pressure_kv_tokens", "0"]])
def test_prefix_cache_bad_flags(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_arm_flags_are_the_servers():
    from lightllm.server.api_cli import make_argument_parser

    assert pcw.ARM_FLAGS == {"on": [], "off": ["--disable_dynamic_prompt_cache"]}
    make_argument_parser().parse_args(pcw.ARM_FLAGS["on"])  # the default server


@pytest.mark.parametrize("n", [1, 37, 300])
def test_exact_length_text(tokenizer, n):
    text, count = pcw.exact_length_text(tokenizer, n, QUESTIONS, start=1)
    assert count == len(tokenizer.encode(text, add_special_tokens=False)) and n - 1 <= count <= n
    assert text.startswith("Weng earns"[:max(1, min(len(text), 10))])
    with pytest.raises(ValueError):
        pcw.exact_length_text(tokenizer, 0, QUESTIONS)


def test_conversation_turns_do_not_repeat_while_there_are_questions():
    turns = pcw.conversation_turns(QUESTIONS, 2, 2)
    assert turns == [[QUESTIONS[0], QUESTIONS[1]], [QUESTIONS[2], QUESTIONS[3]]]
    assert pcw.conversation_turns(QUESTIONS, 3, 2)[2] == [QUESTIONS[0], QUESTIONS[1]]  # cycling


def test_build_prefix_workloads(tokenizer):
    texts = [f"Text number {i} is about apples and oranges." for i in range(50)]
    work = pcw.build_prefix_workloads(tokenizer, texts, QUESTIONS, system_tokens=60, conversations=2, turns=3,
                                      doc_tokens=80, doc_questions=3, resend_tokens=120, resend_times=2,
                                      resend_new_tokens=10, pressure_conversations=3, pressure_turns=2)
    assert 59 <= work.system_tokens <= 60 and 79 <= work.doc_tokens <= 80
    assert len(work.chat_turns) == 2 and all(len(c) == 3 for c in work.chat_turns)
    assert len(work.pressure_turns) == 3 and all(len(c) == 2 for c in work.pressure_turns)
    assert len(work.doc_messages) == 3 and all(m.startswith(work.doc) for m in work.doc_messages)
    assert len(set(work.doc_messages)) == 3
    assert 119 <= work.resend_first_tokens <= 120 and len(work.resend_prompts) == 2
    head = work.resend_first.rpartition("<|im_end|>")[0]
    assert all(p.startswith(head) and p != work.resend_first for p in work.resend_prompts)  # the same prefix
    assert all(work.resend_first_tokens + 5 <= n <= work.resend_first_tokens + 15 for n in work.resend_prompt_tokens)
    assert work.system != work.doc and not work.resend_first.startswith(work.system[:20])  # own texts
    assert json.loads(json.dumps(work.summary()))["doc_questions"] == 3
    # the server's bound: every turn of every conversation fits
    bound = pcw.conversation_max_len(tokenizer, work.system_tokens, work.chat_turns, 8)
    history = [{"role": "system", "content": work.system}]
    for q in work.chat_turns[0]:
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": "word " * 8}]
    assert len(tokenizer.apply_chat_template(history, tokenize=True)) <= bound


def test_pressure_pool_is_a_tenth_of_the_default_at_least_one_request():
    assert pcw.pressure_pool_tokens(128, 1408, 0) == 18022
    assert pcw.pressure_pool_tokens(128, 1408, 3) == 18060  # MTP's draft slots per request too
    assert pcw.pressure_pool_tokens(128, 512, 0, cap=16384) == 1638  # the CPU default's tenth
    assert pcw.pressure_pool_tokens(4, 1000, 3) == 1003  # never below one full request


def test_kv_pool_from_the_start_line():
    line = ("2026-12-01 15:30:34,516 INFO lightllm.server.api_start: serving /m on http://127.0.0.1:1 "
            "(device cpu, float32, KV pool 16384 tokens)")
    assert pcw.kv_pool_from_log("x\n" + line + "\n") == 16384 and pcw.kv_pool_from_log("nothing") is None


def _sse(obj):
    return ("data: " + json.dumps(obj) + "\n\n").encode()


def test_streamed_chat_reply_text_usage_and_cached_tokens():
    import asyncio

    import httpx

    def delta(text, finish=None):
        return _sse({"choices": [{"index": 0, "finish_reason": finish, "delta": {"role": "assistant",
                                                                               "content": text}}], "usage": None})

    last = delta(" you", "length")
    reads = [delta("*") + delta("6"), last[:7], last[7:] + _sse({"choices": [], "usage": {
        "prompt_tokens": 26, "completion_tokens": 3, "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 20}}}) + b"data: [DONE]\n\n"]

    async def body():
        for r in reads:
            yield r

    def handler(request):
        sent = json.loads(request.content)
        assert request.url.path == "/v1/chat/completions" and sent["stream"] and sent["ignore_eos"]
        assert sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0
        return httpx.Response(200, content=body())

    async def run(h, path, b):
        async with httpx.AsyncClient(transport=httpx.MockTransport(h), base_url="http://x") as c:
            return await pcw.stream_openai(c, path, b)

    reply = asyncio.run(run(handler, pcw.CHAT_PATH, pcw.chat_body([{"role": "user", "content": "hi"}], 3)))
    assert reply.ok and reply.text == "*6 you" and reply.finish_reason == "length"
    assert (reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens) == (26, 20, 3)
    assert reply.sent_s <= reply.first_s <= reply.done_s and reply.ttft_s >= 0

    refused = asyncio.run(run(lambda r: httpx.Response(400, text="bad max_tokens"), pcw.COMPLETIONS_PATH,
                              pcw.completion_body("hi", 1)))
    assert not refused.ok and refused.status == 400 and "bad max_tokens" in refused.error

    def failing(request):
        return httpx.Response(200, content=_sse({"error": {"message": "worker died", "code": 500}})
                              + b"data: [DONE]\n\n")

    failed = asyncio.run(run(failing, pcw.COMPLETIONS_PATH, pcw.completion_body("hi", 1)))
    assert not failed.ok and failed.error == "worker died" and failed.ttft_s is None


def test_completion_text_and_no_cached_tokens_reported():
    reply = pcw.Reply(1.0)
    pcw.parse_event(reply, {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}, 1.5)
    pcw.parse_event(reply, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, 2.0)
    pcw.parse_event(reply, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, 2.0)
    assert reply.ok and reply.text == "ab" and reply.ttft_s == 0.5 and reply.cached_tokens is None


def _reply(sent, ttft, text="x", prompt=100, cached=0, out=4, finish="length", status=200, error=None):
    return pcw.Reply(sent, sent + ttft, sent + ttft + 0.1, text, prompt, cached, out, finish, status, error)


def test_arm_row_by_hand():
    convs = [[_reply(0.0, 0.2, cached=0), _reply(1.0, 0.05, cached=90), _reply(2.0, 0.03, cached=95)],
             [_reply(0.0, 0.4, cached=50), _reply(1.0, 0.07, cached=80, finish="error")]]
    grown = MetricsPage({(pcw.CACHE_HIT_TOKENS, ()): 300.0, (pcw.CACHE_COMPUTED_TOKENS, ()): 100.0,
                         (pcw.CACHE_EVICTED_TOKENS, ()): 7.0})
    after = MetricsPage({(pcw.CACHE_TOKENS, ()): 900.0, (pcw.CACHE_HIT_RATE, ()): 0.5})
    run = pcw.ArmRun("on", 0, convs, 4.0, pcw.cache_counters(grown), pcw.cache_gauges(after))
    row = pcw.arm_row("on", [run])
    assert (row["requests"], row["failed"], row["output_tokens"], row["output_tok_s"]) == (5, 1, 16, 4.0)
    assert row["finish_reasons"] == {"error": 1, "length": 4} and row["http_statuses"] == {"200": 5}
    assert row["ttft_turn1_ms_p50"] == pytest.approx(300.0) and row["ttft_later_ms_p50"] == pytest.approx(40.0)
    assert row["ttft_later_ms_median"] == pytest.approx(40.0)
    assert row["usage_hit_rate"] == pytest.approx(235 / 400) and row["usage_hit_rate_later"] == pytest.approx(185 / 200)
    assert row["metrics_hit_rate"] == 0.75 and row["metrics_evicted_tokens"] == 7.0
    assert row["metrics_cache_tokens_after"] == 900.0
    two = pcw.arm_row("on", [run, pcw.ArmRun("on", 1, convs, 4.0, run.counters, run.gauges)])
    assert two["output_tok_s"] == 4.0 and two["requests"] == 10 and two["metrics_hit_tokens"] == 600.0
    off = pcw.arm_row("off", [pcw.ArmRun("off", 0, convs, 8.0, pcw.cache_counters(None), pcw.cache_gauges(None))])
    assert off["metrics_hit_rate"] is None and off["metrics_evicted_tokens"] is None
    assert json.loads(json.dumps(row)) == row
    with pytest.raises(ValueError):
        pcw.arm_row("x", [])


def test_ratios_done_means_and_the_workload_entry():
    on = [[_reply(0.0, 0.1), _reply(1.0, 0.02)]]
    off = [[_reply(0.0, 0.1), _reply(1.0, 0.1, text="y")]]
    runs = [pcw.ArmRun("on", 0, on, 1.0), pcw.ArmRun("off", 0, off, 2.0)]
    entry = pcw.workload_entry(runs, ["on", "off"])
    assert set(entry["arms"]) == {"on", "off"} and [r["arm"] for r in entry["rows"]] == ["on r0", "off r0"]
    assert entry["ratios"]["ttft_later_ms_p50_on_over_off"] == pytest.approx(0.2)
    assert entry["ratios"]["output_tok_s_on_over_off"] == pytest.approx(2.0)
    assert entry["ratios_by_round"]["0"] == entry["ratios"]
    assert pcw.chat_done(entry["ratios"]) == {"ttft_later_p50_le_25pct_of_off": True, "tok_s_ge_1_5x_off": True}
    assert pcw.chat_done(pcw.on_off_ratios(entry["arms"]["on"], None)) == {
        "ttft_later_p50_le_25pct_of_off": None, "tok_s_ge_1_5x_off": None}
    assert pcw.resend_done(entry["arms"]["on"]) == {"resend_ttft_median_le_15ms": False}  # 20 ms
    diff = pcw.output_differences(on, off)
    assert diff == {"compared": 2, "different": 1, "missing": 0}
    assert pcw.output_differences(on, [[off[0][0]]]) == {"compared": 1, "different": 0, "missing": 1}
    done = pcw.pressure_done(entry["arms"], [diff])
    assert done == {"all_requests_ok": True, "outputs_identical": False, "evictions_gt_0": None}
    for table in pcw.WORKLOAD_TABLES.values():
        assert len(render_table(list(entry["arms"].values()), table).splitlines()) == 4
    assert json.loads(json.dumps(entry)) == entry
