"""The pure parts of benchmarks/bench_e2e_throughput.py: config parsing, summaries, the table, the matrix rows."""
import importlib.util
import json
import os

import pytest
from transformers import AutoTokenizer

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.tools.prompts import chat_prompt_texts
from lightllm.tools.report import render_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_e2e_throughput",
                                               os.path.join(REPO, "benchmarks", "bench_e2e_throughput.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MTP = "--mtp_mode eagle_with_att --mtp_step 3"


def test_parse_configs_default_is_one_engine_with_the_shared_args():
    assert bench.parse_configs(None, "--running_max_req_size 8") == [
        bench.ServerConfig("engine", ("--running_max_req_size", "8"))]
    assert bench.parse_configs("  ") == [bench.ServerConfig("engine", ())]


def test_parse_configs_names_args_and_shared_first():
    got = bench.parse_configs(f"plain=; mtp_k3={MTP};", "--max_req_total_len 1024")
    assert [c.name for c in got] == ["plain", "mtp_k3"]
    assert got[0].args == ("--max_req_total_len", "1024")
    assert got[1].args == ("--max_req_total_len", "1024", "--mtp_mode", "eagle_with_att", "--mtp_step", "3")
    # '=' inside the args and shell quoting survive
    quoted = bench.parse_configs("a=--mtp_draft_model_dir '/p with space/d=1'")
    assert quoted[0].args == ("--mtp_draft_model_dir", "/p with space/d=1")


@pytest.mark.parametrize("spec, message", [
    ("plain", "not NAME=ARGS"),
    ("=--mtp_step 3", "empty name"),
    ("a=;a=--mtp_step 3", "duplicate name 'a'"),
    ("transformers=", "taken by the baseline"),
    (";;", "no config"),
])
def test_parse_configs_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_configs(spec)


def _res(latency, out, accepted=0, ttft=None, text="t"):
    return bench.RequestResult(latency_s=latency, output_tokens=out, prompt_tokens=10, text=text,
                               mtp_accepted_token_num=accepted, ttft_s=ttft)


def test_summarize_throughput_latency_and_tokens_per_step():
    row = bench.summarize("mtp", [_res(1.0, 16, 8, 0.1), _res(2.0, 16, 8, 0.3), _res(3.0, 16, 8)], wall_s=4.0)
    assert row["requests_per_s"] == 0.75 and row["output_tokens_per_s"] == 12.0
    assert row["latency_p50_s"] == 2.0 and row["latency_p90_s"] == pytest.approx(2.8)
    assert row["tokens_per_step"] == 2.0  # 48 tokens from 24 steps
    assert row["ttft_mean_s"] == pytest.approx(0.2)  # requests without a TTFT are left out
    plain = bench.summarize("plain", [_res(1.0, 4)], wall_s=1.0)
    assert plain["tokens_per_step"] == 1.0 and plain["ttft_mean_s"] is None
    with pytest.raises(ValueError):
        bench.summarize("x", [], 1.0)


def test_ratios_to_the_baseline_and_the_first_config():
    rows = [{"name": "plain", "output_tokens_per_s": 200.0}, {"name": "mtp", "output_tokens_per_s": 500.0}]
    hf = {"name": "transformers", "output_tokens_per_s": 100.0}
    bench.add_ratios_to_baseline_and_first(rows + [hf], hf)
    assert [r["vs_transformers"] for r in rows + [hf]] == [2.0, 5.0, 1.0]
    assert [r["vs_first"] for r in rows + [hf]] == [1.0, 2.5, 0.5]


def test_default_table_renders_a_full_summary_row():
    row = bench.summarize("plain", [_res(1.0, 16), _res(2.0, 16)], wall_s=2.0)
    bench.add_ratios_to_baseline_and_first([row], row)
    lines = render_table([row], bench.TABLE_COLUMNS).splitlines()
    assert len(lines) == 3 and lines[2].startswith("plain") and "16.0" in lines[2]


def test_gsm8k_prompts_are_the_chat_endpoints(tmp_path):
    gsm = tmp_path / "test.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(3)))
    args = bench.parse_args(["--gsm8k", str(gsm), "--num_prompts", "5"])
    texts = bench.build_prompts(args, bench.model_dir_or_embedded(None))
    assert len(texts) == 5 and texts[3] == texts[0] and "q2" in texts[2]
    assert texts[:3] == chat_prompt_texts(AutoTokenizer.from_pretrained(bench.model_dir_or_embedded(None)),
                                          ["q0", "q1", "q2"])


def test_model_and_dtype_come_from_the_server_parser(tmp_path):
    same = bench.parse_configs(f"plain=;mtp={MTP}", f"--model_dir {tmp_path}")
    assert bench.resolve_model_and_dtype(same, "cuda") == (str(tmp_path), "bfloat16")
    assert bench.resolve_model_and_dtype(same, "cpu") == (str(tmp_path), "float32")
    mixed = bench.parse_configs("a=--data_type float16;b=", f"--model_dir {tmp_path}")
    with pytest.raises(ValueError, match="different models/dtypes"):
        bench.resolve_model_and_dtype(mixed, "cuda")


def test_cli_defaults():
    args = bench.parse_args([])
    assert (args.num_prompts, args.max_new_tokens, args.concurrency, args.hf_batch_size) == (64, 128, 64, 64)
    assert args.warmup_requests == 64 and not args.ignore_eos


def test_matrix_rows_pool_waves_and_ratios_by_hand():
    from benchmarks.bench_e2e_throughput import Wave, add_matrix_ratios, matrix_row

    # two engine waves: 256 tokens in 1 s + 256 in 3 s -> 128 tok/s; 40 steps in 0.2 s -> 5 ms
    eng = [Wave(256, 1.0, 20, 0.1, 100, 240), Wave(256, 3.0, 20, 0.1, 100, 260)]
    hf = [Wave(256, 4.0), Wave(256, 4.0)]  # 64 tok/s
    plain = matrix_row("m", "plain", 2, eng, hf, "abc")
    assert plain["engine_tok_s"] == 128.0 and plain["hf_tok_s"] == 64.0
    assert plain["step_ms"] == 5.0 and plain["tokens_per_step"] == 2.5
    mtp = matrix_row("m", "mtp3", 2, [Wave(512, 2.0, 10, 0.05, 50, 150)], [], "abc")  # 256 tok/s
    assert mtp["hf_tok_s"] is None
    add_matrix_ratios([plain, mtp])
    assert (plain["vs_hf"], plain["vs_plain"]) == (2.0, 1.0)
    assert (mtp["vs_hf"], mtp["vs_plain"]) == (4.0, 2.0)


def test_long_context_flags_and_default_out():
    args = bench.parse_args(["--long_context"])
    assert args.long_context and args.out == os.path.join("docs", "data", "perf", "long_context.json")
    assert args.long_lens == [512, 2048, 6000] and args.wave_lens == [6000, 150]
    assert args.long_models == ["embedded", "llama3_8b_dummy"] and args.max_new_tokens == 128
    assert bench.parse_args([]).out == "bench_e2e_throughput.json"
    short = bench.parse_args(["--long_context", "--long_models", "embedded", "--long_lens", "64", "128",
                              "--wave_lens", "256", "32", "--out", "lc.json"])
    assert (short.long_models, short.long_lens, short.wave_lens, short.out) == (["embedded"], [64, 128], [256, 32],
                                                                                "lc.json")


@pytest.mark.parametrize("argv", [["--long_context", "--matrix"], ["--long_context", "--long_lens", "0"],
                                  ["--long_context", "--wave_lens", "6000"]])
def test_long_context_bad_flags(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bench.model_dir_or_embedded(None))


QUESTIONS = ["Natalia sold clips to 48 of her friends in April.", "Weng earns $12 an hour for babysitting.",
             "Betty is saving money for a new wallet which costs $100."]


def test_chat_template_ends_are_the_chat_prompt_around_the_user_text(tokenizer):
    from lightllm.tools.prompts import chat_prompt_ids

    head, tail = bench.chat_template_ends(tokenizer)
    assert head + tail == chat_prompt_ids(tokenizer, [""])[0]
    assert tokenizer.decode(head).endswith("user\n") and tokenizer.decode(tail).startswith("<|im_end|>")


@pytest.mark.parametrize("n", [150, 512, 2048, 6000])
def test_exact_length_prompts(tokenizer, n):
    head, tail = bench.chat_template_ends(tokenizer)
    ids = bench.exact_length_prompt(tokenizer, n, QUESTIONS)
    assert len(ids) == n and ids[:len(head)] == head and ids[-len(tail):] == tail
    body = tokenizer.decode(ids[len(head):-len(tail)])
    assert body.startswith(QUESTIONS[0]) and QUESTIONS[2] in body  # the texts, cycled
    other = bench.exact_length_prompt(tokenizer, n, QUESTIONS, start=1, ends=(head, tail))
    assert len(other) == n and other != ids  # a prompt per start: no two timed prompts alike


def test_exact_length_prompt_too_short_for_the_template(tokenizer):
    head, tail = bench.chat_template_ends(tokenizer)
    with pytest.raises(ValueError, match="cannot hold the chat template"):
        bench.exact_length_prompt(tokenizer, len(head) + len(tail), QUESTIONS)
    assert len(bench.exact_length_prompt(tokenizer, len(head) + len(tail) + 1, QUESTIONS)) == len(head) + len(tail) + 1


def test_usable_prompt_len_leaves_room_for_new_tokens():
    assert bench.usable_prompt_len(6000, 8192, 128) == 6000
    assert bench.usable_prompt_len(6000, 2048, 128) == 1920
    assert bench.usable_prompt_len(6000, None, 128) == 6000


def test_long_context_json_and_tables():
    args = bench.parse_args(["--long_context"])
    result = bench.long_context_result({"embedded": {6000: 30.0, 512: 10.0}, "llama3_8b_dummy": {2048: 60.0}},
                                       {"embedded": {6000: 45.0, 512: 36.0}}, 3000.0, 8000.0, "abc1234", {"k": 1})
    assert set(result) == {"ttft_ms", "hf_prefill_ms", "c16_long_tok_s", "c16_short_tok_s", "commit", "meta"}
    assert result["ttft_ms"] == {"embedded": {"512": 10.0, "6000": 30.0}, "llama3_8b_dummy": {"2048": 60.0}}
    assert result["hf_prefill_ms"] == {"embedded": {"512": 36.0, "6000": 45.0}}
    assert json.loads(json.dumps(result)) == result
    rows = bench.ttft_rows(result)
    assert [(r["model"], r["prompt_tokens"], r["hf_over_engine"]) for r in rows] == [
        ("embedded", 512, 3.6), ("embedded", 6000, 1.5), ("llama3_8b_dummy", 2048, None)]
    assert len(render_table(rows, bench.LONG_TABLE).splitlines()) == 5
    waves = bench.wave_rows(result, args)
    assert [(w["wave"], w["tok_s"]) for w in waves] == [("16 x 6000 tokens", 3000.0), ("16 x 150 tokens", 8000.0)]
    assert "8000.0" in render_table(waves, bench.WAVE_TABLE)


# --serving: flags, the workload, the ITL accounting by hand, the SSE parsing (no server)
def test_serving_flags_and_defaults():
    args = bench.parse_args(["--serving"])
    assert (args.num_prompts, args.concurrency, args.max_new_tokens, args.serving_long_new_tokens) == (512, 64, 256, 64)
    assert args.serving_modes == ["plain", "mtp", "asd_usage"] and args.serving_long_lens == [2000, 4000]
    assert args.serving_long_fraction == 0.2 and args.out == os.path.join("docs", "data", "perf", "serving.json")
    assert not args.ignore_eos and args.warmup_requests == 64
    smoke = bench.parse_args(["--serving", "--num_prompts", "8", "--concurrency", "4", "--serving_long_lens", "200",
                              "300", "--max_new_tokens", "8"])
    assert (smoke.num_prompts, smoke.serving_long_lens, smoke.serving_long_new_tokens) == (8, [200, 300], 8)
    assert bench.parse_args(["--serving", "--serving_long_new_tokens", "32"]).serving_long_new_tokens == 32


@pytest.mark.parametrize("argv", [["--serving", "--matrix"], ["--serving", "--long_context"],
                                  ["--serving", "--serving_long_lens", "300", "200"],
                                  ["--serving", "--serving_long_fraction", "1.5"], ["--serving", "--client_procs", "0"],
                                  ["--serving", "--serving_modes", "nope"]])
def test_serving_bad_flags(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_serving_modes_are_server_flags():
    from lightllm.server.api_cli import make_argument_parser

    assert bench.serving_mode_flags("plain") == []
    assert bench.serving_mode_flags("mtp") == ["--mtp_mode", "eagle_with_att", "--mtp_step", "3"]
    usage = bench.serving_mode_flags("asd_usage")
    assert usage[:4] == ["--mtp_mode", "eagle_with_att", "--mtp_step", "3"] and "2.0625" in usage
    assert bench.serving_mode_flags("plain_no_overlap") == ["--disable_overlap_schedule"]
    parser = make_argument_parser()
    ns = parser.parse_args(usage)
    assert (ns.mtp_asd_regret_budget, ns.mtp_asd_local_regret_ratio, ns.mtp_asd_block_max_mismatch) == (2.0625, 0.25, 2)
    assert parser.parse_args(bench.serving_mode_flags("plain_no_overlap")).disable_overlap_schedule
    # the small-chunk arm's budget wins over the benchmark's base flags (the last occurrence of a flag)
    small = parser.parse_args(["--batch_max_tokens", "4096"] + bench.serving_mode_flags("mtp_chunk512"))
    assert (small.batch_max_tokens, small.mtp_step) == (512, 3)
    assert parser.parse_args(bench.serving_mode_flags("mtp_chunk4096")).batch_max_tokens == 4096
    eager = parser.parse_args(bench.serving_mode_flags("asd_usage_wait0"))
    assert (eager.router_max_wait_tokens, eager.mtp_asd_regret_budget) == (0, 2.0625)
    assert parser.parse_args(usage).router_max_wait_tokens == StartArgs.router_max_wait_tokens  # the engine's default


def _server_count(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=True))


@pytest.mark.parametrize("n", [40, 150, 333])
def test_exact_length_prompt_text_is_counted_as_the_server_does(tokenizer, n):
    text, count = bench.exact_length_prompt_text(tokenizer, n, QUESTIONS, start=1)
    assert count == _server_count(tokenizer, text) and n - 1 <= count <= n
    head = chat_prompt_texts(tokenizer, [""])[0].partition("<|im_start|>user\n")[0]
    assert text.startswith(head + "<|im_start|>user\nWeng earns") and text.endswith("<|im_start|>assistant\n")
    assert (QUESTIONS[2] in text) == (n > 100)  # the texts from start, one after the other
    with pytest.raises(ValueError, match="cannot hold the chat template"):
        bench.exact_length_prompt_text(tokenizer, 10, QUESTIONS)


def test_serving_workload_mix_lengths_and_seed(tokenizer):
    def build(seed, n=50):
        return bench.build_serving_workload(tokenizer, QUESTIONS, n, 0.2, (120, 200), 256, 64, seed)

    work = build(0)
    longs = [r for r in work if r.kind == bench.LONG]
    shorts = [r for r in work if r.kind == bench.SHORT]
    assert len(work) == 50 and len(longs) == 10 and len(shorts) == 40  # round(50 * 0.2)
    assert all(119 <= r.prompt_tokens <= 200 and r.max_new_tokens == 64 for r in longs)  # a cut may swing by 1
    assert len({r.prompt_tokens for r in longs}) > 1 and len({r.text for r in longs}) == 10
    assert [r.text for r in shorts] == chat_prompt_texts(tokenizer, [QUESTIONS[i % 3] for i in range(40)])
    assert all(r.max_new_tokens == 256 for r in shorts)
    assert all(r.prompt_tokens == _server_count(tokenizer, r.text) for r in work)
    assert build(0) == work  # deterministic
    assert [r.kind for r in build(1)] != [r.kind for r in work]  # another seed: another order
    assert [i for i, r in enumerate(work) if r.kind == bench.LONG] != list(range(10))  # interleaved
    assert [r.kind for r in build(0, 8)].count(bench.LONG) == 2  # round(1.6)
    assert all(r.kind == bench.SHORT for r in bench.build_serving_workload(tokenizer, QUESTIONS, 5, 0.0, (120, 200),
                                                                           8, 8))
    with pytest.raises(ValueError):
        bench.build_serving_workload(tokenizer, QUESTIONS, 5, 0.2, (200, 120), 8, 8)


def test_merge_windows_and_overlap():
    starts, ends = bench.merge_windows([(3.0, 4.0), (0.5, 2.0), (0.0, 1.0), (3.5, 3.6)])
    assert (starts, ends) == ([0.0, 3.0], [2.0, 4.0])
    assert bench.overlaps_any(1.9, 2.5, starts, ends) and bench.overlaps_any(2.5, 3.1, starts, ends)
    assert bench.overlaps_any(-1.0, 5.0, starts, ends) and bench.overlaps_any(3.2, 3.3, starts, ends)
    # touching is not overlapping: a gap that ends as a window starts, or starts as it ends
    assert not bench.overlaps_any(2.0, 3.0, starts, ends) and not bench.overlaps_any(-1.0, 0.0, starts, ends)
    assert not bench.overlaps_any(4.0, 5.0, starts, ends) and not bench.overlaps_any(1.0, 2.0, [], [])


def _trace(sent, chunks, done=None):
    return bench.StreamTrace(sent, chunks, chunks[-1][0] if done is None else done, 10, sum(n for _, n in chunks),
                             "length")


def _synthetic_run():
    """Two long requests waiting for their first token during [0, 1] and [2, 2.5] s; three short ones."""
    req = {k: bench.ServingRequest(k, k, 10, 8) for k in (bench.SHORT, bench.LONG)}
    requests = [req[bench.LONG], req[bench.SHORT], req[bench.LONG], req[bench.SHORT], req[bench.SHORT]]
    traces = [
        _trace(0.0, [(1.0, 1), (1.1, 1)]),  # long: TTFT 1000 ms, one gap of 100 ms
        # short A, gaps and samples (ms, tagged):
        #   0.2-0.3, 1 token: 100 T | 0.3-0.6, 3 tokens: 3 x 100 T | 0.6-1.2, 2 tokens: 2 x 300 T (overlaps [0, 1])
        #   1.2-1.5: 300 | 1.5-1.9, 2 tokens: 2 x 200 | 1.9-2.1: 200 T (overlaps [2, 2.5])
        _trace(0.0, [(0.2, 1), (0.3, 1), (0.6, 3), (1.2, 2), (1.5, 1), (1.9, 2), (2.1, 1)]),
        _trace(2.0, [(2.5, 1)]),  # long: TTFT 500 ms, no gap
        _trace(1.1, [(1.3, 2), (1.4, 1)]),  # short B: 2 tokens in its first chunk (no sample), then 100
        # short C: 1.8-2.0 ends as [2, 2.5] starts: 200 | 2.0-2.5 inside: 500 T | 2.5-2.6 starts as it ends: 100
        _trace(1.6, [(1.8, 1), (2.0, 1), (2.5, 1), (2.6, 1)]),
    ]
    return requests, traces


def test_itl_samples_divide_a_chunks_gap_over_its_tokens():
    requests, traces = _synthetic_run()
    starts, ends = bench.merge_windows(bench.long_prefill_windows(requests, traces))
    assert (starts, ends) == ([0.0, 2.0], [1.0, 2.5])
    got = bench.itl_samples(traces[1], starts, ends)
    assert [round(ms, 6) for ms, _ in got] == [100, 100, 100, 100, 300, 300, 300, 200, 200, 200]
    assert [t for _, t in got] == [True] * 6 + [False] * 3 + [True]
    assert [(round(ms, 6), t) for ms, t in bench.itl_samples(traces[3], starts, ends)] == [(100, False)]
    assert [(round(ms, 6), t) for ms, t in bench.itl_samples(traces[4], starts, ends)] == [
        (200, False), (500, True), (100, False)]
    assert bench.itl_samples(traces[2]) == [] and traces[2].ttft_s == 0.5


def test_serving_row_by_hand():
    from lightllm.tools.client import DECODE_CLOCK, ENGINE_CLOCK
    from lightllm.utils.server_launcher import MetricsPage

    requests, traces = _synthetic_run()
    # engine: 30 batch steps in 3 s over 600 requests, 25 of them decode steps in 2 s over 550
    grown = MetricsPage({(name, ()): v for name, v in zip(ENGINE_CLOCK + DECODE_CLOCK, (3.0, 30, 600, 2.0, 25, 550))})
    # the router's ITL: 40 updates within 2 ms, 50 in (2, 4], 10 in (4, 10]
    for le, n in (("0.002", 40), ("0.004", 90), ("0.01", 100), ("+Inf", 100)):
        grown.samples[(bench.ROUTER_ITL + "_bucket", (("le", le),))] = n
    # the updates' delivery: 150 messages within 1 ms, 40 in (1, 5], 10 in (5, 10]
    for le, n in (("0.001", 150), ("0.005", 190), ("0.01", 200), ("+Inf", 200)):
        grown.samples[(bench.UPDATE_DELIVERY + "_bucket", (("le", le),))] = n
    row = bench.serving_row("plain", requests, traces, grown, http_cpu_s=[1.0, 0.3])
    approx = pytest.approx
    assert (row["requests"], row["short_requests"], row["long_requests"]) == (5, 3, 2)
    assert row["output_tokens"] == 21 and row["wall_s"] == approx(2.6) and row["output_tok_s"] == approx(21 / 2.6)
    # TTFT ms: 1000, 200, 500, 200, 200
    assert (row["ttft_ms_p50"], row["ttft_ms_p99"]) == approx((200, 980))
    assert (row["ttft_short_ms_p50"], row["ttft_short_ms_p99"]) == approx((200, 200))
    assert (row["ttft_long_ms_p50"], row["ttft_long_ms_p99"]) == approx((750, 995))
    # short ITL, 14 samples: 100 x 6, 200 x 4, 300 x 3, 500 -> p50 200, p99 300 + 0.87 * 200
    assert row["itl_short_samples"] == 14 and (row["itl_short_ms_p50"], row["itl_short_ms_p99"]) == approx((200, 474))
    # short requests' chunk gaps, one sample each: A 100 300 600 300 400 200, B 100, C 200 500 100 -> sorted
    # 100 100 100 200 200 300 300 400 500 600: p50 250, p99 500 + 0.91 * 100
    assert (row["chunk_gap_short_ms_p50"], row["chunk_gap_short_ms_p99"]) == approx((250, 591))
    assert row["chunk_gap_short_p99_over_p50"] == approx(591 / 250)
    assert bench.chunk_gaps_ms(traces[2]) == [] and bench.chunk_gaps_ms(traces[3]) == approx([100])
    # during long prefill, 8 samples: 100 x 4, 200, 300 x 2, 500 -> p50 150, p99 300 + 0.93 * 200
    assert row["itl_short_during_long_prefill_samples"] == 8
    assert (row["itl_short_during_long_prefill_ms_p50"], row["itl_short_during_long_prefill_ms_p99"]) == approx(
        (150, 486))
    assert row["itl_short_during_long_prefill_p99_over_p50"] == approx(486 / 150)
    # every request, 15 samples (the long one's 100 too): p50 200, p99 300 + 0.86 * 200
    assert (row["itl_ms_p50"], row["itl_ms_p99"]) == approx((200, 472))
    assert row["long_prefill_time_share"] == approx(1.5 / 2.6) and row["stream_token_mismatches"] == 0
    assert row["finish_reasons"] == {"length": 5}
    assert (row["mean_decode_batch"], row["decode_step_ms"], row["decode_steps"]) == approx((22, 80, 25))
    assert (row["prefill_steps"], row["prefill_step_ms"], row["mean_batch"]) == approx((5, 200, 20))
    # rank 50 is the 10th of 50 in (2, 4] ms: 2.4; rank 99 the 9th of 10 in (4, 10]: 4 + 0.9 * 6
    assert (row["itl_router_ms_p50"], row["itl_router_ms_p99"]) == approx((2.4, 9.4))
    assert row["itl_router_p99_over_p50"] == approx(9.4 / 2.4) and row["http_cpu_share"] == approx(1.3 / 2.6)
    assert row["http_cpu_share_by_process"] == approx([1.0 / 2.6, 0.3 / 2.6])
    # rank 100 is the 100th of 150 in (0, 1] ms: 0.667; rank 198 the 8th of 10 in (5, 10]: 5 + 0.8 * 5
    assert (row["update_delivery_ms_p50"], row["update_delivery_ms_p99"]) == approx((100 / 150, 9.0))
    bare = bench.serving_row("mtp", requests, traces)
    assert bare["mean_decode_batch"] is None and bare["itl_short_ms_p50"] == row["itl_short_ms_p50"]
    assert bare["itl_router_ms_p99"] is None and bare["http_cpu_share"] is None
    faster = dict(bare, output_tok_s=2 * row["output_tok_s"], mean_decode_batch=11.0)
    rows = bench.add_serving_ratios([row, faster])
    assert rows[0]["output_tok_s_vs_first"] == 1.0 and rows[1]["output_tok_s_vs_first"] == approx(2.0)
    assert rows[1]["mean_decode_batch_vs_first"] == approx(0.5) and rows[1]["ttft_ms_p99_vs_first"] == approx(1.0)
    lines = render_table(rows, bench.SERVING_TABLE).splitlines()
    assert len(lines) == 4 and lines[2].startswith("plain") and "474.00" in lines[2] and "486.00" in lines[2]
    assert json.loads(json.dumps(rows)) == rows
    with pytest.raises(ValueError):
        bench.serving_row("x", requests[:2], traces)


def test_streamed_completion_chunks_are_network_reads():
    """The SSE events of one read are one chunk (their tokens summed); an event split over reads
    counts when it is whole; the usage event gives the counts."""
    import asyncio

    import httpx

    from lightllm.tools import client as cl

    def event(obj):
        return ("data: " + json.dumps(obj) + "\n\n").encode()

    def tokens(n, finish=None, **extra):
        return event({"choices": [{"index": 0, "text": "x" * n, "finish_reason": finish,
                                   "logprobs": {"tokens": ["x"] * n}}], **extra})

    last = tokens(2, "length", mtp_accepted_token_num=3)
    reads = [tokens(1), tokens(3) + last[:10], last[10:] + event({"choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}}) + b"data: [DONE]\n\n"]

    async def body():
        for r in reads:
            yield r

    def handler(request):
        sent = json.loads(request.content)
        assert request.url.path == "/v1/completions" and sent["stream"] and sent["logprobs"] == 0
        assert sent["max_tokens"] == 6 and sent["temperature"] == 0 and sent["ignore_eos"] is False
        return httpx.Response(200, content=body())

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as c:
            return await cl._streamed(c, cl.completion_stream_body("hi", 6))

    trace = asyncio.run(run())
    assert [n for _, n in trace.chunks] == [1, 3, 2]
    assert (trace.prompt_tokens, trace.output_tokens, trace.finish_reason, trace.mtp_accepted_token_num) == (
        7, 6, "length", 3)
    assert trace.sent_s <= trace.chunks[0][0] <= trace.chunks[-1][0] <= trace.done_s
