"""MTP verify rows (K + 1 = 4 a request) against one row a request at the engine's short KV lengths, embedded
heads, batch 64, plans as the decode step builds them (max_q_runs = requests + 1), 16 layers in one CUDA graph
(twenty-fifth session).
    python docs/data/perf/session25/mtp_rows_short.py OUT.json"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as ua  # noqa: E402

BATCH = 64


def run(case, max_seqs, gen):
    layers = [ba.make_inputs(case, gen) for _ in range(ba.GRAPH_LAYERS)]
    h = case.heads
    plan = ua.plan_attention(layers[0].row_req_idx, layers[0].row_seq_len, h.q_heads, h.kv_heads, case.q_len,
                             max_seqs, head_dim=h.head_dim)
    scale = 1.0 / math.sqrt(h.head_dim)
    eng = lambda: [ua.unified_attention(y.q, y.k_cache, y.v_cache, y.req_to_token, plan, scale) for y in layers]
    return ba.time_ms(eng, True, 25, 200)[0] / len(layers) * 1e3, int(plan.work.shape[0]) if plan.work is not None else 0


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in ("embedded", "8b"):
        for kv in (128, 1024):
            for q_len, max_seqs, name in ((1, BATCH, "1 row"), (4, BATCH + 1, "4 rows, engine plan"),
                                          (4, 1, "4 rows, fewest blocks")):
                case = ba.Case("decode" if q_len == 1 else "mtp_rows", ba.HEAD_SHAPES[shape], BATCH, q_len, kv)
                us, programs = run(case, max_seqs, gen)
                row = dict(shape=shape, kv_len=kv, rows=name, us=us, programs_per_head=programs)
                rows.append(row)
                print(row, flush=True)
                json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
