"""Attention kernel benchmark: lightllm's unified_attention against PyTorch SDPA's flash backend, same shapes.

Cases, bf16, for each head shape (the 8B shape: 32 query / 8 KV heads of 128; the embedded model's
9 / 3 heads of 64):

- ``prefill``: one request of n new tokens (n = 8192, 2048, 512), causal. FLOPs =
  4 * q_heads * head_dim * n (n + 1) / 2: QK^T and PV are head_dim multiply-adds (2 FLOPs each)
  per (query, key) pair the causal mask keeps, and there are n (n + 1) / 2 such pairs (generally:
  ``attended_pairs``). TFLOP/s = FLOPs / time, for both; ``vs_sdpa`` = sdpa_ms / engine_ms.
- ``decode``: batch b requests of one row each over kv_len positions. KV bytes read =
  b * kv_len * kv_heads * head_dim * 2 (K and V) * 2 (bytes per bf16); GB/s = bytes / time, and
  ``copy_frac`` = that over the device-to-device copy bandwidth measured in the same run
  (``dst.copy_(src)`` of COPY_BYTES, counting the bytes read and written). SDPA: q length 1
  against contiguous K/V.
- ``mtp_rows``: batch 64 over KV 1024, K + 1 = 4 rows per request (row_seq_len L-3..L);
  ``vs_one_row`` = its time over the decode case of 1 row per request at the same batch and KV.
  SDPA: the flash backend with a bottom-right causal mask (``causal_lower_right``).
- ``chunk``: one request's next chunk of q new tokens over a cached prefix (kv_len keys in all), as a
  mixed step or a later prefill chunk runs it: (q, kv) in CHUNK_SHAPES; FLOPs and TFLOP/s as for
  prefill, SDPA bottom-right causal. Timed as the decode cases (GRAPH_LAYERS layers in a graph).

The engine's KV cache is a random permutation of slots (a non-contiguous slot table, wider than
the longest request, like a real cache after churn; ``--slots contiguous``: each request's slots in order,
a fresh cache, so the two runs tell the gather's cost from the kernel's); SDPA reads the same values
gathered into contiguous
[batch, kv_heads, seq, head_dim] tensors, with ``enable_gqa=True`` (or K/V repeated per query
head before timing, where this torch's flash backend refuses GQA: ``sdpa_gqa`` says which).

Timing: ``triton.testing.do_bench`` (median; the L2 cache is flushed before every call). Decode
and MTP cases run as a decode step does: GRAPH_LAYERS layers back to back, each over its own KV
cache (so the L2, which holds a batch-1 8B KV of 8192 positions, 32 MiB, never serves the next
layer), captured as one CUDA graph; the time is the replay's over GRAPH_LAYERS, so one graph
launch is shared by the layers as in the engine. The plan is built once,
outside the timed region; ``plan_ms`` is its own host time (synchronized, median of PLAN_REPEATS).
``max_abs_diff`` = max |engine - SDPA| per case, printed and written, not asserted: a wrong
kernel cannot look fast unnoticed. ``target``/``met``: issue 25's goals (8B shape only).

The KV-reading cases (decode, mtp_rows) also time a bare read of the same caches (``read_floor.py``: each
layer's K and V streamed once by one kernel, the fastest of READ_PROGRAMS_PER_SM grids), graphed the same way:
``floor_ms``, its ``floor_copy_frac``, and ``vs_floor`` = floor_ms / engine_ms (1.0: the attention call costs
what reading its bytes does).

    python benchmarks/bench_attention.py              # writes docs/data/perf/attention.json
    python benchmarks/bench_attention.py --quick --out /tmp/attention.json   # a short smoke run
"""
import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):  # run as a script from anywhere
    if path not in sys.path:
        sys.path.insert(0, path)

from lightllm.tools.report import Column, render_table, write_json  # noqa: E402 (after the path set-up)

