"""Profile decode steps of the in-process engine (torch.profiler): where a step's time goes.

    python benchmarks/profile_decode_step.py --batch 256 [--mtp_step 3] [--disable_cudagraph]
        [--enable_deterministic_inference] [--rows 0] [--prefill] [--ranges] [--attention_calls]

``--rows 0`` prints only the step time (no profiler tables). ``--prefill``: one request at a
time, prefill only (``max_new_tokens`` 1), a request's whole time in the router from admission
to its finish, ``--batch`` prompts in a row.
"""
import argparse
import contextlib
import dataclasses
import itertools
import time
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from lightllm.server.router.manager import AddReq

PROMPT_LEN = 64
DECODE_TOKENS = 900  # new tokens per request: more than any run's steps
LEN_HEADROOM = 1024  # --max_req_total_len past the prompt
ATTN_WARMUP_MS, ATTN_REP_MS = 10, 50  # --attention_calls: do_bench per call


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--mtp_mode", default="eagle_with_att", help="the draft with --mtp_step above 0")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--disable_cudagraph", action="store_true")
    p.add_argument("--enable_deterministic_inference", action="store_true")
    p.add_argument("--disable_overlap_schedule", action="store_true")
    p.add_argument("--mtp_overlap", action="store_true",
                   help="with MTP: launch each step before the previous one is committed (the overlap schedule, "
                        "which the engine runs for plain decoding only), to measure it")
    p.add_argument("--model_dir", default=None)
    p.add_argument("--load_format", default="auto")
    p.add_argument("--prefill", action="store_true", help="profile one-request prefills, not decode steps")
    p.add_argument("--prompt_len", type=int, default=PROMPT_LEN)
    p.add_argument("--graph_max_prefill_tokens", type=int, default=StartArgs.graph_max_prefill_tokens)
    p.add_argument("--ranges", action="store_true",
                   help="record_function ranges around the decode step's parts (the target forward, the draft, "
                        "launch_finish, the wait for the packed copy) in the profile tables: each range's CPU time "
                        "and the GPU time of the kernels it launched (a graph replay's included)")
    p.add_argument("--attention_calls", action="store_true",
                   help="with --disable_cudagraph: after the profile, each attention call of one more step "
                        "replayed alone and timed, beside its plan (tile rows, rows a block, split kind, programs)")
    a = p.parse_args()
    if a.attention_calls and not a.disable_cudagraph:
        p.error("--attention_calls needs --disable_cudagraph (a graph replay makes no calls to record)")
    if a.ranges:
        add_step_ranges()
    mtp = dict(mtp_mode=a.mtp_mode, mtp_step=a.mtp_step) if a.mtp_step else {}
    eng = OfflineEngine(StartArgs(model_dir=a.model_dir, load_format=a.load_format, running_max_req_size=a.batch,
                                  max_req_total_len=a.prompt_len + LEN_HEADROOM,
                                  batch_max_tokens=max(65536, a.prompt_len + LEN_HEADROOM),
                                  disable_cudagraph=a.disable_cudagraph, graph_max_prefill_tokens=a.graph_max_prefill_tokens,
                                  disable_dynamic_prompt_cache=True,
                                  enable_deterministic_inference=a.enable_deterministic_inference,
                                  disable_overlap_schedule=a.disable_overlap_schedule, **mtp))
    router = eng.router
    if a.mtp_overlap:
        router.backend.overlap_schedule = True
    if a.prefill:
        return profile_prefill(router, a)
    sp = SamplingParams.from_request({"max_new_tokens": DECODE_TOKENS, "ignore_eos": True})
    for i in range(a.batch):
        router.add_req(AddReq(i, prompt_ids(i, a.prompt_len), sp, [], 0.0))
    for _ in range(5):  # prefill + warm-up decode steps
        router.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        router.step()
    sync()
    graphs = "eager" if a.disable_cudagraph else "graphs"
    graphs += ", deterministic" if a.enable_deterministic_inference else ""
    graphs += ", no overlap" if a.disable_overlap_schedule else ""
    graphs += ", MTP overlap" if a.mtp_overlap else ""
    print(f"batch {a.batch} K {a.mtp_step}{' ' + a.mtp_mode if a.mtp_step else ''} {graphs}: {(time.perf_counter() - t0) / a.steps * 1e3:.2f} ms per decode step")
    print_profile(lambda: router.step(), a.rows)
    if a.attention_calls:
        with recording_attention([]) as calls:
            router.step()
            sync()
        print_attention_calls(calls)


# DecodeStep methods -> their profiler range (``--ranges``); launch_finish holds the sampler, verify, pack and
# the draft, so "step.finish" minus "step.draft" is the eager part
STEP_RANGES = (("forward", "step.target"), ("launch_finish", "step.finish"), ("_propose", "step.draft"),
               ("wait", "step.wait"))


