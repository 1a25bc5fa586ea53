"""The CPU parts of benchmarks/bench_attention.py: arguments, the FLOP / byte formulas, the rows and
the slot table it builds, the result rows and table. No timing."""
import importlib.util
import os

import pytest
import torch

from lightllm.tools.report import render_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_attention",
                                               os.path.join(REPO, "benchmarks", "bench_attention.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LLAMA_8B = bench.HEAD_SHAPES["8b"]
EMBEDDED = bench.HEAD_SHAPES["embedded"]


def test_cli_defaults_and_choices():
    args = bench.parse_args([])
    assert args.out == os.path.join("docs", "data", "perf", "attention.json")
    assert args.cases == ["prefill", "decode", "mtp_rows", "chunk"] and args.shapes == ["8b", "embedded"]
    assert not (args.quick or args.deterministic or args.no_graphs)
    quick = bench.parse_args(["--quick", "--cases", "decode", "--shapes", "8b", "--out", "x.json"])
    assert quick.quick and quick.cases == ["decode"] and quick.shapes == ["8b"] and quick.out == "x.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--cases", "verify"])


def test_head_shapes_are_the_8b_and_the_embedded_model():
    assert (LLAMA_8B.q_heads, LLAMA_8B.kv_heads, LLAMA_8B.head_dim) == (32, 8, 128)
    assert (EMBEDDED.q_heads, EMBEDDED.kv_heads, EMBEDDED.head_dim) == (9, 3, 64)


def test_attended_pairs_causal():
    assert bench.attended_pairs(1, 1) == 1
    assert bench.attended_pairs(3, 3) == 1 + 2 + 3
    assert bench.attended_pairs(8192, 8192) == 8192 * 8193 // 2
    assert bench.attended_pairs(1, 8192) == 8192  # a decode row sees every position
    assert bench.attended_pairs(4, 1024) == 1021 + 1022 + 1023 + 1024  # MTP rows L-3..L


def test_prefill_flops_by_hand():
    # 4 * 32 heads * 128 dims * 8192 * 8193 / 2 pairs
    assert bench.attention_flops(bench.Case("prefill", LLAMA_8B, 1, 8192, 8192)) == 549_822_922_752
    assert bench.attention_flops(bench.Case("prefill", EMBEDDED, 1, 512, 512)) == 4 * 9 * 64 * 131_328
    assert bench.tflops(549_822_922_752, 2.0) == pytest.approx(274.911461376)


def test_kv_bytes_and_bandwidths_by_hand():
    # 16 requests * 8192 positions * 8 heads * 128 dims * (K, V) * 2 bytes = 512 MiB
    assert bench.kv_bytes(bench.Case("decode", LLAMA_8B, 16, 1, 8192)) == 512 * 2 ** 20
    assert bench.kv_bytes(bench.Case("decode", LLAMA_8B, 1, 1, 8192)) == 32 * 2 ** 20
    # the MTP rows read each request's KV once, as one decode row does
    assert bench.kv_bytes(bench.Case("mtp_rows", EMBEDDED, 64, 4, 1024)) == 64 * 1024 * 3 * 64 * 2 * 2
    assert bench.gb_s(10 ** 9, 1.0) == 1000.0  # 1 GB in 1 ms
    assert bench.copy_gb_s(2 ** 30, 1.0) == pytest.approx(2 * 2 ** 30 / 1e6)  # read + write


def test_case_rows_and_shape_label():
    case = bench.Case("mtp_rows", LLAMA_8B, 64, 4, 1024)
    assert case.rows == 256 and case.shape == "32q/8kv x128 b64 q4 kv1024"


