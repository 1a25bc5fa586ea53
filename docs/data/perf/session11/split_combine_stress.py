"""For fused_split_combine.diff (not on main): the in-kernel split combine repeated 300 times, bitwise
against its first result, and against the reference; counters must be back to zero. Run on a GPU from the
repository root after `git apply docs/data/perf/session11/fused_split_combine.diff`."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from lightllm.models.llama.triton_kernel.unified_attention import plan_attention, unified_attention
from unit_tests.models.llama.triton_kernel.attention_reference import make_batch
for qh, kvh, d, runs, mq in ((32, 8, 128, [(i, 8192 - 37 * i, 1) for i in range(3)], 1), (9, 3, 64, [(i, 3000 + i, 4) for i in range(16)], 4)):
    b = make_batch(runs, qh, kvh, d, torch.bfloat16, "cuda")
    plan = plan_attention(b.row_req_idx, b.row_seq_len, qh, kvh, mq, len(runs), head_dim=d)
    first = unified_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, plan, d ** -0.5)
    bad = sum(not torch.equal(first, unified_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, plan, d ** -0.5)) for _ in range(300))
    err = (first.float() - b.reference(d ** -0.5)).abs().max().item()
    print(f"splits {plan.num_kv_splits}: {bad} of 300 repeats differ; max |err| {err:.2e}; counters left {int(plan.split_counter.abs().sum())}")
