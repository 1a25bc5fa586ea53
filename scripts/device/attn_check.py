"""Dynamic splits vs the static plan, kernel only, on shapes the engine runs (embedded model heads)."""
import dataclasses
import sys

import torch
import triton

sys.path.insert(0, '.')
from lightllm.models.llama.triton_kernel import unified_attention as ua  # noqa: E402
from unit_tests.models.llama.triton_kernel.attention_reference import make_batch  # noqa: E402

CASES = {"chunk 2048 after 4096": ((0, 4097, 2048),), "chunk 52 after 6000": ((0, 6001, 52),),
         "chunk 512 after 1500": ((0, 1501, 512),), "chunk 200 after 3000": ((0, 3001, 200),),
         "64 decode rows at 300 (rows graph)": tuple((i, 300, 1) for i in range(64)),
         "mixed: 60 decode rows + chunk 100 after 200": tuple((i, 300, 1) for i in range(60)) + ((60, 201, 100),)}
for name, runs in CASES.items():
    b = make_batch(runs, 9, 3, 64, torch.bfloat16, "cuda")
    rows = b.q.shape[0]
    plan = ua.plan_attention(b.row_req_idx, b.row_seq_len, 9, 3, rows if "graph" in name or "mixed" in name
                             else b.max_q_len, rows)
    static = dataclasses.replace(plan, dynamic_splits=False, num_kv_splits=1)
    sc = 64 ** -0.5
    res = {}
    ref = None
    for arm, p in (("dynamic", plan), ("static", static)):
        def f():
            return ua.unified_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, p, sc)
        out = f()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float()
        else:
            res["max_diff"] = float((out.float() - ref).abs().max())
        res[arm] = round(triton.testing.do_bench(f, warmup=20, rep=100) * 1000, 1)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        g.replay()
        torch.cuda.synchronize()
        res[arm + "_graph"] = round(triton.testing.do_bench(g.replay, warmup=20, rep=100) * 1000, 1)
    print(f"{name}: {res} us, dynamic plan {plan.dynamic_splits}")