def add_step_ranges() -> None:
    """Wrap DecodeStep's parts in record_function ranges (this process only: the engine runs none)."""
    from lightllm.server.router.model_infer.decode_step import DecodeStep

    for name, label in STEP_RANGES:
        def ranged(self, *args, _fn=getattr(DecodeStep, name), _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _fn(self, *args, **kwargs)
        setattr(DecodeStep, name, ranged)


def plan_label(plan) -> str:
    """An attention plan in a few words: tile rows, query rows a block, how it splits, its grid's first dim."""
    blocks = int((plan.block_first_row >= 0).sum())
    if plan.work is not None:
        kind, programs = "length", plan.work.shape[0]
        kind += f" items {int((plan.work[:, 0] >= 0).sum())} max_split {int(plan.work[:, 2].max())}"
    else:
        kind = "dynamic" if plan.dynamic_splits else "none"
        programs = max(plan.block_first_row.shape[0], plan.dynamic_programs)
    return (f"bm{plan.block_m} bq{plan.block_q} {kind} x{programs} rows{plan.row_req_idx.shape[0]} "
            f"blocks {blocks} max_len {int(plan.row_seq_len.max())}")


@dataclasses.dataclass
class AttentionCall:
    index: int  # in the step
    label: str
    args: tuple  # unified_attention's (q, k_cache, v_cache, req_to_token, plan, sm_scale), kept alive


@contextlib.contextmanager
def recording_attention(calls: List[AttentionCall]):
    """Within it, every attention call's inputs are kept in ``calls`` (eager runs only; this process only). The
    plan's tensors (views of the step's persistent row buffers, which later steps overwrite) and the slot table
    are copied as the call saw them; q is the call's own; the KV caches are kept as they are (later steps change
    their values, not which slots a call reads)."""
    import lightllm.models.llama.layer_infer.attention_backends as ab

    inner = ab.unified_attention
    tables = {}  # the slot table, copied once per recording

    def recording(q, k_cache, v_cache, req_to_token, plan, sm_scale, out=None):
        table = tables.setdefault(id(req_to_token), req_to_token.clone())
        kept = dataclasses.replace(plan, **{f.name: getattr(plan, f.name).clone() for f in dataclasses.fields(plan)
                                            if isinstance(getattr(plan, f.name), torch.Tensor)})
        calls.append(AttentionCall(len(calls), plan_label(plan), (q.clone(), k_cache, v_cache, table, kept, sm_scale)))
        return inner(q, k_cache, v_cache, req_to_token, plan, sm_scale, out)

    ab.unified_attention = recording
    try:
        yield calls
    finally:
        ab.unified_attention = inner


def decode_twin(q, k_cache, v_cache, req_to_token, plan, sm_scale) -> Optional[tuple]:
    """A mixed step's decode-head call (a split-by-length plan over the forward's first rows only) as a decode
    step would run those rows: their own tensors, planned by ``plan_attention`` alone; None for other calls."""
    from lightllm.models.llama.triton_kernel.unified_attention import plan_attention

    if plan.work is None:
        return None
    n = int(plan.block_first_row.max()) + plan.block_q  # the head's rows
    if n >= q.shape[0]:
        return None
    kv_heads = k_cache.shape[1]
    twin = plan_attention(plan.row_req_idx[:n], plan.row_seq_len[:n], q.shape[1], kv_heads, plan.block_q,
                          n // plan.block_q + 1, head_dim=q.shape[2])
    return q[:n].contiguous(), k_cache, v_cache, req_to_token, twin, sm_scale


def print_attention_calls(calls: List[AttentionCall], what: str = "one step") -> List[dict]:
    """Each recorded attention call replayed alone (its plan, q and slot table as the call saw them, the KV cache
    as the run left it), timed as bench_attention times a case (a CUDA graph, do_bench's median)."""
    from benchmarks.bench_attention import time_ms
    from lightllm.models.llama.triton_kernel.unified_attention import unified_attention

    rows = []
    print(f"attention calls of {what} ({len(calls)}): index, plan, us; a mixed step's decode head: us as a decode "
          "step plans its rows")
    for c in calls:
        us = 1e3 * time_ms(lambda: unified_attention(*c.args), True, ATTN_WARMUP_MS, ATTN_REP_MS)[0]
        twin = decode_twin(*c.args)
        twin_us = 1e3 * time_ms(lambda: unified_attention(*twin), True, ATTN_WARMUP_MS, ATTN_REP_MS)[0] if twin else None
        rows.append(dict(index=c.index, plan=c.label, us=us, as_decode_plan_us=twin_us))
        print(f"  #{c.index:02d} {c.label:90s} {us:8.1f} {'' if twin_us is None else f'{twin_us:8.1f}'}")
    print(f"  sum {sum(r['us'] for r in rows):.1f} us")
    return rows


def prompt_ids(i: int, n: int):
    return [(i * 7 + j) % 1000 + 10 for j in range(n)]


def profile_prefill(router, a) -> None:
    sp = SamplingParams.from_request({"max_new_tokens": 1, "ignore_eos": True})
    count = itertools.count()

    def one() -> None:
        i = next(count)  # request id and prompt
        router.add_req(AddReq(i, prompt_ids(i, a.prompt_len), sp, [], 0.0))
        while router.has_work:
            router.step()

    for _ in range(3):
        one()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.batch):
        one()
    sync()
    ms = (time.perf_counter() - t0) / a.batch * 1e3
    print(f"prefill of {a.prompt_len} tokens, K {a.mtp_step}, graph_max_prefill_tokens {a.graph_max_prefill_tokens}: "
          f"{ms:.2f} ms per request (admission to finish)")
    print_profile(one, a.rows)


def print_profile(run, rows: int) -> None:
    if rows == 0:
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
