"""Kernel benchmark: strict MTP verify (mtp_verify) vs ASD verify (mtp_asd_verify, reads two logits per
mismatched row) vs a greedy sample step (torch.argmax over the same logits, what a decode step already pays).

For each (requests, K): a batch of requests * (K + 1) rows of bf16 logits over a 151936-token
vocabulary (Qwen), greedy targets (the row argmax), and drafts that match the target with
probability --match-prob. Each call is timed alone with CUDA events while the GPU is held busy by
a spin kernel, so host launch overhead is not counted (it is reported apart, as *_host_us). L2 is
flushed before every call. The ASD kernel rewrites next_token_ids and the ledger in place: both
are restored before each call, outside the timed region.

    python benchmarks/bench_mtp_verify.py --out mtp_verify.json
"""
import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.common.constants import MAX_MTP_STEP, MTP_TABLE_WIDTH  # noqa: E402 (after the path set-up)
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

DEVICE = "cuda"
QWEN_VOCAB = 151936
DEFAULT_REQUESTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_NUM_DRAFTS = list(range(1, MAX_MTP_STEP + 1))
L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than the H100/H200 L2
SPIN_CYCLES = 1_000_000  # GPU busy-wait before each timed call (~0.5 ms)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=DEFAULT_REQUESTS, help="requests per batch")
    p.add_argument("--num-drafts", type=int, nargs="+", default=DEFAULT_NUM_DRAFTS, help=f"K values (1..{MAX_MTP_STEP})")
    p.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    p.add_argument("--match-prob", type=float, default=0.6, help="probability that a draft equals the target")
    p.add_argument("--budget", type=float, default=2.0625, help="ASD budget B of every request")
    p.add_argument("--ratio", type=float, default=0.25, help="ASD local regret ratio g (inf = unset)")
    p.add_argument("--max-mismatch", type=int, default=2, help="ASD block max mismatch m")
    p.add_argument("--iters", type=int, default=200, help="timed calls per kernel and size")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per kernel and size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_mtp_verify.json", help="JSON results path")
    return p.parse_args()


def require_cuda():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_mtp_verify.py: TRITON_INTERPRET=1 is set; unset it to benchmark compiled kernels.")
    if not torch.cuda.is_available():
        sys.exit("bench_mtp_verify.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to run on CPU.")


def gpu_time_us(fn: Callable[[], object], restore: Callable[[], None], iters: int, warmup: int) -> float:
    """Median GPU time of ``fn`` in microseconds, each call timed alone."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(warmup):
        restore()
        fn()
    for start, end in zip(starts, ends):
        restore()
        flush.zero_()
        torch.cuda._sleep(SPIN_CYCLES)  # the host enqueues start, fn, end while the GPU spins
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def host_time_us(fn: Callable[[], object], iters: int) -> float:
    """Mean host time to enqueue one call (wrapper checks + launch), in microseconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / iters


def make_inputs(num_reqs: int, num_drafts: int, args, gen: torch.Generator) -> dict:
    rows_per_req = num_drafts + 1
    batch = num_reqs * rows_per_req
    max_req = num_reqs + 1  # + the HOLD row
    logits = torch.randn(batch, args.vocab, device=DEVICE, dtype=torch.float32, generator=gen).to(DTYPES[args.dtype])
    targets = logits.argmax(dim=-1)  # [batch] greedy
    table = torch.randint(0, args.vocab, (max_req, MTP_TABLE_WIDTH), device=DEVICE, generator=gen)
    match = torch.rand(num_reqs, num_drafts, device=DEVICE, generator=gen) < args.match_prob
    req_targets = targets.view(num_reqs, rows_per_req)[:, :num_drafts]
    table[:num_reqs, 1 : 1 + num_drafts] = torch.where(match, req_targets, table[:num_reqs, 1 : 1 + num_drafts])
    return {
        "req_to_next_token_ids": table,  # [max_req, W]
        "b_req_mtp_start_loc": torch.arange(num_reqs, dtype=torch.int32, device=DEVICE) * rows_per_req,
        "new_next_token_ids": targets,  # [batch]
        "b_req_idx": torch.arange(num_reqs, dtype=torch.int32, device=DEVICE).repeat_interleave(rows_per_req),
        "logits": logits,  # [batch, vocab]
        "ledger": torch.zeros(max_req, dtype=torch.float32, device=DEVICE),
        "budget": torch.full((max_req,), args.budget, dtype=torch.float32, device=DEVICE),
    }


