"""The per-row logits kernels (logits_rows.py) against what they replaced, in one run on a GPU.

    python benchmarks/bench_logits_rows.py [--out docs/data/perf/logits_rows.json] [--vocab 49152]

Cases: a decode step's sampled rows (1, 64, 256: batch 64 at K = 3) over the embedded model's vocabulary,
fp32 (the target's logits) and bf16 (the draft's guesses). Baselines, on the same tensor: torch.argmax, and
torch.argmax followed by log_softmax + gather for the log-probs. Each timing is do_bench's median over a
CUDA graph of the call (L2 flushed before each replay).
"""
import argparse
import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.bench_attention import git_commit, time_ms  # noqa: E402
from lightllm.common.basemodel.triton_kernel.logits_rows import argmax_lse, argmax_rows  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

ROWS = (1, 64, 256)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EMBEDDED_VOCAB = 49152
WARMUP_MS, REP_MS = 25, 200
COLUMNS = [Column("dtype", "dtype"), Column("rows", "rows"), Column("engine_us", "argmax+lse us", ".1f"),
           Column("torch_us", "torch argmax+log_softmax us", ".1f"), Column("vs_torch", "x torch", ".2f"),
           Column("argmax_us", "argmax us", ".1f"), Column("torch_argmax_us", "torch argmax us", ".1f"),
           Column("argmax_vs_torch", "x torch", ".2f")]


def torch_argmax_logprob(logits: torch.Tensor):
    ids = torch.argmax(logits, dim=-1)
    return ids, torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, None])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("docs", "data", "perf", "logits_rows.json"))
    p.add_argument("--vocab", type=int, default=EMBEDDED_VOCAB)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_logits_rows needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, dtype in DTYPES.items():
        for rows in ROWS:
            logits = (torch.randn((rows, a.vocab), generator=gen, device="cuda") * 4).to(dtype)
            ids, lse = argmax_lse(logits)
            want_ids, want_lp = torch_argmax_logprob(logits)
            assert torch.equal(ids, want_ids), "argmax differs from torch's"
            lp = logits.float().gather(1, ids[:, None]).view(-1) - lse
            diff = (lp - want_lp.view(-1)).abs().max().item()

            def t(fn):
                return 1e3 * time_ms(fn, True, WARMUP_MS, REP_MS)[0]

            row = dict(dtype=name, rows=rows, vocab=a.vocab, engine_us=t(lambda: argmax_lse(logits)),
                       torch_us=t(lambda: torch_argmax_logprob(logits)), argmax_us=t(lambda: argmax_rows(logits)),
                       torch_argmax_us=t(lambda: torch.argmax(logits, dim=-1)), max_abs_logprob_diff=diff,
                       commit=git_commit())
            row["vs_torch"] = row["torch_us"] / row["engine_us"]
            row["argmax_vs_torch"] = row["torch_argmax_us"] / row["argmax_us"]
            rows_out.append(row)
            print(f"{name} rows {rows}: {row['engine_us']:.1f} us vs torch {row['torch_us']:.1f} us", flush=True)
    print(render_table(rows_out, COLUMNS))
    write_json(a.out, rows_out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