def test_cases_full_and_quick():
    full = bench.build_cases(bench.CASE_KINDS, ["8b", "embedded"], quick=False)
    got = [(c.kind, c.heads.name, c.batch, c.q_len, c.kv_len) for c in full if c.heads.name == "8b"]
    assert got == [("prefill", "8b", 1, 8192, 8192), ("prefill", "8b", 1, 2048, 2048), ("prefill", "8b", 1, 512, 512),
                   ("decode", "8b", 1, 1, 8192), ("decode", "8b", 16, 1, 8192), ("decode", "8b", 64, 1, 1024),
                   ("mtp_rows", "8b", 64, 4, 1024), ("chunk", "8b", 1, 512, 3072), ("chunk", "8b", 1, 2048, 4096)]
    assert len(full) == 2 * len(got)
    quick = bench.build_cases(["prefill", "decode"], ["embedded"], quick=True)
    assert [(c.kind, c.q_len, c.kv_len) for c in quick] == [
        ("prefill", 512, 512), ("decode", 1, 1024), ("decode", 1, 1024), ("decode", 1, 1024)]
    # the MTP ratio's 1-row case comes with the MTP case alone
    assert [(c.kind, c.batch, c.q_len) for c in bench.build_cases(["mtp_rows"], ["8b"], False)] == [
        ("decode", 64, 1), ("mtp_rows", 64, 4)]


def test_row_layout_is_request_major_and_causal():
    req, seq = bench.row_layout(2, 4, 10)
    assert req.dtype == torch.int64 and seq.dtype == torch.int32
    assert req.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert seq.tolist() == [7, 8, 9, 10, 7, 8, 9, 10]
    req, seq = bench.row_layout(1, 5, 5)  # prefill
    assert req.tolist() == [0] * 5 and seq.tolist() == [1, 2, 3, 4, 5]
    req, seq = bench.row_layout(3, 1, 8)  # decode
    assert req.tolist() == [0, 1, 2] and seq.tolist() == [8, 8, 8]


def test_slot_table_is_a_random_permutation_wider_than_the_requests():
    table = bench.slot_table(4, 100, torch.Generator().manual_seed(0))
    assert table.shape == (4, 100 + bench.SLOT_TABLE_PAD) and table.dtype == torch.int64
    used = table[:, :100]
    assert sorted(used.flatten().tolist()) == list(range(400))
    assert not torch.equal(used.flatten(), torch.arange(400))  # not contiguous
    assert torch.all(table[:, 100:] == 0)
    ordered = bench.slot_table(4, 100, torch.Generator().manual_seed(0), order="contiguous")
    assert torch.equal(ordered[:, :100], torch.arange(400).view(4, 100)) and torch.all(ordered[:, 100:] == 0)
    with pytest.raises(ValueError, match="slot order"):
        bench.slot_table(4, 100, torch.Generator(), order="sorted")


def test_inputs_hold_the_same_values_for_the_engine_and_sdpa():
    case = bench.Case("mtp_rows", EMBEDDED, 3, 4, 10)
    x = bench.make_inputs(case, torch.Generator().manual_seed(0))
    assert x.q.shape == (12, 9, 64) and x.q.dtype == torch.bfloat16 and x.q.is_contiguous()
    assert x.k_cache.shape == (30, 3, 64) and x.k4.shape == (3, 3, 10, 64) and x.k4.is_contiguous()
    for b in range(case.batch):
        for pos in range(case.kv_len):
            slot = x.req_to_token[b, pos]
            assert torch.equal(x.k4[b, :, pos], x.k_cache[slot]) and torch.equal(x.v4[b, :, pos], x.v_cache[slot])
        for i in range(case.q_len):  # row b * q_len + i is SDPA's query i of request b
            assert torch.equal(x.q[b * case.q_len + i], x.q4[b, :, i])
    assert x.row_seq_len.tolist() == [7, 8, 9, 10] * 3


def _row(case, engine_ms, sdpa_ms, copy_bw=4000.0):
    return bench.result_row(case, engine_ms, sdpa_ms, plan_ms=0.05, max_abs_diff=0.01, copy_bw=copy_bw,
                            commit="abc1234", timing="do_bench", sdpa_gqa="enable_gqa")


def test_prefill_row_by_hand():
    row = _row(bench.Case("prefill", LLAMA_8B, 1, 8192, 8192), 2.0, 1.5)
    assert row["case"] == "prefill" and row["shape"] == "32q/8kv x128 b1 q8192 kv8192"
    assert row["tflops"] == pytest.approx(274.911461376) and row["sdpa_tflops"] == pytest.approx(366.548615168)
    assert row["vs_sdpa"] == 0.75 and "gb_s" not in row
    assert {"case", "shape", "engine_ms", "sdpa_ms", "commit", "plan_ms", "max_abs_diff"} <= set(row)


