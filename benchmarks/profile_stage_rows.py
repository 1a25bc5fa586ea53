"""Host time of laying out one mixed step's rows (``StepRows.stage``): the decode items of a full
batch (K + 1 rows each) beside P prompt chunks, on the embedded model's CPU backend (rows layout,
no graphs). This runs before the forward of every mixed step, with the GPU waiting.

    python benchmarks/profile_stage_rows.py --chunks 1,3,6 --out stage_rows.json
"""
import argparse
import json
import os
import random
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from lightllm.tools.report import Column, render_table  # noqa: E402

WARMUP = 20
COLUMNS = [Column("prompt_chunks", "prompt chunks"), Column("rows", "rows"), Column("padded_rows", "padded"),
           Column("stage_us", "stage us", ".0f")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--running", type=int, default=64, help="requests in the step (decode items + chunks)")
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--chunks", default="1,3,6", help="comma-separated prompt chunk counts")
    p.add_argument("--chunk_tokens", type=int, default=170, help="tokens per chunk (a GSM8K chat prompt)")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine
    from lightllm.server.router.model_infer.step_rows import RowItem, StepRows, max_sampled_rows, step_ladder

    k, run = args.mtp_step, args.running
    eng = OfflineEngine(StartArgs(running_max_req_size=run, max_req_total_len=1024, mtp_mode="eagle_with_att",
                                  mtp_step=k), device="cpu", dtype="float32")
    b = eng.backend
    rows = StepRows(b.model, b.req_to_next_token_ids, step_ladder(2048, run * (k + 1) + 2048), False, b.rows_draft,
                    max_logit_rows=max_sampled_rows(run, k))
    rng = random.Random(0)
    results = []
    for chunks in (int(c) for c in args.chunks.split(",")):
        items = [RowItem(i, 200 + i, k + 1) for i in range(run - chunks)]
        items += [RowItem(run - chunks + j, 0, args.chunk_tokens,
                          tokens=[rng.randrange(1000) for _ in range(args.chunk_tokens)]) for j in range(chunks)]
        slots = torch.arange(sum(it.n for it in items), dtype=torch.int64)
        for _ in range(WARMUP):
            batch = rows.stage(items, slots)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            rows.stage(items, slots)
        results.append({"prompt_chunks": chunks, "rows": batch.num_rows, "padded_rows": batch.size,
                        "stage_us": 1e6 * (time.perf_counter() - t0) / args.repeats})
    print(render_table(results, COLUMNS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
