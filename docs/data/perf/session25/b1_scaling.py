"""Batch-1 decode of the unified attention kernel: time per layer against the KV length, random and
contiguous slots, beside SDPA and a read-only reference (one torch sum over the same bytes), on a GPU
(twenty-fifth session). A line through the points splits the time into a fixed part and bytes / bandwidth.
    python docs/data/perf/session25/b1_scaling.py OUT.json [SHAPE]"""
import functools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as ua  # noqa: E402

KV_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
VARIANTS = {  # name -> module attributes (8192 keys only)
    "head": {},
    "splits16": {"SMALL_GRID_MAX_KV_SPLITS": 16},
    "splits64": {"SMALL_GRID_MAX_KV_SPLITS": 64, "SPLIT_PROGRAMS_PER_SM": 4,
                 "length_split_work": functools.partial(ua.length_split_work, min_keys=128)},
    "n64": {"DECODE_SPLIT_CONFIG": ua.LaunchConfig(64, 4, 2)},
    "n128s3": {"DECODE_SPLIT_CONFIG": ua.LaunchConfig(128, 4, 3)},
    "n128w8": {"DECODE_SPLIT_CONFIG": ua.LaunchConfig(128, 8, 2)},
    "n256w8": {"DECODE_SPLIT_CONFIG": ua.LaunchConfig(256, 8, 2)},
}


def one(case, slots, gen, attrs=None):
    saved = {k: getattr(ua, k) for k in (attrs or {})}
    for k, v in (attrs or {}).items():
        setattr(ua, k, v)
    try:
        layers = [ba.make_inputs(case, gen, slots) for _ in range(ba.GRAPH_LAYERS)]
        h = case.heads
        plan = ua.plan_attention(layers[0].row_req_idx, layers[0].row_seq_len, h.q_heads, h.kv_heads, case.q_len,
                                 case.batch, head_dim=h.head_dim)
        scale = 1.0 / math.sqrt(h.head_dim)
        eng = lambda: [ua.unified_attention(y.q, y.k_cache, y.v_cache, y.req_to_token, plan, scale) for y in layers]
        sd = [ba.sdpa_fn(case, y)[0] for y in layers]
        flat = [y.k4.reshape(-1) for y in layers]  # the layer's K then V bytes, read by one reduction
        flat_v = [y.v4.reshape(-1) for y in layers]
        buf = [torch.cat([a, b]) for a, b in zip(flat, flat_v)]
        read = lambda: [b.sum(dtype=torch.float32) for b in buf]
        ref = sd[0]().transpose(1, 2).reshape(case.rows, h.q_heads, h.head_dim).float()
        diff = (eng()[0].float() - ref).abs().max().item()
        e_ms = ba.time_ms(eng, True, 25, 200)[0] / len(layers)
        s_ms = ba.time_ms(lambda: [f() for f in sd], True, 25, 200)[0] / len(layers)
        r_ms = ba.time_ms(read, True, 25, 200)[0] / len(layers)
        return e_ms, s_ms, r_ms, diff, plan.num_kv_splits
    finally:
        for k, v in saved.items():
            setattr(ua, k, v)


def main():
    out = sys.argv[1]
    shape = ba.HEAD_SHAPES[sys.argv[2] if len(sys.argv) > 2 else "8b"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for name, attrs in VARIANTS.items():
        lens = KV_LENS if name == "head" else (8192,)
        for slots in ("random", "contiguous") if name == "head" else ("random",):
            for kv in lens:
                case = ba.Case("decode", shape, 1, 1, kv)
                e, s, r, diff, splits = one(case, slots, gen, attrs)
                nbytes = ba.kv_bytes(case)
                row = dict(variant=name, slots=slots, kv_len=kv, engine_us=e * 1e3, sdpa_us=s * 1e3, read_us=r * 1e3,
                           engine_frac=nbytes / (e * 1e-3) / 1e9 / copy_bw, read_frac=nbytes / (r * 1e-3) / 1e9 / copy_bw,
                           max_abs_diff=diff, max_splits=splits)
                rows.append(row)
                print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                with open(out, "w") as f:
                    json.dump(dict(copy_gb_s=copy_bw, shape=shape.name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