def test_chunk_row_by_hand():
    """A chunk of 2 new rows over 5 keys: the rows see 4 and 5 keys (9 pairs); TFLOP/s, not GB/s."""
    case = bench.Case("chunk", EMBEDDED, 1, 2, 5)
    assert bench.attention_flops(case) == 4 * 9 * 64 * 9
    row = _row(case, 1e-3, 2e-3)
    assert row["tflops"] == pytest.approx(4 * 9 * 64 * 9 / 1e-3 / 1e9) and "gb_s" not in row
    assert row["vs_sdpa"] == 2.0


def test_decode_row_by_hand():
    row = _row(bench.Case("decode", LLAMA_8B, 16, 1, 8192), 0.2, 0.4, copy_bw=4000.0)
    assert row["gb_s"] == pytest.approx(512 * 2 ** 20 / 0.2 / 1e6)  # 2684.35 GB/s
    assert row["sdpa_gb_s"] == pytest.approx(row["gb_s"] / 2)
    assert row["copy_gb_s"] == 4000.0 and row["copy_frac"] == pytest.approx(row["gb_s"] / 4000.0)
    assert row["vs_sdpa"] == 2.0 and "tflops" not in row


def test_read_floor_fields_by_hand():
    case = bench.Case("decode", LLAMA_8B, 1, 1, 8192)
    row = bench.result_row(case, 0.02, 0.04, plan_ms=0.05, max_abs_diff=0.01, copy_bw=4000.0, commit="abc1234",
                           timing="do_bench", sdpa_gqa="enable_gqa", floor_ms=0.016)
    # 32 MiB in 0.016 ms = 2097 GB/s: 0.52 of a 4000 GB/s copy; the call costs 1.25x the bare read
    assert row["floor_copy_frac"] == pytest.approx(32 * 2 ** 20 / 0.016 / 1e6 / 4000.0)
    assert row["vs_floor"] == pytest.approx(0.8)
    assert "floor_ms" not in _row(case, 0.02, 0.04)  # not timed: no fields
    prefill = bench.result_row(bench.Case("prefill", LLAMA_8B, 1, 512, 512), 1.0, 1.0, plan_ms=0.05,
                               max_abs_diff=0.0, copy_bw=4000.0, commit="x", timing="t", sdpa_gqa="g", floor_ms=0.5)
    assert "vs_floor" not in prefill  # compute-bound cases read no floor


def test_mtp_ratio_and_targets():
    rows = [_row(bench.Case("decode", LLAMA_8B, 64, 1, 1024), 0.10, 0.2),
            _row(bench.Case("mtp_rows", LLAMA_8B, 64, 4, 1024), 0.12, 0.3),
            _row(bench.Case("mtp_rows", EMBEDDED, 64, 4, 1024), 0.05, 0.1),  # no 1-row case for it
            _row(bench.Case("decode", LLAMA_8B, 1, 1, 8192), 0.02, 0.04, copy_bw=4000.0),
            _row(bench.Case("prefill", LLAMA_8B, 1, 8192, 8192), 2.0, 1.5)]
    bench.add_mtp_ratios(rows)
    decode64, mtp, mtp_small, decode1, prefill = rows
    assert mtp["one_row_ms"] == 0.10 and mtp["vs_one_row"] == pytest.approx(1.2)
    assert (mtp["target"], mtp["met"]) == ("vs_one_row <= 1.3", True)
    assert mtp_small["vs_one_row"] is None and mtp_small["target"] is None  # the targets are the 8B shape's
    assert (decode64["target"], decode64["met"]) == (None, None)
    # 32 MiB in 0.02 ms = 1678 GB/s: 0.42 of a 4000 GB/s copy
    assert decode1["target"] == "copy_frac >= 0.5" and decode1["met"] is False
    assert (prefill["target"], prefill["met"]) == ("vs_sdpa >= 0.8", False)
    lines = render_table(rows, bench.COLUMNS).splitlines()
    assert len(lines) == 2 + len(rows) and lines[3].startswith("mtp_rows") and "1.20" in lines[3]


def test_no_cuda_is_a_clear_exit(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", "--out", os.devnull])
