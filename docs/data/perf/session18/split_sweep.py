"""Decode split sweep (eighteenth session): bench_attention's decode cases with the split count's bound
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

CASES = [ba.Case("decode", ba.HEAD_SHAPES["8b"], 1, 1, 8192), ba.Case("decode", ba.HEAD_SHAPES["8b"], 4, 1, 8192),
         ba.Case("decode", ba.HEAD_SHAPES["embedded"], 16, 1, 6000),
         ba.Case("decode", ba.HEAD_SHAPES["embedded"], 1, 1, 8192)]
VARIANTS = [(32, 2, (128, 4, 2)), (64, 4, (128, 4, 2)), (64, 4, (64, 4, 2)), (16, 1, (128, 4, 3)),
            (32, 2, (64, 4, 2)), (32, 2, (128, 8, 2)), (128, 8, (64, 4, 2))]


def main():
    out = sys.argv[1]
    args = argparse.Namespace(deterministic=False, no_graphs=False, warmup_ms=25, rep_ms=200)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    rows = []
    for max_splits, per_sm, (bn, warps, stages) in VARIANTS:
        ua.MAX_KV_SPLITS, ua.SPLIT_PROGRAMS_PER_SM = max_splits, per_sm
        ua.DECODE_SPLIT_CONFIG = ua.LaunchConfig(bn, warps, stages)
        for case in CASES:
            r = ba.bench_case(case, args, gen, copy_bw, ba.git_commit())
            r.update(max_splits=max_splits, per_sm=per_sm, block_n=bn, warps=warps, stages=stages)
            rows.append(r)
            print(f"{case.shape:34s} max {max_splits:3d} per_sm {per_sm} bn {bn:3d} w {warps} s {stages}: "
                  f"splits {r.get('splits', 1):3d} fused {r['engine_ms'] * 1e3:6.1f} us "
                  f"two-kernel {r.get('two_kernel_ms', float('nan')) * 1e3:6.1f} us "
                  f"copy_frac {r['copy_frac']:.3f} diff {r['max_abs_diff']:.1e}", flush=True)
            torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
