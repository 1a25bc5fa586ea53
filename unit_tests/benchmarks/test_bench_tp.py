"""benchmarks/bench_tp.py: its arms and ratios by hand, and (slow) a run on CPU gloo ranks with a tiny shape."""
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_tp  # noqa: E402


def test_arms_follow_the_gpus():
    graphs = "--enable_tp_cudagraph"
    assert bench_tp.arms([1, 2, 4], gpus=2, eager=True) == {
        "tp1": ["--tp", "1"], "tp2": ["--tp", "2", graphs], "tp2_eager": ["--tp", "2"],
        "tp2_dp2": ["--tp", "2", "--dp", "2", graphs], "tp2_dp2_eager": ["--tp", "2", "--dp", "2"]}
    assert list(bench_tp.arms([1, 2, 4], gpus=4, eager=False)) == ["tp1", "tp2", "tp4", "tp2_dp2"]
    assert list(bench_tp.arms([1, 4], gpus=4, eager=False)) == ["tp1", "tp4"]
    assert list(bench_tp.arms([1, 2], gpus=0, eager=False)) == ["tp1", "tp2", "tp2_dp2"]  # CPU: gloo ranks


def test_ratios_to_tp1_of_the_same_mode_and_batch():
    rows = [dict(mode="plain", arm="tp1", batch=1, output_tokens_per_s=100.0),
            dict(mode="plain", arm="tp2", batch=1, output_tokens_per_s=160.0),
            dict(mode="plain", arm="tp2", batch=64, output_tokens_per_s=900.0),
            dict(mode="mtp3", arm="tp1", batch=1, output_tokens_per_s=50.0),
            dict(mode="mtp3", arm="tp2", batch=1, output_tokens_per_s=75.0)]
    got = [r["x_tp1"] for r in bench_tp.add_tp1_ratios(rows)]
    assert got == [1.0, 1.6, None, 1.0, 1.5]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU: with CUDA, bench_tp runs on the GPUs")
def test_cpu_run_on_two_gloo_ranks(tmp_path):
    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} plus {i + 1}?", "answer": "#### 1"}) + "\n"
                             for i in range(20)))
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--gsm8k", str(gsm8k), "--shape", "tiny", "--tp_sizes", "1", "2", "--batches", "1", "2",
                          "--modes", "plain", "--max_new_tokens", "2", "--no_eager", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["arm"], r["batch"]) for r in rows] == [(a, b) for a in ("tp1", "tp2", "tp2_dp2") for b in (1, 2)]
    # every request generated its tokens (ignore_eos), at least MIN_TIMED_REQUESTS a batch
    assert all(r["output_tokens"] == 2 * r["num_requests"] and r["num_requests"] >= bench_tp.MIN_TIMED_REQUESTS
               for r in rows)
    assert rows[0]["x_tp1"] == 1.0 and rows[2]["x_tp1"] > 0