def bench_one(num_reqs: int, num_drafts: int, args, gen: torch.Generator) -> dict:
    from lightllm.common.basemodel.triton_kernel.mtp_utils import mtp_asd_verify, mtp_verify

    x = make_inputs(num_reqs, num_drafts, args, gen)
    pristine_ids = x["new_next_token_ids"].clone()
    ids = x["new_next_token_ids"].clone()
    ledger = x["ledger"]

    def restore():
        ids.copy_(pristine_ids)
        ledger.zero_()

    def strict():
        return mtp_verify(x["req_to_next_token_ids"], x["b_req_mtp_start_loc"], ids, x["b_req_idx"])

    def asd():
        return mtp_asd_verify(x["req_to_next_token_ids"], x["b_req_mtp_start_loc"], ids, x["b_req_idx"], x["logits"],
                              ledger, x["budget"], args.ratio, args.max_mismatch)

    def argmax():
        return x["logits"].argmax(dim=-1)

    def no_restore():
        pass

    # Acceptance of this batch, to read the timings against.
    restore()
    strict_len = strict()[0].float().mean().item()
    asd_len = asd()[0].float().mean().item()

    row = {
        "requests": num_reqs, "K": num_drafts, "batch_rows": num_reqs * (num_drafts + 1),
        "strict_us": gpu_time_us(strict, no_restore, args.iters, args.warmup),
        "asd_us": gpu_time_us(asd, restore, args.iters, args.warmup),
        "argmax_us": gpu_time_us(argmax, no_restore, args.iters, args.warmup),
        "strict_host_us": host_time_us(strict, args.iters), "asd_host_us": host_time_us(asd, args.iters),
        "strict_mean_accept_len": strict_len, "asd_mean_accept_len": asd_len,
    }
    row["asd_over_strict"] = row["asd_us"] / row["strict_us"]
    row["asd_over_argmax"] = row["asd_us"] / row["argmax_us"]
    return row


# the printed table; every column of the JSON rows is kept
COLUMNS = (
    Column("requests", "reqs", "d"), Column("K", "K", "d"), Column("batch_rows", "rows", "d"),
    Column("strict_us", "strict_us", ".2f"), Column("asd_us", "asd_us", ".2f"), Column("argmax_us", "argmax_us", ".2f"),
    Column("asd_over_strict", "asd/strict", ".2f"), Column("asd_over_argmax", "asd/argmax", ".3f"),
    Column("asd_host_us", "asd_host_us", ".1f"), Column("asd_mean_accept_len", "asd_accept", ".2f"),
)


def main():
    args = parse_args()
    require_cuda()
    if any(not 1 <= k <= MAX_MTP_STEP for k in args.num_drafts):
        sys.exit(f"--num-drafts values must be in 1..{MAX_MTP_STEP}")
    if args.ratio < 0 or math.isnan(args.ratio):
        sys.exit("--ratio must be >= 0 (inf = unset)")
    from tqdm import tqdm

    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    sizes = [(r, k) for r in args.requests for k in args.num_drafts]
    rows = [bench_one(r, k, args, gen) for r, k in tqdm(sizes, desc="mtp verify")]
    print(render_table(rows, COLUMNS))

    import triton

    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "vocab": args.vocab, "dtype": args.dtype, "match_prob": args.match_prob,
        "asd": {"budget": args.budget, "local_regret_ratio": args.ratio, "block_max_mismatch": args.max_mismatch},
        "iters": args.iters, "timing": "median GPU time per call, CUDA events, L2 flushed, host overhead excluded",
        "rows": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
