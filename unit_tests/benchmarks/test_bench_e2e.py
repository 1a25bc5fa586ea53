"""The pure parts of benchmarks/bench_e2e_throughput.py: config parsing, summaries, the table, the matrix rows."""
import importlib.util
import json
import os

import pytest
from transformers import AutoTokenizer

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
