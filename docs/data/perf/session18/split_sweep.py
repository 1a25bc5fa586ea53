"""Ran at 7eb3135 (its fused_combine was backed out in e04ecd4).

Decode split sweep (eighteenth session): bench_attention's decode cases with the split count's bound
(MAX_KV_SPLITS, SPLIT_PROGRAMS_PER_SM) and the split tile (DECODE_SPLIT_CONFIG) patched, the fused
combine against the two-kernel one in each. Run from the repository root on a GPU:
    python docs/data/perf/session18/split_sweep.py OUT.json"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as ua  # noqa: E402

CASES = [ba.Case("decode", ba.HEAD_SHAPES["8b"], 1, 1, 8192),
         ba.Case("decode", ba.HEAD_SHAPES["embedded"], 16, 1, 6000)]
VARIANTS = [(32, 2, (128, 4, 2)), (64, 4, (64, 4, 2)), (16, 1, (128, 4, 3))]


def mixed_lengths(gen, rows_out):
    """Batch 64 of the serving mix (20% of requests at 4000 keys, the rest at 150): kernel time against the
    same batch all short and all long (an unsplit grid: does a long row's program hold the layer?)."""
    from lightllm.models.llama.triton_kernel.unified_attention import plan_attention, unified_attention
    for shape, q_len in (("embedded", 1), ("embedded", 4), ("8b", 1)):
        if True:
            h = ba.HEAD_SHAPES[shape]
            case = ba.Case("decode", h, 64, q_len, 4000)
            layers = [ba.make_inputs(case, gen) for _ in range(ba.GRAPH_LAYERS)]
            for name, long_every in (("short", 0), ("mixed", 5), ("long", 1)):
                lens = torch.full((64,), 150, dtype=torch.int32, device="cuda")
                if long_every:
                    lens[::long_every] = 4000
                row_len = (lens.repeat_interleave(q_len) - (q_len - 1)
                           + torch.arange(q_len, device="cuda", dtype=torch.int32).repeat(64))
                x = layers[0]
                plan = plan_attention(x.row_req_idx, row_len, h.q_heads, h.kv_heads, q_len, 64, head_dim=h.head_dim)
                fn = lambda: [unified_attention(y.q, y.k_cache, y.v_cache, y.req_to_token, plan, 0.125)  # noqa: E731
                              for y in layers]
                ms, _ = ba.time_ms(fn, True, 25, 200)
                kv = int(lens.sum()) * h.kv_heads * h.head_dim * 2 * 2
                r = dict(case="mixed_lengths", heads=shape, q_len=q_len, lengths=name, splits=plan.num_kv_splits,
                         us_per_layer=ms / len(layers) * 1e3, gb_s=kv / (ms / len(layers)) / 1e6)
                rows_out.append(r)
                print(r, flush=True)
                json.dump(rows_out, open(sys.argv[1], "w"), indent=1)


def main():
    out = sys.argv[1]
    args = argparse.Namespace(deterministic=False, no_graphs=False, warmup_ms=25, rep_ms=200)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    rows = []
    mixed_lengths(gen, rows)
    for max_splits, per_sm, (bn, warps, stages) in VARIANTS:
        ua.MAX_KV_SPLITS, ua.SPLIT_PROGRAMS_PER_SM = max_splits, per_sm
        ua.DECODE_SPLIT_CONFIG = ua.LaunchConfig(bn, warps, stages)
        for case in CASES:
            r = ba.bench_case(case, args, gen, copy_bw, ba.git_commit())
            r.update(max_splits=max_splits, per_sm=per_sm, block_n=bn, warps=warps, stages=stages)
            rows.append(r)
            json.dump(rows, open(out, "w"), indent=1)
            print(f"{case.shape:34s} max {max_splits:3d} per_sm {per_sm} bn {bn:3d} w {warps} s {stages}: "
                  f"splits {r.get('splits', 1):3d} fused {r['engine_ms'] * 1e3:6.1f} us "
                  f"two-kernel {r.get('two_kernel_ms', float('nan')) * 1e3:6.1f} us "
                  f"copy_frac {r['copy_frac']:.3f} diff {r['max_abs_diff']:.1e}", flush=True)
            torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
