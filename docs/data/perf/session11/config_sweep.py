"""Throwaway tuning sweep (not part of the project): unified_attention configs vs SDPA flash."""
import itertools, json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import lightllm.models.llama.triton_kernel.unified_attention as ua

dev = "cuda"
torch.manual_seed(0)
res = []

def setup(rows_req, q_heads, kv_heads, D, max_len):
    # rows_req: list of (req, first_len, nrows)
    reqs = max(r for r, _, _ in rows_req) + 1
    slots = reqs * max_len + 1
    k = torch.randn(slots, kv_heads, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.stack([torch.randperm(slots, device=dev)[:max_len] for _ in range(reqs)])
    req, lens = [], []
    for r, f, n in rows_req:
        req += [r] * n; lens += list(range(f, f + n))
    req = torch.tensor(req, device=dev); lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(len(req), q_heads, D, device=dev, dtype=torch.bfloat16)
    return q, k, v, table, req, lens

def bench(fn, graph=False):
    if graph:
        fn()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        return triton.testing.do_bench(lambda: g.replay(), warmup=25, rep=200)
    return triton.testing.do_bench(fn, warmup=25, rep=200)

def run_case(name, rows_req, q_heads, kv_heads, D, max_len, max_q_len, runs, cfgs, blocks, graph):
    q, k, v, table, req, lens = setup(rows_req, q_heads, kv_heads, D, max_len)
    scale = D ** -0.5
    orig_bs, orig_lc = ua.block_shape, ua.launch_config
    for bm in blocks:
        def bs(group, mql, det, bm=bm):
            if bm is None: return orig_bs(group, mql, det)
            return min(mql, bm // group), bm
        ua.block_shape = bs
        plan = ua.plan_attention(req, lens, q_heads, kv_heads, max_q_len, runs)
        for (bn, w, st) in cfgs:
            ua.launch_config = lambda a, b, bn=bn, w=w, st=st: ua.LaunchConfig(bn, w, st)
            try:
                out = ua.unified_attention(q, k, v, table, plan, scale)
                ms = bench(lambda: ua.unified_attention(q, k, v, table, plan, scale), graph)
                res.append(dict(case=name, block_m=plan.block_m, splits=plan.num_kv_splits, bn=bn, warps=w, stages=st, ms=ms))
                print(name, plan.block_m, plan.num_kv_splits, bn, w, st, f"{ms:.4f}", flush=True)
            except Exception as e:
                print(name, bm, bn, w, st, "FAIL", repr(e)[:200], flush=True)
        ua.block_shape, ua.launch_config = orig_bs, orig_lc
    return q, k, v, table, req, lens

def sdpa_prefill(n, q_heads, kv_heads, D):
    q = torch.randn(1, q_heads, n, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, q_heads, n, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    print("sdpa_prefill", n, q_heads, D, f"{ms:.4f}", flush=True)
    res.append(dict(case=f"sdpa_prefill_{n}_{q_heads}_{D}", ms=ms))

what = sys.argv[1] if len(sys.argv) > 1 else "all"
PREFILL_CFGS = [(64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2), (32, 4, 2), (64, 4, 3), (128, 8, 3)]
if what in ("all", "prefill"):
    for n, qh, kvh, D in ((8192, 32, 8, 128), (6000, 9, 3, 64), (2048, 32, 8, 128)):
        sdpa_prefill(n, qh, kvh, D)
        run_case(f"prefill_{n}_{qh}_{D}", [(0, 1, n)], qh, kvh, D, n + 64, n, 1, PREFILL_CFGS, [128, 64], False)
DEC_CFGS = [(64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 4, 2), (64, 2, 2), (128, 8, 2)]
if what in ("all", "decode"):
    for b in (1, 16, 64):
        run_case(f"decode_b{b}_8k", [(i, 8192, 1) for i in range(b)], 32, 8, 128, 8192 + 64, 1, b, DEC_CFGS, [None], True)
    run_case("mtp1_b64_1k", [(i, 1024, 1) for i in range(64)], 32, 8, 128, 1100, 1, 64, DEC_CFGS[:3], [None], True)
    run_case("mtp4_b64_1k", [(i, 1021, 4) for i in range(64)], 32, 8, 128, 1100, 4, 65, DEC_CFGS[:3], [None], True)
    run_case("emb_decode_b1_300", [(0, 300, 1)], 9, 3, 64, 400, 1, 1, DEC_CFGS[:3], [None], True)
    run_case("emb_mtp4_b64_300", [(i, 297, 4) for i in range(64)], 9, 3, 64, 400, 4, 65, DEC_CFGS[:3], [None], True)
    # copy bandwidth
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    print("copy GB/s (read+write)", 2 * (1 << 30) / ms / 1e6, flush=True)
    res.append(dict(case="copy", ms=ms))
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out, f"tune_{what}.json"), "w"), indent=1)

