"""benchmarks/bench_asd_budgets.py: round orders and the paired ratios by hand; one real CPU run."""
import argparse
import importlib.util
import json
import math
import os

import pytest

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.server.metrics import ServerMetrics
from lightllm.server.router.manager import StepTiming, WorkerStats
from lightllm.tools.report import render_table
from lightllm.utils.server_launcher import MetricsPage
from unit_tests.data_paths import require_gsm8k

_spec = importlib.util.spec_from_file_location(
    "bench_asd_budgets", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_asd_budgets.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
Wave = bench.Wave


def test_round_orders_rotate():
    assert bench.round_orders([0.0, 2.0, 8.0], 4) == [
        [0.0, 2.0, 8.0], [2.0, 8.0, 0.0], [8.0, 0.0, 2.0], [0.0, 2.0, 8.0]]


def test_parse_budgets():
    assert bench.parse_budgets("0,2.0625, 8") == [0.0, 2.0625, 8.0]
    for bad, msg in (("2,8", "include 0"), ("0,-1", ">= 0"), ("0,2,2", "distinct"), ("0,x", "numbers")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            bench.parse_budgets(bad)


def _wave(rnd, budget, wall_s, tokens, steps, relaxed=0, engine_s=1.0, batch_steps=1, batch_reqs=1, ids=None,
          by_batch=()):
    """Half of the engine's steps (and their time and requests) are decode steps; ``by_batch``:
    (batch size, decode steps, ms per step) of the decode clock by batch size."""
    return Wave(rnd, budget, wall_s, tokens, steps, relaxed, engine_s, batch_steps, batch_reqs, ids,
                engine_s / 2, batch_steps // 2, batch_reqs // 2,
                [[b, n * ms / 1000, n, n * b] for b, n, ms in by_batch])


def test_summarize_pairs_each_wave_with_its_rounds_b0():
    waves = [
        # round 0: B = 0 at 100 tok/s (engine 125), B = 2 at 120 (engine 150): ratios 1.2, 1.2
        _wave(0, 0.0, 10.0, 1000, 500, 0, 8.0, 100, 2000), _wave(0, 2.0, 10.0, 1200, 500, 30, 8.0, 80, 2000),
        # round 1, a slower minute: B = 0 at 50 (engine 100), B = 2 at 55 (engine 110): 1.1, 1.1
        _wave(1, 2.0, 20.0, 1100, 440, 20, 10.0, 80, 2000), _wave(1, 0.0, 20.0, 1000, 500, 0, 10.0, 100, 2000),
        # round 2: B = 0 at 100 (engine 125), B = 2 at 130 (engine 130): 1.3, 1.04
        _wave(2, 0.0, 10.0, 1000, 500, 0, 8.0, 100, 2000), _wave(2, 2.0, 10.0, 1300, 520, 40, 10.0, 80, 2600),
    ]
    b0, b2 = bench.summarize(waves, [0.0, 2.0])
    assert b0.speedup_vs_b0 == 1.0 and b0.tokens_per_step == pytest.approx(2.0) and b0.tokens_per_step_gain == 0.0
    assert b0.engine_speedup_vs_b0 == 1.0
    assert b2.round_ratios == pytest.approx([1.2, 1.1, 1.3]) and b2.speedup_vs_b0 == pytest.approx(1.2)
    assert b2.engine_round_ratios == pytest.approx([1.2, 1.1, 1.04]) and b2.engine_speedup_vs_b0 == pytest.approx(1.1)
    assert (b2.median_tok_s, b2.min_tok_s, b2.max_tok_s) == pytest.approx((120.0, 55.0, 130.0))
    assert b2.tokens_per_step == pytest.approx(3600 / 1460)  # pooled over the waves
    assert b2.tokens_per_step_gain == pytest.approx(3600 / 1460 / 2.0 - 1)
    assert b2.mean_batch == pytest.approx(6600 / 240) and b2.ms_per_batch_step == pytest.approx(1000 * 28 / 240)
    # output tokens per batch step: 3600 / 240 = 15 against 3000 / 300 = 10
    assert b0.step_cost_speedup_vs_b0 == 1.0 and b2.step_cost_speedup_vs_b0 == pytest.approx(1.5)
    # decode steps: ms per step B / B = 0 by round: 100 / 80, 125 / 100, 125 / 80 -> median 1.25
    assert b2.ms_per_decode_step == pytest.approx(1000 * 14 / 120) and b2.mean_decode_batch == pytest.approx(3300 / 120)
    assert b0.decode_step_vs_b0 == 1.0 and b2.decode_step_vs_b0 == pytest.approx(1.25)
    table = render_table([b0, b2], bench.TABLE, markdown=True)
    assert ("| 2 | 3 | 2.466 | +23.3% | 120.0 | 55.0 | 130.0 | 1.200x | 1.200, 1.100, 1.300 | "
            "1.100x | 1.200, 1.100, 1.040 | 27.5 | 116.67 | 116.67 | 27.5 | - | - | - | 1.250x | 1.500x | - |") in table
    with pytest.raises(ValueError, match="B = 0"):
        bench.summarize([_wave(0, 2.0, 1.0, 1, 1)], [2.0])


def test_decode_batch_before_the_drain_pools_over_waves():
    """Steps and decoded requests until each wave's last request was sent, pooled over B's waves; NaN when no
    wave measured them (saved before the field)."""
    b0 = [_wave(r, 0.0, 10.0, 1000, 500) for r in (0, 1)]
    b2 = [_wave(0, 2.0, 10.0, 1000, 500), _wave(1, 2.0, 10.0, 1000, 500)]
    b2[0].steady_decoding_steps, b2[0].steady_decoding_reqs = 100, 6000  # 60 a step
    b2[1].steady_decoding_steps, b2[1].steady_decoding_reqs = 300, 18600  # 62 a step
    row0, row2 = bench.summarize(b0 + b2, [0.0, 2.0])
    assert math.isnan(row0.mean_decode_batch_steady)
    assert row2.mean_decode_batch_steady == pytest.approx(24600 / 400)
    assert "| 61.5 |" in render_table([row2], bench.TABLE, markdown=True)


def test_steady_window_counts_the_requests_done_before_the_last_send():
    """A closed loop of two: requests 0 and 1 sent at 10.0; 0 done at 10.5, so 2 is sent; 1 done at 11.0, so 3 (the
    last) is sent at 11.0; 2 and 3 finish after it. The window is 10.0 -> 11.0 (from the wave's t0 = 9.5: 1.5 s) and
    holds the tokens of 0 and 1 (a request done at the send itself counts)."""
    timed = [bench.Timed({"count_output_tokens": n}, latency, sent_s=sent)
             for n, sent, latency in ((30, 10.0, 0.5), (40, 10.0, 1.0), (50, 10.5, 2.0), (60, 11.0, 0.7))]
    assert bench.steady_window(timed, 9.5) == (70, pytest.approx(1.5))


def test_speedup_before_the_drain_pairs_rounds():
    """Round 0: B = 0 at 1000 tokens / 10 s, B = 2 at 1100 / 10 -> 1.1; round 1: 900 / 10 against 1080 / 10 -> 1.2;
    median 1.15. A wave without the window (saved before it) gives no ratio."""
    b0 = [_wave(r, 0.0, 12.0, 1100, 500) for r in (0, 1, 2)]
    b2 = [_wave(r, 2.0, 12.0, 1200, 450) for r in (0, 1, 2)]
    for w, (tokens, secs) in zip(b0 + b2, ((1000, 10.0), (900, 10.0), (0, 0.0), (1100, 10.0), (1080, 10.0), (0, 0.0))):
        w.steady_output_tokens, w.steady_s = tokens, secs
    row0, row2 = bench.summarize(b0 + b2, [0.0, 2.0])
    assert row0.speedup_vs_b0_steady == 1.0 and row0.steady_round_ratios == [1.0, 1.0]
    assert row2.steady_round_ratios == pytest.approx([1.1, 1.2]) and row2.speedup_vs_b0_steady == pytest.approx(1.15)
    assert "| 1.150x | 1.100, 1.200 |" in render_table([row2], bench.TABLE, markdown=True)
    (old,) = bench.summarize([_wave(0, 0.0, 1.0, 10, 5)], [0.0])
    assert math.isnan(old.speedup_vs_b0_steady) and old.steady_round_ratios == []


def test_warm_waves_send_every_budget_at_full_concurrency():
    """Two warm rounds over budgets 0 and 2 at concurrency 3: four waves of the first 4 * 3 = 12 prompts, each
    body at its wave's budget; with fewer prompts than that, all of them."""
    prompts = [f"q{i}" for i in range(20)]
    waves = bench.warm_waves(prompts, [0.0, 2.0], 2, 3, 7)
    assert [len(w) for w in waves] == [12] * 4
    assert [w[0]["parameters"]["asd_regret_budget"] for w in waves] == [0.0, 2.0, 0.0, 2.0]
    assert [b["inputs"] for b in waves[1]] == prompts[:12]
    assert all(b["parameters"]["max_new_tokens"] == 7 for w in waves for b in w)
    assert [len(w) for w in bench.warm_waves(prompts[:5], [0.0], 1, 3, 7)] == [5]
    assert bench.warm_waves(prompts, [0.0, 2.0], 0, 3, 7) == []


def test_latency_split_pools_over_requests():
    """Client latency, the server's e2e and what lies outside it, per request over both waves:
    (2.0 + 1.0) s over 30 requests = 100 ms; server (1.5 + 0.6) / 30 = 70 ms; outside 30 ms."""
    waves = [_wave(0, 0.0, 1.0, 10, 5), _wave(1, 0.0, 1.0, 10, 5)]
    for w, (client, e2e, queue, ttft, n) in zip(waves, ((2.0, 1.5, 0.03, 0.3, 20), (1.0, 0.6, 0.0, 0.15, 10))):
        w.client_latency_s, w.server_e2e_s, w.server_queue_s, w.server_ttft_s, w.requests = client, e2e, queue, ttft, n
    (row,) = bench.summarize(waves, [0.0])
    assert (row.client_latency_ms, row.server_e2e_ms, row.outside_server_ms) == pytest.approx((100.0, 70.0, 30.0))
    assert (row.server_queue_ms, row.server_ttft_ms) == pytest.approx((1.0, 15.0))
    (old,) = bench.summarize([_wave(0, 0.0, 1.0, 10, 5)], [0.0])  # a run saved before the split: no numbers
    assert math.isnan(old.client_latency_ms) and math.isnan(old.outside_server_ms)


def test_equal_batch_step_ratio_by_hand():
    """Per round: B's mean decode step over B = 0's at each batch size both hit, weighted by B = 0's
    steps there; median over rounds."""
    waves = [
        # round 0. B = 0: 10 steps at 32 (4 ms), 30 at 48 (5 ms), 5 at 64 (6 ms). B = 2: 4 at 32 (4.4 ms),
        # 20 at 48 (5 ms), 3 at 16: sizes 32 and 48 shared, (10 * 1.1 + 30 * 1.0) / 40 = 1.025; 40 of 45 covered
        _wave(0, 0.0, 1.0, 100, 50, by_batch=[(32, 10, 4.0), (48, 30, 5.0), (64, 5, 6.0)]),
        _wave(0, 2.0, 1.0, 100, 50, by_batch=[(16, 3, 3.0), (32, 4, 4.4), (48, 20, 5.0)]),
        # round 1: at 48 only, 5.5 ms against 5 ms: 1.1; 10 of 10 covered
        _wave(1, 2.0, 1.0, 100, 50, by_batch=[(48, 10, 5.5)]), _wave(1, 0.0, 1.0, 100, 50, by_batch=[(48, 10, 5.0)]),
        # round 2: no batch size in common: no ratio; 0 of 10 covered
        _wave(2, 0.0, 1.0, 100, 50, by_batch=[(48, 10, 5.0)]), _wave(2, 2.0, 1.0, 100, 50, by_batch=[(64, 10, 6.0)]),
    ]
    assert bench.equal_batch_step_ratio(waves[1], waves[0]) == (pytest.approx(1.025), 40)
    assert bench.equal_batch_step_ratio(waves[5], waves[4]) == (None, 0)
    b0, b2 = bench.summarize(waves, [0.0, 2.0])
    assert b0.step_ratio_equal_batch == 1.0 and b0.step_ratio_equal_batch_rounds == [1.0, 1.0, 1.0]
    assert b0.equal_batch_coverage == 1.0
    assert b2.step_ratio_equal_batch_rounds == pytest.approx([1.025, 1.1])
    assert b2.step_ratio_equal_batch == pytest.approx(1.0625)  # median of the two rounds with a ratio
    assert b2.equal_batch_coverage == pytest.approx(50 / 65)
    rows = bench.by_batch_rows(waves, [0.0, 2.0])
    assert [(r["batch"], r["steps_0"], r["steps_2"]) for r in rows] == [
        (16, 0, 3), (32, 10, 4), (48, 50, 30), (64, 5, 10)]
    assert rows[0]["ms_0"] is None and rows[2]["ms_2"] == pytest.approx((20 * 5.0 + 10 * 5.5) / 30)
    table = render_table([b0, b2], bench.TABLE, markdown=True)
    assert "weights: B = 0's steps" in table and "| 1.062x | 1.025, 1.100 | 76.9% |" in table
    by_batch = render_table(rows, bench.by_batch_table([0.0, 2.0]), markdown=True)
    assert "| 16 | 0 | - | 3 | 3.00 |" in by_batch


def test_decode_clock_by_batch_from_the_servers_metrics():
    """The router's clock by batch size, through ServerMetrics and /metrics deltas, read back."""
    m = ServerMetrics()
    timing = StepTiming()
    timing.add(0.5, 10, decode=True, decoded_reqs=6)  # no ladder (CPU): filed at 6
    timing.add(0.25, 10, decode=True, decoded_reqs=6)
    m.observe_worker(WorkerStats(0, 10, 0, timing))
    before = MetricsPage.parse(m.render().decode())
    timing = StepTiming()
    ladder = GraphLadder((1, 2, 4, 8))
    timing.add(1.0, 10, decode=True, decoded_reqs=5, ladder=ladder)  # filed at 8
    timing.add(0.125, 12, decode=True, decoded_reqs=6)
    timing.add(2.0, 12, decode=False)  # a prefill step: not a decode step
    m.observe_worker(WorkerStats(0, 10, 0, timing))
    after = MetricsPage.parse(m.render().decode())
    assert bench.decode_clock_by_batch(before) == [[6, 0.75, 2, 12]]
    assert bench.decode_clock_by_batch(after - before) == [[6, 0.125, 1, 6], [8, 1.0, 1, 5]]
    assert bench.decode_clock_by_batch(MetricsPage({})) == []


def test_b0_rounds_identical():
    same = [_wave(0, 0.0, 1, 1, 1, ids=[[1, 2]]), _wave(1, 0.0, 1, 1, 1, ids=[[1, 2]]), _wave(1, 2.0, 1, 1, 1)]
    assert bench.b0_rounds_identical(same)
    assert not bench.b0_rounds_identical(same + [_wave(2, 0.0, 1, 1, 1, ids=[[1, 3]])])


def test_parse_arms():
    assert bench.parse_arms(None) == [("", [])]
    assert bench.parse_arms(["w0=--router_max_wait_tokens 0", "w4= --router_max_wait_tokens 4 --x 'a b'"]) == [
        ("w0", ["--router_max_wait_tokens", "0"]), ("w4", ["--router_max_wait_tokens", "4", "--x", "a b"])]
    assert bench.parse_arms(["plain="]) == [("plain", [])]
    for bad, msg in ((["--flag"], "NAME=FLAGS"), (["=--x"], "NAME=FLAGS"), (["a=", "a=--x"], "differ")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            bench.parse_arms(bad)


def test_summarize_arms_pairs_each_arm_with_the_first_by_round():
    """Arm b against arm a at each budget in the same round; each arm's own ASD speed-up and how much of the
    tokens/step gain (+10%) it turns into tok/s."""
    def wave(arm, rnd, budget, wall_s, mixed=0):
        tokens, steps = (1000, 500) if budget == 0.0 else (1100, 500)
        w = _wave(rnd, budget, wall_s, tokens, steps)
        w.arm, w.mixed_steps = arm, mixed
        # before the drain: B = 2 at 1.05x B = 0 in every round, so half the +10% tokens/step gain
        w.steady_output_tokens, w.steady_s = (800 if budget == 0.0 else 840), wall_s / 2
        return w

    waves = [  # a: 100 / 110 tok/s, then 50 / 55; b: 125 / 137.5, then 100 / 110
        wave("a", 0, 0.0, 10.0), wave("a", 0, 2.0, 10.0), wave("b", 0, 0.0, 8.0, 10), wave("b", 0, 2.0, 8.0, 10),
        wave("b", 1, 2.0, 10.0, 20), wave("b", 1, 0.0, 10.0, 20), wave("a", 1, 2.0, 20.0), wave("a", 1, 0.0, 20.0),
    ]
    a0, a2, b0, b2 = bench.summarize_arms(waves, [0.0, 2.0], ["a", "b"])
    assert (a0.arm, a0.budget, a0.vs_first_arm, a0.round_ratios) == ("a", 0.0, 1.0, [1.0, 1.0])
    assert b0.round_ratios == pytest.approx([1.25, 2.0]) and b0.vs_first_arm == pytest.approx(1.625)
    assert b2.round_ratios == pytest.approx([1.25, 2.0]) and b2.engine_vs_first_arm == 1.0
    for row in (a2, b2):
        assert row.speedup_vs_b0 == pytest.approx(1.1) and row.tokens_per_step_gain == pytest.approx(0.1)
        assert row.gain_ratio == pytest.approx(1.0) and row.gain_ratio_steady == pytest.approx(0.5)
    assert math.isnan(a0.gain_ratio)  # B = 0 gains no tokens per step
    assert b0.mixed_steps_per_wave == 15 and a0.mixed_steps_per_wave == 0
    assert b2.median_tok_s == pytest.approx((137.5 + 110) / 2)
    table = render_table([a0, a2, b0, b2], bench.ARMS_TABLE, markdown=True)
    assert "| b | 0 | 112.5 | 1.625x | 1.250, 2.000 | 1.000x | 1.000x | +0.0% | - | 15 |" in table


@pytest.mark.slow
def test_real_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--data", require_gsm8k("test"), "--num_questions", "3", "--max_new_tokens", "12",
                     "--mtp_step", "2", "--budgets", "0,8", "--rounds", "2", "--concurrency", "3", "--out", str(out)])
    assert rc == 0
    res = json.load(open(out))
    assert res["b0_rounds_identical"] is True and res["rounds_done"] == 2
    rows = {r["budget"]: r for r in res["rows"]}
    assert rows[0.0]["waves"] == rows[8.0]["waves"] == 2 and rows[0.0]["speedup_vs_b0"] == 1.0
    waves = res["waves"]
    assert [w["budget"] for w in waves] == [0.0, 8.0, 8.0, 0.0]  # rotated in round 1
    assert all(w["output_tokens"] <= 3 * 12 and w["relaxed_tokens"] == 0 for w in waves if w["budget"] == 0.0)
    # the engine's clock: at least one batch step per committed token step of the longest request
    assert all(0 < w["engine_s"] <= w["wall_s"] and w["batch_steps"] >= 1 for w in waves)
    assert all(w["batch_reqs"] <= 3 * w["batch_steps"] for w in waves)
    # the decode clock by batch size (exact counts on CPU) covers every decode step
    assert all(sum(n for _, _, n, _ in w["decode_by_batch"]) == w["decode_steps"] for w in waves)
    # the /metrics snapshot at the last request's send: part of the wave's decoding steps (all three are sent at once)
    assert all(0 <= w["steady_decoding_steps"] <= w["decode_steps"] + w["mixed_steps"] for w in waves)
    assert all(w["steady_decoding_reqs"] <= 3 * w["steady_decoding_steps"] for w in waves)
    # the window before the drain: from the wave's start to the last send (its requests all started at once here)
    assert all(0 < w["steady_s"] < w["wall_s"] and w["steady_output_tokens"] <= w["output_tokens"] for w in waves)
    assert all(1 <= b <= 3 for w in waves for b, _, _, _ in w["decode_by_batch"])
    assert rows[0.0]["step_ratio_equal_batch"] == 1.0 and rows[8.0]["step_ratio_equal_batch"] > 0
    # every request's latency: the client's covers the server's receipt-to-last-output
    assert all(w["requests"] == 3 and w["client_latency_s"] >= w["server_e2e_s"] > 0 for w in waves)
    assert all(0 <= w["server_queue_s"] and 0 < w["server_ttft_s"] <= w["server_e2e_s"] for w in waves)
    assert all(r["outside_server_ms"] >= 0 for r in rows.values())
    assert "step_ratio_equal_batch" in res["definitions"] and res["decode_by_batch"]
    capsys.readouterr()  # the run's own table
    assert bench.main(["--from_json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("\n| 0 | 2 | ") == 1 and table.count("\n| 8 | 2 | ") == 1
