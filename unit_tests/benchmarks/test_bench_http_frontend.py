"""The pure parts of benchmarks/bench_http_frontend.py: percentiles, the fake worker's steps and
driver loop (in a thread, over queue.Queue), the per-request joins of the summary, the report.
No server, no timing."""
import argparse
import importlib.util
import json
import os
import queue
import threading

import numpy as np
import pytest

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.manager import AbortReq, AddReq, WorkerReady, WorkerStats

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_http_frontend",
                                               os.path.join(REPO, "benchmarks", "bench_http_frontend.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _add(req_id, max_new, seed=None, prompt_len=5):
    return AddReq(req_id, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new, seed=seed), [0], 0.0)


def test_cli_defaults():
    args = bench.parse_args([])
    assert args.out == os.path.join("docs", "data", "perf", "http_frontend.json")
    assert (args.step_ms, args.tokens_per_step, args.concurrency, args.num_requests, args.max_new_tokens) == (
        2.7, 1, 64, 1024, 200)
    assert args.arms == "generate,stream" and args.profile == "none" and args._serve is None
    assert 1 <= args.client_procs <= 4
    with pytest.raises(SystemExit):
        bench.parse_args(["--profile", "chat"])


@pytest.mark.parametrize("xs", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.default_rng(0).random(101))])
def test_percentile_is_numpys_linear(xs):
    for q in (0, 25, 50, 90, 99, 100):
        assert bench.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentiles_name_scale_and_empty():
    assert bench.percentiles("lat_ms", [0.001, 0.003], scale=1e3) == {"lat_ms_p50": pytest.approx(2.0),
                                                                       "lat_ms_p99": pytest.approx(2.98)}
    assert bench.percentiles("x", [], (50, 100)) == {"x_p50": None, "x_p100": None}


def test_itl_samples_share_a_gap_among_a_chunks_tokens():
    assert bench.itl_samples([(0.0, 1)]) == []
    assert bench.itl_samples([(0.0, 1), (0.003, 1), (0.009, 3)]) == pytest.approx([0.003, 0.002, 0.002, 0.002])


def test_engine_prefill_gives_one_token_then_tokens_per_step_up_to_max_new():
    eng = bench.FakeEngine(tokens_per_step=3, token_ids=[7, 8, 9, 10], running_max_req_size=8)
    eng.add(_add(1, max_new=6, seed=11), now=100.0)
    assert eng.has_work and eng.counts() == (0, 1)
    assert eng.admit() == 1 and eng.counts() == (1, 0)
    steps = [eng.step() for _ in range(3)]
    ups = [s.updates[0] for s in steps]
    assert [u.token_ids for u in ups] == [[7], [8, 9, 10], [7, 8]]  # ids cycle; the last step is cut at max_new
    assert [u.accept_len for u in ups] == [0, 3, 2]
    assert [u.finish_reason for u in ups] == [None, None, "length"]
    assert [u.mtp_accepted_token_num for u in ups] == [0, 2, 3]
    assert [(s.batch_reqs, s.prefilled, s.decoded) for s in steps] == [(1, 1, 0), (1, 0, 1), (1, 0, 1)]
    assert not eng.has_work
    assert all(u.prompt_tokens == 5 and u.logprobs == [-0.25] * len(u.token_ids) for u in ups)


def test_engine_admits_up_to_the_cap_and_aborts_waiting_or_running():
    eng = bench.FakeEngine(1, [1], running_max_req_size=2)
    for i in range(4):
        eng.add(_add(i, max_new=10), now=float(i))
    assert eng.admit() == 2 and eng.counts() == (2, 2)
    assert eng.kv_used() == 10
    eng.step()
    assert eng.kv_used() == 12
    (u,) = eng.abort(0)  # running
    assert u.finish_reason == "abort" and u.token_ids == [] and eng.counts() == (1, 2)
    (u,) = eng.abort(3)  # waiting
    assert u.req_id == 3 and eng.counts() == (1, 1)
    assert eng.abort(3) == [] and eng.abort(99) == []
    assert eng.admit() == 1 and sorted(eng.running) == [1, 2]
    assert eng.records[0]["finish_reason"] == "abort"


