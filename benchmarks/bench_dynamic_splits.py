"""Dynamic KV splits of prefill-shaped attention plans against the same plan without them.

The engine's rows graphs (prefills and mixed steps up to ``--graph_max_prefill_tokens`` rows) plan
blocks for as many requests as rows; a short chunk after a long cached prefix fills only a few of
them, and each walks the whole KV alone. With ``dynamic_splits`` the programs of the empty blocks
read splits of the full ones. Each case times the unified attention kernel (embedded model heads:
9 query / 3 KV heads, head_dim 64, bf16) with the engine's plan and with that plan's splits turned
off, eagerly and as a CUDA graph replay (how the rows graphs run it), and the largest difference
between the two outputs.

    python benchmarks/bench_dynamic_splits.py --out docs/data/perf/dynamic_splits.json
"""
import argparse
import dataclasses
import os
import sys
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the embedded model (SmolLM2-135M)
WARMUP_MS, REP_MS = 20, 100  # triton.testing.do_bench
Run = Tuple[int, int, int]  # (request, keys its first row sees, rows): attention_reference.make_batch
# name -> (runs, blocks planned for every row as the rows graphs do)
CASES: Dict[str, Tuple[Tuple[Run, ...], bool]] = {
    "chunk 2048 after 4096 (eager prefill)": (((0, 4097, 2048),), False),
    "chunk 52 after 6000 (a resent prompt)": (((0, 6001, 52),), True),
    "chunk 200 after 3000": (((0, 3001, 200),), True),
    "chunk 512 after 1500": (((0, 1501, 512),), True),
    "64 decode rows at 300 keys": (tuple((i, 300, 1) for i in range(64)), True),
    "60 decode rows + chunk 100 after 200": (tuple((i, 300, 1) for i in range(60)) + ((60, 201, 100),), True),
}
TABLE = [Column("case", "case"), Column("dynamic_graph_us", "dynamic (graph) us", ".1f"),
         Column("static_graph_us", "without splits (graph) us", ".1f"), Column("ratio_graph", "ratio", ".2f", "x"),
         Column("dynamic_eager_us", "dynamic (eager) us", ".1f"), Column("static_eager_us", "without (eager) us", ".1f"),
         Column("dynamic_plan", "dynamic plan"), Column("max_abs_diff", "max |diff|", ".1e")]


def measure(runs, rows_plan: bool) -> Dict[str, object]:
    import torch
    import triton

    from lightllm.models.llama.triton_kernel import unified_attention as ua
    from unit_tests.models.llama.triton_kernel.attention_reference import make_batch

    b = make_batch(runs, Q_HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    rows = b.q.shape[0]
    plan = ua.plan_attention(b.row_req_idx, b.row_seq_len, Q_HEADS, KV_HEADS, rows if rows_plan else b.max_q_len,
                             rows if rows_plan else b.num_runs)
    static = dataclasses.replace(plan, dynamic_splits=False, num_kv_splits=1)
    scale = HEAD_DIM ** -0.5
    row: Dict[str, object] = {"dynamic_plan": plan.dynamic_splits, "rows": rows}
    outs: List[torch.Tensor] = []
    for arm, p in (("dynamic", plan), ("static", static)):
        def run(p=p):
            return ua.unified_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, p, scale)
        outs.append(run().float())
        torch.cuda.synchronize()
        row[f"{arm}_eager_us"] = 1000 * triton.testing.do_bench(run, warmup=WARMUP_MS, rep=REP_MS)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        row[f"{arm}_graph_us"] = 1000 * triton.testing.do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS)
    row["ratio_graph"] = row["static_graph_us"] / row["dynamic_graph_us"]
    row["max_abs_diff"] = float((outs[0] - outs[1]).abs().max())
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rows = [{"case": name, **measure(runs, rows_plan)} for name, (runs, rows_plan) in CASES.items()]
    print(render_table(rows, TABLE))
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "shape": [Q_HEADS, KV_HEADS, HEAD_DIM],
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