DEFAULT_OUT = os.path.join("docs", "data", "perf", "attention.json")
DTYPE = torch.bfloat16
BF16_BYTES = 2
KV_TENSORS = 2  # K and V
FLOPS_PER_PAIR_PER_DIM = 4  # QK^T and PV: one multiply-add (2 FLOPs) each per head dimension
PREFILL_LENS = (8192, 2048, 512)
DECODE_KV_LEN = 8192
DECODE_BATCHES = (1, 16)
MTP_BATCH = 64
MTP_KV_LEN = 1024
MTP_ROWS = 4  # K + 1 verify rows at K = 3
CHUNK_SHAPES = ((512, 3072), (2048, 4096))  # (new rows, keys in all): a serving mix's long prompt, chunked
SLOT_ORDERS = ("random", "contiguous")  # --slots: the slot table's order (a churned cache, or a fresh one)
SLOT_TABLE_PAD = 64  # extra columns of the slot table past the longest request (its stride is not kv_len)
COPY_BYTES = 1 << 30  # the copy bandwidth's buffer: far larger than the L2
BENCH_WARMUP_MS, BENCH_REP_MS = 25, 200
GRAPH_WARMUP_CALLS = 3
GRAPH_LAYERS = 16  # decode / MTP cases: layers per graph, each with its own KV cache  # eager calls on a side stream before a graph capture (compilation, allocator)
PLAN_REPEATS = 20
# --quick: fewer and smaller cases, shorter timing
QUICK_PREFILL_LENS = (512,)
QUICK_DECODE_KV_LEN = 1024
QUICK_WARMUP_MS, QUICK_REP_MS = 5, 20
# issue 25's goals, on the 8B shape: (case, batch or prefill length) -> (key, comparison, bound)
TARGETS = {("prefill", 8192): ("vs_sdpa", ">=", 0.8), ("decode", 16): ("copy_frac", ">=", 0.75),
           ("decode", 1): ("copy_frac", ">=", 0.5), ("mtp_rows", MTP_BATCH): ("vs_one_row", "<=", 1.3)}
CASE_KINDS = ("prefill", "decode", "mtp_rows", "chunk")
FLOP_KINDS = ("prefill", "chunk")  # compute-bound: TFLOP/s; the others read the KV: GB/s


@dataclass(frozen=True)
class HeadShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


HEAD_SHAPES = {"8b": HeadShape("8b", 32, 8, 128), "embedded": HeadShape("embedded", 9, 3, 64)}


@dataclass(frozen=True)
class Case:
    """``batch`` requests, each with ``q_len`` query rows that end at position ``kv_len`` - 1."""

    kind: str  # one of CASE_KINDS
    heads: HeadShape
    batch: int
    q_len: int
    kv_len: int

    @property
    def rows(self) -> int:
        return self.batch * self.q_len

    @property
    def shape(self) -> str:
        h = self.heads
        return f"{h.q_heads}q/{h.kv_heads}kv x{h.head_dim} b{self.batch} q{self.q_len} kv{self.kv_len}"


def attended_pairs(q_len: int, kv_len: int) -> int:
    """(query, key) pairs of one request whose q_len rows end at position kv_len - 1, causal:
    row i (0-based) sees kv_len - q_len + 1 + i keys. q_len = kv_len = n: n (n + 1) / 2."""
    first = kv_len - q_len + 1
    return q_len * first + q_len * (q_len - 1) // 2


def attention_flops(case: Case) -> int:
    return FLOPS_PER_PAIR_PER_DIM * case.heads.q_heads * case.heads.head_dim * case.batch * attended_pairs(
        case.q_len, case.kv_len)


def kv_bytes(case: Case, elem_bytes: int = BF16_BYTES) -> int:
    """The KV the case's requests read once each: batch * kv_len * kv_heads * head_dim * 2 tensors * bytes."""
    return case.batch * case.kv_len * case.heads.kv_heads * case.heads.head_dim * KV_TENSORS * elem_bytes


def copy_gb_s(nbytes: int, ms: float) -> float:
    """Bandwidth of copying ``nbytes`` in ``ms``: read + write bytes."""
    return 2 * nbytes / ms / 1e6


def tflops(flops: int, ms: float) -> float:
    return flops / ms / 1e9