def test_mark_sent_records_first_and_last_update():
    eng = bench.FakeEngine(1, [5], running_max_req_size=4)
    eng.add(_add(1, max_new=2, seed=0), now=1.0)
    eng.admit()
    eng.mark_sent([], 1.5, 0)  # a gauge-only message
    eng.mark_sent(eng.step().updates, 2.0, 1)
    eng.mark_sent(eng.step().updates, 3.0, 2)
    rec = eng.records[1]
    assert (rec["seed"], rec["arrival"], rec["first_put"], rec["first_msg"], rec["last_put"], rec["last_msg"]) == (
        0, 1.0, 2.0, 1, 3.0, 2)
    assert rec["tokens"] == 2 and rec["finish_reason"] == "length"


def test_step_timing_files_mixed_and_decode_steps_as_the_router():
    eng = bench.FakeEngine(1, [5], running_max_req_size=4)
    eng.add(_add(1, max_new=5), 0.0)
    eng.admit()
    eng.step()
    eng.add(_add(2, max_new=5), 0.0)
    eng.admit()
    mixed = bench.step_timing(0.003, eng.step())  # 1 decoded beside 1 prefilled
    decode = bench.step_timing(0.002, eng.step())
    assert (mixed.mixed_steps, mixed.mixed_decode_reqs, mixed.decode_steps, mixed.batch_reqs) == (1, 1, 0, 2)
    assert (decode.decode_steps, decode.decode_batch_reqs, decode.mixed_steps) == (1, 2, 0)
    assert decode.decode_by_batch[2].steps == 1
    total = bench.StepTiming()
    bench.merge_timing(total, mixed)
    bench.merge_timing(total, decode)
    bench.merge_timing(total, decode)
    assert total.steps == 3 and total.seconds == pytest.approx(0.007) and total.decode_by_batch[2].reqs == 4


def test_window_running_means():
    steps = [[0.5, 0.01, 9], [1.0, 0.003, 4], [1.01, 0.003, 6], [3.0, 0.01, 99]]
    got = bench.window_running(steps, 1.0, 2.0)
    assert got["worker_steps"] == 2 and got["worker_mean_running"] == 5.0
    assert got["worker_step_ms"] == pytest.approx(3.0)
    assert got["worker_time_mean_running"] == pytest.approx((0.003 * 4 + 0.003 * 6) / 1.0)
    assert got["worker_busy_share"] == pytest.approx(0.006)
    assert bench.window_running(steps, 5.0, 6.0)["worker_mean_running"] is None


def test_fake_worker_loop_serves_requests_and_writes_its_records(tmp_path):
    path = str(tmp_path / "worker.json")
    cfg = bench.WorkerConfig(step_ms=1.0, tokens_per_step=2, token_ids=[3, 4, 5], running_max_req_size=64,
                             record_path=path)
    in_q, out_q = queue.Queue(), queue.Queue()
    th = threading.Thread(target=bench.fake_worker_main, args=(cfg, in_q, [out_q], False), daemon=True)
    th.start()
    assert isinstance(out_q.get(timeout=10), WorkerReady)
    in_q.put(_add(1, max_new=5, seed=0))
    in_q.put(_add(2, max_new=3, seed=1))
    got = {1: [], 2: []}
    finished = set()
    gauges = 0
    while len(finished) < 2:
        updates, stats = out_q.get(timeout=10)
        assert isinstance(stats, WorkerStats)
        gauges += not updates
        for u in updates:
            got[u.req_id] += u.token_ids
            if u.finish_reason:
                finished.add(u.req_id)
    assert got == {1: [3, 4, 5, 3, 4], 2: [3, 4, 5]}
    assert gauges >= 1  # the counts before the first step
    in_q.put(_add(3, max_new=50, seed=2))
    in_q.put(AbortReq(3))
    in_q.put(None)
    th.join(10)
    assert not th.is_alive()
    with open(path) as f:
        rec = json.load(f)
    reqs = {r["req_id"]: r for r in rec["reqs"]}
    assert reqs[1]["tokens"] == 5 and reqs[2]["finish_reason"] == "length"
    assert reqs[1]["arrival"] <= reqs[1]["first_put"] <= reqs[1]["last_put"]
    assert len(rec["steps"]) >= 3 and all(s[1] >= 0.0009 for s in rec["steps"])  # steps last step_ms
    assert len(rec["messages"]) > len(rec["steps"]) and rec["messages"][0][1] == 0  # gauges first, then updates