def layered(name, rows_req, q_heads, kv_heads, D, max_len, max_q_len, runs, cfgs, targets, layers=16):
    sets = [setup(rows_req, q_heads, kv_heads, D, max_len) for _ in range(layers)]
    scale = D ** -0.5
    orig_lc, orig_t, orig_m = ua.launch_config, ua.TARGET_PROGRAMS, ua.MAX_KV_SPLITS
    for tp, ms_ in targets:
        ua.TARGET_PROGRAMS, ua.MAX_KV_SPLITS = tp, ms_
        q, k, v, table, req, lens = sets[0]
        plan = ua.plan_attention(req, lens, q_heads, kv_heads, max_q_len, runs)
        for (bn, w, st) in cfgs:
            ua.launch_config = lambda a, b, bn=bn, w=w, st=st: ua.LaunchConfig(bn, w, st)
            fn = lambda: [ua.unified_attention(s[0], s[1], s[2], s[3], plan, scale) for s in sets]
            try:
                ms = bench(fn, True) / layers
                kvb = sum(n for _, _, n in rows_req) and sum(f + n - 1 for _, f, n in rows_req) * kv_heads * D * 4
                print(name, "tp", tp, "maxs", ms_, "splits", plan.num_kv_splits, bn, w, st, f"{ms*1e3:.1f}us", f"{kvb/ms/1e6:.0f}GB/s", flush=True)
                res.append(dict(case=name, tp=tp, splits=plan.num_kv_splits, bn=bn, warps=w, stages=st, ms=ms, gb_s=kvb / ms / 1e6))
            except Exception as e:
                print(name, tp, bn, w, st, "FAIL", repr(e)[:200], flush=True)
    ua.launch_config, ua.TARGET_PROGRAMS, ua.MAX_KV_SPLITS = orig_lc, orig_t, orig_m

if what == "decode2":
    C = [(64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 4, 3)]
    layered("b1_8k", [(0, 8192, 1)], 32, 8, 128, 8256, 1, 1, C, [(264, 32), (528, 64), (1056, 128)])
    layered("b16_8k", [(i, 8192, 1) for i in range(16)], 32, 8, 128, 8256, 1, 16, C, [(264, 32), (528, 64)])
    layered("b64_8k", [(i, 8192, 1) for i in range(64)], 32, 8, 128, 8256, 1, 64, C[:2], [(264, 32), (528, 64)], layers=4)
    layered("mtp1_b64_1k", [(i, 1024, 1) for i in range(64)], 32, 8, 128, 1100, 1, 64, C, [(264, 32), (1056, 32)])
    layered("mtp4_b64_1k", [(i, 1021, 4) for i in range(64)], 32, 8, 128, 1100, 4, 65, C, [(264, 32), (1056, 32)])
    layered("emb_b1_400", [(0, 400, 1)], 9, 3, 64, 480, 1, 1, C[:2], [(264, 32)])
    layered("emb_mtp4_b64_400", [(i, 397, 4) for i in range(64)], 9, 3, 64, 480, 4, 65, C[:2], [(264, 32), (1056, 32)])
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    print("copy GB/s (read+write)", 2 * (1 << 30) / ms / 1e6, flush=True)
    out = os.environ.get("OUT", "/tmp")
    json.dump(res, open(os.path.join(out, "tune_decode2.json"), "w"), indent=1)
