"""Decode plans split by length (eighteenth session) against the static split of 14934c0, in one run on a GPU.

The old kernel module is .ua_static/unified_attention_static.py (carried, or written here by git show
14934c0:lightllm/models/llama/triton_kernel/unified_attention.py). Cases: the serving mix's decode batch
(64 requests, every fifth at 4000 keys, the rest at 150; 1 row or MTP's 4 rows each), all short, all long,
and bench_attention's decode shapes (8B batch 1 and 16 at KV 8192, embedded batch 16 at 6000). Kernel time
per layer over GRAPH_LAYERS layers in one CUDA graph, as bench_attention times decode.
    python docs/data/perf/session18/length_split_sweep.py OUT.json"""
import importlib.util
import json
import os
import subprocess
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import benchmarks.bench_attention as ba  # noqa: E402
import lightllm.models.llama.triton_kernel.unified_attention as new  # noqa: E402

STATIC_COMMIT = "14934c0"
STATIC_PATH = ".ua_static/unified_attention_static.py"
if not os.path.exists(STATIC_PATH):  # the checkout's history has it (a device checkout's .git does too)
    os.makedirs(os.path.dirname(STATIC_PATH), exist_ok=True)
    with open(STATIC_PATH, "w") as f:
        source = f"{STATIC_COMMIT}:lightllm/models/llama/triton_kernel/unified_attention.py"
        f.write(subprocess.run(["git", "show", source], capture_output=True, text=True, check=True).stdout)
spec = importlib.util.spec_from_file_location("ua_static", STATIC_PATH)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
LONG_KEYS, SHORT_KEYS, LONG_EVERY = 4000, 150, 5


def lengths(kind: str, batch: int, kv_len: int) -> torch.Tensor:
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    if kind in ("short", "mixed"):
        lens.fill_(SHORT_KEYS)
    if kind == "mixed":
        lens[::LONG_EVERY] = LONG_KEYS
    return lens


def case_inputs(shape: str, batch: int, q_len: int, kv_len: int, kind: str, gen: torch.Generator):
    """(heads, GRAPH_LAYERS layers' inputs, each request's keys, each row's keys): a request's q_len rows
    end at its length."""
    h = ba.HEAD_SHAPES[shape]
    layers = [ba.make_inputs(ba.Case("decode", h, batch, q_len, kv_len), gen) for _ in range(ba.GRAPH_LAYERS)]
    lens = lengths(kind, batch, kv_len)
    row_len = (lens.repeat_interleave(q_len) - (q_len - 1)
               + torch.arange(q_len, device="cuda", dtype=torch.int32).repeat(batch))
    return h, layers, lens, row_len


def time_layer(mod, layers, h, q_len, batch, row_len, rep_ms: int = 200) -> float:
    x = layers[0]
    plan = mod.plan_attention(x.row_req_idx, row_len, h.q_heads, h.kv_heads, q_len, batch, head_dim=h.head_dim)
    scale = h.head_dim ** -0.5

    def fn():
        return [mod.unified_attention(y.q, y.k_cache, y.v_cache, y.req_to_token, plan, scale) for y in layers]

    ms, _ = ba.time_ms(fn, True, 25, rep_ms)
    return ms / len(layers) * 1e3


def main():
    out = sys.argv[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = ba.measure_copy_gb_s(25, 200)
    rows = []
    cases = [("embedded", 64, q, 4000, k) for q in (1, 4) for k in ("short", "mixed", "long")]
    cases += [("8b", 64, q, 4000, k) for q in (1, 4) for k in ("short", "mixed")]
    cases += [("8b", 1, 1, 8192, "uniform"), ("8b", 16, 1, 8192, "uniform"), ("embedded", 16, 1, 6000, "uniform"),
              ("embedded", 1, 1, 8192, "uniform")]
    for shape, batch, q_len, kv_len, kind in cases:
        h, layers, lens, row_len = case_inputs(shape, batch, q_len, kv_len, kind, gen)
        got = [time_layer(m, layers, h, q_len, batch, row_len) for m in (new, old)]
        x = layers[0]
        scale = h.head_dim ** -0.5
        outs = [m.unified_attention(x.q, x.k_cache, x.v_cache, x.req_to_token,
                                    m.plan_attention(x.row_req_idx, row_len, h.q_heads, h.kv_heads, q_len, batch,
                                                     head_dim=h.head_dim), scale) for m in (new, old)]
        kv = int(lens.sum()) * h.kv_heads * h.head_dim * ba.KV_TENSORS * ba.BF16_BYTES
        r = dict(heads=shape, batch=batch, q_len=q_len, kv_len=kv_len, lengths=kind, length_split_us=got[0],
                 static_split_us=got[1], static_over_length=got[1] / got[0],
                 copy_frac=kv / (got[0] * 1e-3) / 1e6 / copy_bw, static_copy_frac=kv / (got[1] * 1e-3) / 1e6 / copy_bw,
                 max_abs_diff=(outs[0].float() - outs[1].float()).abs().max().item())
        rows.append(r)
        json.dump(rows, open(out, "w"), indent=1)
        print(f"{shape:8s} b{batch:<3d} q{q_len} {kind:8s}: length {got[0]:7.1f} us  static {got[1]:7.1f} us  "
              f"x{r['static_over_length']:.2f}  copy {r['copy_frac']:.2f} vs {r['static_copy_frac']:.2f}  "
              f"diff {r['max_abs_diff']:.1e}", flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