def _fixture_run():
    """Two requests through the three clocks, 1 s apart, and what the summary must find."""
    args = argparse.Namespace(concurrency=2, tokens_per_step=1, step_ms=2.0, max_new_tokens=2)
    client = [{"i": 0, "sent": 10.0, "done": 10.10, "tokens": 2, "chunks": [(10.05, 1), (10.09, 1)]},
              {"i": 1, "sent": 10.02, "done": 10.20, "tokens": 2, "chunks": [(10.12, 1), (10.19, 1)]}]
    worker = {"reqs": [{"seed": 0, "arrival": 10.01, "first_put": 10.02, "first_msg": 0, "last_put": 10.04,
                        "last_msg": 1},
                       {"seed": 1, "arrival": 10.05, "first_put": 10.06, "first_msg": 2, "last_put": 10.08,
                        "last_msg": 3},
                       {"seed": bench.WARMUP_SEED_BASE, "arrival": 1.0, "first_put": 1.1, "first_msg": None,
                        "last_put": None, "last_msg": None}],
              "messages": [[10.02, 1], [10.04, 1], [10.06, 2], [10.08, 1]],
              "steps": [[10.018, 0.002, 1], [10.038, 0.002, 2], [10.058, 0.002, 2], [10.078, 0.002, 1]]}
    probe = {"puts": {"0": 10.005, "1": 10.03}, "gets": [10.021, 10.041, 10.061, 10.081],
             "dispatches": [[10.022, 0.0001], [10.043, 0.0001], [10.063, 0.0001], [10.084, 0.0001]],
             "lag": [[10.05, 0.001], [10.15, 0.003], [11.0, 9.0]], "threads": {}}
    return args, client, worker, probe


def test_summarize_joins_the_three_clocks_per_request():
    args, client, worker, probe = _fixture_run()
    cpu = {"http": 0.5, "worker": 0.1, "client": 0.2, "http_threads": {"MainThread": 0.4}}
    row = bench.summarize("stream", args, client, worker, probe, cpu)
    assert row["output_tokens"] == 4 and row["wall_s"] == pytest.approx(0.2)
    assert row["output_tok_s"] == pytest.approx(20.0) and row["ideal_tok_s"] == pytest.approx(1000.0)
    assert row["achieved_over_ideal"] == pytest.approx(0.02)
    assert row["worker_mean_running"] == pytest.approx(1.5)
    # intake: 10 and 30 ms; http 5 and 10; in_q 5 and 20
    assert row["intake_ms_p50"] == pytest.approx(20.0) and row["intake_http_ms_p50"] == pytest.approx(7.5)
    assert row["intake_in_q_ms_p50"] == pytest.approx(12.5) and row["admit_ms_p50"] == pytest.approx(10.0)
    # egress of request 0: last put 10.04 (message 1), get 10.041, dispatch 10.043, done 10.10
    assert row["egress_ms_p50"] == pytest.approx((60 + 120) / 2)
    assert row["egress_out_q_ms_p50"] == pytest.approx(1.0)
    assert row["egress_handover_ms_p50"] == pytest.approx((2 + 3) / 2)
    assert row["egress_loop_to_client_ms_p50"] == pytest.approx((57 + 116) / 2)
    assert row["ttft_ms_p50"] == pytest.approx(75.0) and row["first_egress_ms_p50"] == pytest.approx(45.0)
    assert row["itl_ms_p50"] == pytest.approx(55.0) and row["ideal_itl_ms"] == 2.0
    assert row["loop_lag_ms_p100"] == pytest.approx(3.0)  # the lag outside the window is left out
    assert row["worker_messages_per_s"] == pytest.approx(20.0) and row["updates_per_message"] == pytest.approx(1.25)
    assert row["http_cpu_us_per_token"] == pytest.approx(1e6 * 0.5 * 0.2 / 4)
    assert row["tokens_per_chunk"] == 1.0