def gb_s(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def build_cases(kinds: Sequence[str], shapes: Sequence[str], quick: bool) -> List[Case]:
    prefill_lens = QUICK_PREFILL_LENS if quick else PREFILL_LENS
    decode_kv = QUICK_DECODE_KV_LEN if quick else DECODE_KV_LEN
    cases = []
    for name in shapes:
        h = HEAD_SHAPES[name]
        if "prefill" in kinds:
            cases += [Case("prefill", h, 1, n, n) for n in prefill_lens]
        if "decode" in kinds or "mtp_rows" in kinds:  # the MTP ratio needs its 1-row case
            if "decode" in kinds:
                cases += [Case("decode", h, b, 1, decode_kv) for b in DECODE_BATCHES]
            cases.append(Case("decode", h, MTP_BATCH, 1, MTP_KV_LEN))
        if "mtp_rows" in kinds:
            cases.append(Case("mtp_rows", h, MTP_BATCH, MTP_ROWS, MTP_KV_LEN))
        if "chunk" in kinds:
            cases += [Case("chunk", h, 1, q, kv) for q, kv in CHUNK_SHAPES]
    return cases


def row_layout(batch: int, q_len: int, kv_len: int, device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rows, request-major: ``row_req_idx`` [rows] int64 and ``row_seq_len`` [rows]
    int32 (kv_len - q_len + 1 .. kv_len per request)."""
    row_req_idx = torch.arange(batch, dtype=torch.int64, device=device).repeat_interleave(q_len)
    row_seq_len = torch.arange(kv_len - q_len + 1, kv_len + 1, dtype=torch.int32, device=device).repeat(batch)
    return row_req_idx, row_seq_len


def slot_table(batch: int, kv_len: int, gen: torch.Generator, pad: int = SLOT_TABLE_PAD,
               order: str = "random") -> torch.Tensor:
    """[batch, kv_len + pad] int64 on the generator's device: the batch * kv_len slots as a random permutation,
    or (``contiguous``) request b at slots b * kv_len onwards in order; the padding columns hold slot 0, never read."""
    if order not in SLOT_ORDERS:
        raise ValueError(f"slot order {order!r} is not one of {SLOT_ORDERS}")
    table = torch.zeros(batch, kv_len + pad, dtype=torch.int64, device=gen.device)
    slots = batch * kv_len
    used = (torch.randperm(slots, generator=gen, device=gen.device) if order == "random"
            else torch.arange(slots, device=gen.device))
    table[:, :kv_len] = used.view(batch, kv_len)
    return table


def check_target(row: Dict[str, object]) -> Tuple[Optional[str], Optional[bool]]:
    """Issue 25's goal for this row (8B shape only) and whether it is met; (None, None) when none."""
    if row["heads"] != "8b":
        return None, None
    size = row["q_len"] if row["case"] == "prefill" else row["batch"]
    goal = TARGETS.get((row["case"], size))
    if goal is None:
        return None, None
    key, op, bound = goal
    value = row.get(key)
    met = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return f"{key} {op} {bound}", met


def result_row(case: Case, engine_ms: float, sdpa_ms: float, *, plan_ms: float, max_abs_diff: float,
               copy_bw: float, commit: str, timing: str, sdpa_gqa: str, slots: str = "random",
               floor_ms: Optional[float] = None) -> Dict[str, object]:
    """One JSON row: the case, its times and the measures derived from them."""
    row: Dict[str, object] = {
        "case": case.kind, "heads": case.heads.name, "shape": case.shape, "batch": case.batch,
        "q_len": case.q_len, "kv_len": case.kv_len, "engine_ms": engine_ms, "sdpa_ms": sdpa_ms,
        "vs_sdpa": sdpa_ms / engine_ms, "plan_ms": plan_ms, "max_abs_diff": max_abs_diff,
        "timing": timing, "sdpa_gqa": sdpa_gqa, "slots": slots, "commit": commit,
    }
    if case.kind in FLOP_KINDS:
        flops = attention_flops(case)
        row.update(tflops=tflops(flops, engine_ms), sdpa_tflops=tflops(flops, sdpa_ms))
    else:
        nbytes = kv_bytes(case)
        row.update(gb_s=gb_s(nbytes, engine_ms), sdpa_gb_s=gb_s(nbytes, sdpa_ms), copy_gb_s=copy_bw,
                   copy_frac=gb_s(nbytes, engine_ms) / copy_bw)
        if floor_ms is not None:
            row.update(floor_ms=floor_ms, floor_copy_frac=gb_s(nbytes, floor_ms) / copy_bw,
                       vs_floor=floor_ms / engine_ms)
    return row


def add_mtp_ratios(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """``one_row_ms`` and ``vs_one_row`` of each mtp_rows row: its time over the decode row at the
    same heads, batch and KV length; then every row's target."""
    one_row = {(r["heads"], r["batch"], r["kv_len"]): r["engine_ms"] for r in rows if r["case"] == "decode"}
    for r in rows:
        if r["case"] == "mtp_rows":
            base = one_row.get((r["heads"], r["batch"], r["kv_len"]))
            r["one_row_ms"] = base
            r["vs_one_row"] = r["engine_ms"] / base if base else None
        r["target"], r["met"] = check_target(r)
    return rows


COLUMNS = (
    Column("case", "case"), Column("shape", "shape"), Column("engine_ms", "engine ms", ".4f"),
    Column("sdpa_ms", "sdpa ms", ".4f"), Column("vs_sdpa", "x sdpa", ".2f"),
    Column("tflops", "TFLOP/s", ".1f"), Column("sdpa_tflops", "sdpa TFLOP/s", ".1f"),
    Column("gb_s", "GB/s", ".0f"), Column("sdpa_gb_s", "sdpa GB/s", ".0f"), Column("copy_frac", "of copy", ".2f"),
    Column("floor_copy_frac", "read floor of copy", ".2f"), Column("vs_floor", "x floor", ".2f"),
    Column("vs_one_row", "x 1 row", ".2f"), Column("plan_ms", "plan ms", ".3f"),
    Column("max_abs_diff", "max |diff|", ".2e"), Column("target", "target"),
    Column("met", "met", lambda v: "yes" if v else "NO"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results path (a list of rows)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: prefill {QUICK_PREFILL_LENS}, decode KV {QUICK_DECODE_KV_LEN}, short timing")
    p.add_argument("--cases", nargs="+", default=list(CASE_KINDS), choices=CASE_KINDS)
    p.add_argument("--shapes", nargs="+", default=list(HEAD_SHAPES), choices=list(HEAD_SHAPES))
    p.add_argument("--deterministic", action="store_true", help="the kernel's batch-invariant plans")
    p.add_argument("--no_graphs", action="store_true", help="time decode and MTP cases eagerly too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", default="random", choices=SLOT_ORDERS,
                   help="the KV slot table: a random permutation (a cache after churn; the default) or each "
                        "request's slots in order (a fresh cache)")
    return p.parse_args(argv)


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO_ROOT).stdout.strip()


def require_cuda() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_attention.py: TRITON_INTERPRET=1 is set; unset it to benchmark compiled kernels.")
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to run on CPU.")


# --- the GPU part -----------------------------------------------------------------------------

@dataclass
class Inputs:
    q: torch.Tensor  # [rows, q_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots, kv_heads, head_dim]
    req_to_token: torch.Tensor  # [batch, kv_len + SLOT_TABLE_PAD] int64
    row_req_idx: torch.Tensor  # [rows] int64
    row_seq_len: torch.Tensor  # [rows] int32
    q4: torch.Tensor  # SDPA's query [batch, q_heads, q_len, head_dim]
    k4: torch.Tensor  # SDPA's keys [batch, kv_heads, kv_len, head_dim], contiguous
    v4: torch.Tensor  # [batch, kv_heads, kv_len, head_dim]


def make_inputs(case: Case, gen: torch.Generator, slots: str = "random") -> Inputs:
    """The case's tensors on the generator's device, the engine's and SDPA's holding the same values."""
    h, device = case.heads, gen.device
    table = slot_table(case.batch, case.kv_len, gen, order=slots)
    slots = case.batch * case.kv_len
    k_cache, v_cache = (torch.randn(slots, h.kv_heads, h.head_dim, generator=gen, device=device, dtype=DTYPE)
                        for _ in range(KV_TENSORS))
    q4 = torch.randn(case.batch, h.q_heads, case.q_len, h.head_dim, generator=gen, device=device, dtype=DTYPE)
    row_req_idx, row_seq_len = row_layout(case.batch, case.q_len, case.kv_len, device)
    positions = table[:, :case.kv_len]  # [batch, kv_len] slots
    return Inputs(
        q=q4.transpose(1, 2).reshape(case.rows, h.q_heads, h.head_dim).contiguous(),  # request-major rows
        k_cache=k_cache, v_cache=v_cache, req_to_token=table, row_req_idx=row_req_idx, row_seq_len=row_seq_len,
        q4=q4, k4=k_cache[positions].transpose(1, 2).contiguous(), v4=v_cache[positions].transpose(1, 2).contiguous(),
    )


def sdpa_fn(case: Case, x: Inputs) -> Tuple[Callable[[], torch.Tensor], str]:
    """SDPA's flash backend over the contiguous K/V, causal bottom-right; and how it does GQA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = None if case.q_len == 1 or case.q_len == case.kv_len else causal_lower_right(case.q_len, case.kv_len)
    causal = case.q_len == case.kv_len and case.q_len > 1
    group = case.heads.q_heads // case.heads.kv_heads

    def call(k, v, enable_gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(x.q4, k, v, attn_mask=mask, is_causal=causal, enable_gqa=enable_gqa)

    try:
        call(x.k4, x.v4, True)
        return (lambda: call(x.k4, x.v4, True)), "enable_gqa"
    except RuntimeError:  # this torch's flash backend takes no GQA: repeat K/V per query head, outside the timing
        k, v = x.k4.repeat_interleave(group, dim=1), x.v4.repeat_interleave(group, dim=1)
        return (lambda: call(k, v, False)), "repeat_interleave"


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once as a CUDA graph: the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(GRAPH_WARMUP_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(fn: Callable[[], object], use_graph: bool, warmup_ms: int, rep_ms: int) -> Tuple[float, str]:
    """Median ms of ``fn`` by do_bench (L2 flushed), over its CUDA graph when asked and capturable."""
    from triton.testing import do_bench

    mode = "do_bench"
    if use_graph:
        try:
            fn, mode = graphed(fn), "do_bench(graph)"
        except RuntimeError as e:
            print(f"  (CUDA graph capture failed, timing eagerly: {e})", flush=True)
            torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"), mode


def host_ms(fn: Callable[[], object], repeats: int = PLAN_REPEATS) -> float:
    """Median wall ms of ``fn``, synchronized before and after."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure_copy_gb_s(warmup_ms: int, rep_ms: int) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), False, warmup_ms, rep_ms)
    return copy_gb_s(COPY_BYTES, ms)


def bench_case(case: Case, args, gen: torch.Generator, copy_bw: float, commit: str) -> Dict[str, object]:
    from lightllm.models.llama.triton_kernel.unified_attention import plan_attention, unified_attention

    h = case.heads
    use_graph = case.kind != "prefill" and not args.no_graphs
    layers = [make_inputs(case, gen, args.slots) for _ in range(GRAPH_LAYERS if use_graph else 1)]
    x = layers[0]
    sm_scale = 1.0 / math.sqrt(h.head_dim)

    def plan():
        return plan_attention(x.row_req_idx, x.row_seq_len, q_heads=h.q_heads, kv_heads=h.kv_heads,
                              max_q_len=case.q_len, max_seqs=case.batch, deterministic=args.deterministic,
                              head_dim=h.head_dim)

    built = plan()
    plan_ms = host_ms(plan)

    def engine_layer(y: Inputs):
        return unified_attention(y.q, y.k_cache, y.v_cache, y.req_to_token, built, sm_scale)

    sdpa_layers = [sdpa_fn(case, y) for y in layers]
    gqa = sdpa_layers[0][1]
    reference = sdpa_layers[0][0]().transpose(1, 2).reshape(case.rows, h.q_heads, h.head_dim)  # request-major
    diff = (engine_layer(x).float() - reference.float()).abs().max().item()

    def engine():
        return [engine_layer(y) for y in layers]

    def sdpa():
        return [fn() for fn, _ in sdpa_layers]

    engine_ms, timing = time_ms(engine, use_graph, args.warmup_ms, args.rep_ms)
    sdpa_ms, _ = time_ms(sdpa, use_graph, args.warmup_ms, args.rep_ms)
    engine_ms, sdpa_ms = engine_ms / len(layers), sdpa_ms / len(layers)
    floor_ms = None
    if case.kind not in FLOP_KINDS:
        floor_ms = read_floor_ms(layers, use_graph, args.warmup_ms, args.rep_ms)
    if len(layers) > 1:
        timing += f" of {len(layers)} layers, per layer"
    return result_row(case, engine_ms, sdpa_ms, plan_ms=plan_ms, max_abs_diff=diff, copy_bw=copy_bw,
                      commit=commit, timing=timing, sdpa_gqa=gqa, slots=args.slots, floor_ms=floor_ms)


def read_floor_ms(layers: Sequence[Inputs], use_graph: bool, warmup_ms: int, rep_ms: int) -> float:
    """Per layer, the fastest bare read of each layer's K and V caches (read_floor.py), over READ_PROGRAMS_PER_SM."""
    from read_floor import READ_PROGRAMS_PER_SM, read_kv

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = math.inf
    for per_sm in READ_PROGRAMS_PER_SM:
        outs = [torch.empty(per_sm * sms, dtype=torch.float32, device="cuda") for _ in layers]
        ms, _ = time_ms(lambda: [read_kv(y.k_cache, y.v_cache, o) for y, o in zip(layers, outs)], use_graph,
                        warmup_ms, rep_ms)
        best = min(best, ms / len(layers))
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda()
    args.warmup_ms, args.rep_ms = (QUICK_WARMUP_MS, QUICK_REP_MS) if args.quick else (BENCH_WARMUP_MS, BENCH_REP_MS)
    commit = git_commit()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    copy_bw = measure_copy_gb_s(args.warmup_ms, args.rep_ms)
    print(f"{torch.cuda.get_device_name()} | commit {commit} | device-to-device copy {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for case in build_cases(args.cases, args.shapes, args.quick):
        print(f"{case.kind} {case.shape} ...", flush=True)
        rows.append(bench_case(case, args, gen, copy_bw, commit))
        torch.cuda.empty_cache()
    add_mtp_ratios(rows)
    print(render_table(rows, COLUMNS))
    write_json(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
