"""Decode-shaped plans of the unified attention kernel: launch configurations and work-list sizes, against
the static split of 14934c0, in one run on a GPU (nineteenth session).

Each variant patches the kernel module's tables (LaunchConfig of decode tiles, the programs of a
work list, the keys per split) for its rows and restores them after. Cases as length_split_sweep.py:
the serving mix (64 requests, every fifth at 4000 keys, the rest 150; 1 or 4 rows each), all short,
all long, 8B batch 1 / 16 at KV 8192, embedded batch 16 at 6000. Kernel time per layer over
GRAPH_LAYERS layers in one CUDA graph.
    python docs/data/perf/session19/decode_config_sweep.py OUT.json [VARIANT,VARIANT...] [BATCH,BATCH...]
    (default: every variant, every case; BATCH: only the cases of those batch sizes)"""
import contextlib
import functools
import json
import os
import sys

import triton

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "docs/data/perf/session18"))
import torch  # noqa: E402

import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as ua  # noqa: E402
from length_split_sweep import case_inputs, old, time_layer  # noqa: E402  (writes .ua_static when missing)

LC = ua.LaunchConfig
BASE_WORK = ua.length_split_work


def lean_programs(max_blocks, kv_heads, head_dim=ua.TARGET_HEAD_DIM, sms=ua.H200_SMS):
    """One program per block and the GPU's fill beside them (no floor of one more per block)."""
    return max_blocks + triton.cdiv(ua.split_target_programs(head_dim, sms), kv_heads)


# name -> module attributes to set
VARIANTS = {
    "head": {},
    "n32w4": {"DECODE_CONFIG": LC(32, 4, 2), "DECODE_SPLIT_CONFIG": LC(32, 4, 2)},
    "n32w8": {"DECODE_CONFIG": LC(32, 8, 2), "DECODE_SPLIT_CONFIG": LC(32, 8, 2)},
    "n64w8": {"DECODE_CONFIG": LC(64, 8, 2), "DECODE_SPLIT_CONFIG": LC(64, 8, 2)},
    "n64w4s3": {"DECODE_CONFIG": LC(64, 4, 3), "DECODE_SPLIT_CONFIG": LC(64, 4, 3)},
    "n64w4": {"DECODE_SPLIT_CONFIG": LC(64, 4, 2)},
    "n128w8": {"DECODE_CONFIG": LC(128, 8, 2), "DECODE_SPLIT_CONFIG": LC(128, 8, 2)},
    "n128w4s3": {"DECODE_SPLIT_CONFIG": LC(128, 4, 3)},
    "lean": {"length_split_programs": lean_programs},
    "keys128": {"MAX_KV_SPLITS": 64, "length_split_work": functools.partial(BASE_WORK, max_splits=64, min_keys=128)},
    "keys512": {"MAX_KV_SPLITS": 16, "length_split_work": functools.partial(BASE_WORK, max_splits=16, min_keys=512)},
    # the default before 9b2b931 (at most 32 splits), for an A/B against head in one run
    "max32": {"MAX_KV_SPLITS": 32, "length_split_work": functools.partial(BASE_WORK, max_splits=32)},
}


@contextlib.contextmanager
def patched(attrs):
    saved = {k: getattr(ua, k) for k in attrs}
    for k, v in attrs.items():
        setattr(ua, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(ua, k, v)


REP_MS = 150


def first_layer_out(mod, layers, h, q_len, batch, row_len):
    x = layers[0]
    plan = mod.plan_attention(x.row_req_idx, row_len, h.q_heads, h.kv_heads, q_len, batch, head_dim=h.head_dim)
    return mod.unified_attention(x.q, x.k_cache, x.v_cache, x.req_to_token, plan, h.head_dim ** -0.5).float()


def main():
    out = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    batches = {int(b) for b in sys.argv[3].split(",")} if len(sys.argv) > 3 else None  # e.g. "1,64": those cases only
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    cases = [("8b", 1, 1, 8192, "uniform"), ("8b", 16, 1, 8192, "uniform"), ("embedded", 16, 1, 6000, "uniform")]
    cases += [("8b", 64, q, 4000, k) for q in (1, 4) for k in ("short", "mixed")]
    cases += [("embedded", 64, q, 4000, k) for q in (1, 4) for k in ("short", "mixed", "long")]
    cases += [("embedded", 1, 1, 8192, "uniform"), ("embedded", 64, 4, 1000, "long"), ("8b", 64, 4, 1000, "long")]
    cases = [c for c in cases if batches is None or c[1] in batches]
    rows = []
    for shape, batch, q_len, kv_len, kind in cases:
        h, layers, lens, row_len = case_inputs(shape, batch, q_len, kv_len, kind, gen)
        kv = int(lens.sum()) * h.kv_heads * h.head_dim * ba.KV_TENSORS * ba.BF16_BYTES
        static_us = time_layer(old, layers, h, q_len, batch, row_len, REP_MS)
        ref = first_layer_out(old, layers, h, q_len, batch, row_len)
        r = dict(heads=shape, batch=batch, q_len=q_len, kv_len=kv_len, lengths=kind, static_us=static_us,
                 static_copy_frac=kv / (static_us * 1e-3) / 1e6 / copy_bw, variants={})
        line = f"{shape:8s} b{batch:<3d} q{q_len} {kind:7s} {kv_len:5d}: static {static_us:6.1f}"
        for name in only:
            with patched(VARIANTS[name]):
                us = time_layer(ua, layers, h, q_len, batch, row_len, REP_MS)
                diff = (first_layer_out(ua, layers, h, q_len, batch, row_len) - ref).abs().max().item()
            r["variants"][name] = dict(us=us, copy_frac=kv / (us * 1e-3) / 1e6 / copy_bw, max_abs_diff=diff)
            line += f" | {name} {us:6.1f} ({kv / (us * 1e-3) / 1e6 / copy_bw:.2f})"
        rows.append(r)
        json.dump(dict(copy_gb_s=copy_bw, rows=rows), open(out, "w"), indent=1)
        print(line, flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