def test_send_stamps_count_tokens_as_the_client_and_give_the_servers_gaps():
    def event(tokens):
        return b"data: " + json.dumps({"choices": [{"index": 0, "text": "x", "logprobs": {"tokens": tokens}}]}).encode()

    parts = [(1.0, event(["a"]) + b"\n\n"), (1.5, b": keep-alive\n\n"), (2.0, event(["b", "c"]) + b"\n\n"),
             (2.2, event(["d"]) + b"\n\n" + event(["e"]) + b"\n\n"), (2.3, b"data: [DONE]\n\n")]
    chunks = bench.sent_chunks(parts)
    assert chunks == [(1.0, 1), (2.0, 2), (2.2, 2)]  # parts without tokens are left out
    assert bench.itl_samples(chunks) == pytest.approx([0.5, 0.5, 0.1, 0.1])
    args, client, worker, probe = _fixture_run()
    probe["send_chunks"] = [chunks, [(5.0, 1), (5.004, 1), (5.006, 1)]]
    row = bench.summarize("stream", args, client, worker, probe, None)
    # samples 500, 500, 100, 100, 4, 2 ms: sorted, the middle two are 100 and 100
    assert row["server_itl_ms_p50"] == pytest.approx(100.0)
    assert row["server_itl_p99_over_p50"] == pytest.approx(row["server_itl_ms_p99"] / 100.0)
    assert row["itl_p99_over_p50"] == pytest.approx(row["itl_ms_p99"] / row["itl_ms_p50"])


def test_report_renders(capsys):
    args, client, worker, probe = _fixture_run()
    probe["profile"] = {"clock": "thread cpu", "by_thread_tottime_s": {"MainThread": 1.0}, "total_tottime_s": 1.0,
                        "top": [{"function": "x.py:1(f)", "calls": 3, "tottime_s": 0.5, "cumtime_s": 0.7}]}
    cpu = {"http": 0.5, "worker": 0.1, "client": 0.2, "http_threads": {"MainThread": 0.4, "worker-reader": 0.1}}
    rows = [bench.summarize("generate", args, client, worker, probe, cpu)]
    rows[0]["profiled"] = True
    bench.print_report(rows)
    out = capsys.readouterr().out
    assert "generate (profiled)" in out and "MainThread 0.40" in out and "x.py:1(f)" in out


def test_cpu_cores_by_thread_name():
    a = {"wall": 0.0, "http": 1.0, "worker": 0.0, "client": 0.0, "threads": {1: 0.5, 2: 0.0, 3: 0.0}}
    b = {"wall": 2.0, "http": 2.0, "worker": 0.5, "client": 1.0, "threads": {1: 1.5, 2: 0.2, 3: 0.2, 4: 0.1}}
    got = bench.CpuClock.cores(a, b, {1: "MainThread", 2: "tokenize (pool)", 3: "tokenize (pool)"})
    assert got["http"] == 0.5 and got["worker"] == 0.25 and got["client"] == 0.5
    assert got["http_threads"] == {"MainThread": 0.5, "tokenize (pool)": pytest.approx(0.2),
                                   "other (not a Python thread)": pytest.approx(0.05)}
    assert bench.thread_group("tokenize_3") == "tokenize (pool)" and bench.thread_group("worker-reader") == "worker-reader"


def test_long_prompts_are_spread_evenly_and_hold_about_the_tokens_asked(tmp_path):
    """--long_fraction: that share of the requests, one every 1 / fraction, gets a prompt of about --long_tokens
    tokens, each a different text; 0 leaves the GSM8K prompts as they were."""
    assert [i for i in range(20) if bench.is_long(i, 0.25)] == [3, 7, 11, 15, 19]
    assert not any(bench.is_long(i, 0.0) for i in range(50)) and all(bench.is_long(i, 1.0) for i in range(50))
    from transformers import AutoTokenizer

    from lightllm.utils.embedded_model import get_default_model_dir

    model_dir = get_default_model_dir()
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": f"Question {i}: how many apples are {i} plus {i}?",
                                        "answer": f"{2 * i}\n#### {2 * i}"}) + "\n" for i in range(40)))
    plain = bench.build_workload(model_dir, 10, 16, str(data))
    mixed = bench.build_workload(model_dir, 10, 16, str(data), long_fraction=0.2, long_tokens=400)
    tok = AutoTokenizer.from_pretrained(model_dir)
    lens = [len(tok.encode(p)) for p in mixed.prompts]
    longs = [i for i in range(10) if bench.is_long(i, 0.2)]
    assert longs == [4, 9]
    assert all(400 <= lens[i] < 480 for i in longs) and len({mixed.prompts[i] for i in longs}) == 2
    assert [p for i, p in enumerate(mixed.prompts) if i not in longs] == [p for i, p in enumerate(plain.prompts)
                                                                          if i not in longs]
    assert mixed.max_req_total_len >= max(lens) + 16 + 1
