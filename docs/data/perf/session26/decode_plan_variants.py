"""Decode-shaped attention plans, four variants in one run (twenty-sixth session): the work list's spare share
from all programs past one per block (``base``, as before) or max(blocks used, the programs that fill the GPU)
(``share``), and a program's keys in two loops (unmasked tiles, then masked ones) or in one masked loop
(``one_loop``); ``both``. Batch 64 of 1 and 4 (K + 1) rows a request, uniform and mixed lengths, batch 1 and 16
at 8192 keys; 16 layers in one CUDA graph as bench_attention times decode cases; outputs against ``base``.
    python docs/data/perf/session26/decode_plan_variants.py OUT.json"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as ua  # noqa: E402

VARIANTS = {"base": (False, False), "share": (True, False), "one_loop": (False, True), "both": (True, True)}
MIX_LONG, MIX_SHORT, MIX_EVERY = 4000, 150, 5  # serving-like batch: every fifth request long


def plan_for(x, h, q_len, max_seqs, share):
    real = ua.length_split_work
    if not share:  # as before: the share is every program past one per block
        ua.length_split_work = lambda bl, programs, fill=None, *a, **k: real(bl, programs, None, *a, **k)
    try:
        return ua.plan_attention(x.row_req_idx, x.row_seq_len, h.q_heads, h.kv_heads, q_len, max_seqs,
                                 head_dim=h.head_dim)
    finally:
        ua.length_split_work = real


def lengths(batch, q_len, kv_len, mixed, device):
    """Each request's rows end at its length - 1: uniform kv_len, or every MIX_EVERY-th at MIX_LONG, the rest
    MIX_SHORT."""
    ends = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    if mixed:
        ends = torch.where(torch.arange(batch, device=device) % MIX_EVERY == 0, MIX_LONG, MIX_SHORT).to(torch.int32)
    offs = torch.arange(-q_len + 1, 1, dtype=torch.int32, device=device)
    return (ends[:, None] + offs[None, :]).reshape(-1)


def run_case(shape, batch, q_len, kv_len, mixed, gen, copy_bw):
    h = ba.HEAD_SHAPES[shape]
    case = ba.Case("decode" if q_len == 1 else "mtp_rows", h, batch, q_len, MIX_LONG if mixed else kv_len)
    layers = [ba.make_inputs(case, gen) for _ in range(ba.GRAPH_LAYERS)]
    for x in layers:
        x.row_seq_len = lengths(batch, q_len, kv_len, mixed, x.q.device)
    max_seqs = batch if q_len == 1 else batch + 1  # as the decode step plans them (a run of padding rows)
    scale = 1.0 / math.sqrt(h.head_dim)
    row = dict(shape=shape, batch=batch, q_len=q_len, kv_len="mix" if mixed else kv_len)
    outs = {}
    for name, (share, one_loop) in VARIANTS.items():
        plan = plan_for(layers[0], h, q_len, max_seqs, share)
        ua.LENGTH_SPLIT_ONE_LOOP = one_loop
        try:
            fn = lambda: [ua.unified_attention(x.q, x.k_cache, x.v_cache, x.req_to_token, plan, scale) for x in layers]
            outs[name] = fn()[0].float()
            us = ba.time_ms(fn, True, 25, 200)[0] / len(layers) * 1e3
        finally:
            ua.LENGTH_SPLIT_ONE_LOOP = False
        splits = plan.work[:, 2].float() if plan.work is not None else torch.ones(1)
        row[name + "_us"] = us
        row[name + "_mean_splits"] = float(splits[splits > 0].mean())
        row[name + "_max_diff"] = float((outs[name] - outs["base"]).abs().max())
    if not mixed:
        nbytes = batch * kv_len * h.kv_heads * h.head_dim * ba.KV_TENSORS * ba.BF16_BYTES
        row.update({n + "_copy_frac": ba.gb_s(nbytes, row[n + "_us"] / 1e3) / copy_bw for n in VARIANTS})
    return row


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    cases = [(s, 64, q, kv, False) for s in ("embedded", "8b") for kv in (128, 1000, 1024) for q in (1, 4)]
    cases += [(s, 64, q, 0, True) for s in ("embedded", "8b") for q in (1, 4)]
    cases += [("8b", 1, 1, 8192, False), ("8b", 1, 1, 8191, False), ("8b", 16, 1, 8192, False),
              ("embedded", 1, 1, 8192, False)]
    rows = [dict(copy_gb_s=copy_bw)]
    for c in cases:
        row = run_case(*c, gen, copy_bw)
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
