"""Where a mixed step's time goes: an in-process engine (the embedded model, eagle K = 3 by default)
serves GSM8K prompts at a fixed concurrency, so most steps mix decode rows with prompt chunks.
Prints the wall time per mixed / decode step (CUDA synchronized around each), the host
profile (cProfile) of the mixed and the (not overlapped) decode steps, with ``--trace_steps`` the GPU
kernel time of each kind of step, and writes them as JSON.

    python benchmarks/profile_mixed_step.py --gsm8k .data/test.jsonl --out mixed_profile.json
"""
import argparse
import bisect
import cProfile
import io
import json
import os
import pstats
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402
from lightllm.server.offline_engine import OfflineEngine  # noqa: E402
from lightllm.tools.client import auto_max_req_total_len, model_dir_or_embedded  # noqa: E402

PROFILE_ROWS = 30  # functions printed
TRACE_FROM = 50  # the mixed step torch.profiler starts at by default (past the start-up's odd shapes)
TRACE_MAX_FACTOR = 8  # the trace stops after this many times --trace_steps engine steps in all
STEP_KINDS = ("mixed", "prefill", "decode")
STEP_RANGE_PREFIX = "engine_step:"
KERNEL_NAME_WIDTH = 90


def _timed(fn, clock, sync, profile=None):
    def wrapper(*a, **kw):
        sync()
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return fn(*a, **kw)
        finally:
            if profile is not None:
                profile.disable()
            sync()
            clock.append(time.perf_counter() - t0)
    return wrapper


class _StepTracer:
    """torch.profiler over ``n`` engine steps of each kind from the ``start``-th mixed step on:
    each step runs in a ``record_function`` range and ends synchronized, so a kernel belongs to
    the step whose range holds its start; GPU kernel time and wall per step, by kind."""

    def __init__(self, n: int, mixed_clock: list, start: int = TRACE_FROM):
        self.n, self.mixed_clock, self.start, self.prof = n, mixed_clock, start, None
        self.walls = {k: [] for k in STEP_KINDS}
        self.done = False

    def wrap(self, step, kind_of):
        def traced(running, *a, **kw):
            kind = kind_of(running)
            if self.done or len(self.mixed_clock) < self.start:
                return step(running, *a, **kw)
            import torch
            if self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                acts += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"{STEP_RANGE_PREFIX}{kind}"):
                out = step(running, *a, **kw)
            self.walls[kind].append(time.perf_counter() - t0)
            if all(len(self.walls[k]) >= self.n for k in ("mixed", "decode")) or \
                    sum(map(len, self.walls.values())) >= TRACE_MAX_FACTOR * self.n:
                self.prof.stop()
                self.done = True
            return out
        return traced

    def report(self):
        if not self.done:
            return None
        import torch

        cuda = torch.autograd.DeviceType.CUDA
        events = list(self.prof.events())
        ranges = sorted((e.time_range.start, e.time_range.end, e.name[len(STEP_RANGE_PREFIX):]) for e in events
                        if e.device_type != cuda and e.name.startswith(STEP_RANGE_PREFIX))
        starts = [r[0] for r in ranges]
        gpu_us = {k: 0.0 for k in STEP_KINDS}
        by_name = {k: {} for k in STEP_KINDS}
        for e in events:
            if e.device_type != cuda or e.name.startswith(STEP_RANGE_PREFIX):  # kernels only, not the ranges
                continue
            i = bisect.bisect_right(starts, e.time_range.start) - 1
            if i < 0 or e.time_range.start > ranges[i][1]:
                continue
            kind, dur = ranges[i][2], e.time_range.end - e.time_range.start
            gpu_us[kind] += dur
            by_name[kind][e.name] = by_name[kind].get(e.name, 0.0) + dur
        out = {}
        for k in STEP_KINDS:
            steps = len(self.walls[k])
            if not steps:
                continue
            top = sorted(by_name[k].items(), key=lambda kv: -kv[1])[:PROFILE_ROWS]
            out[k] = {"steps": steps, "gpu_ms_per_step": gpu_us[k] / 1000 / steps,
                      "wall_ms_per_step": 1000 * sum(self.walls[k]) / steps,
                      "kernels_us_per_step": [[name[:KERNEL_NAME_WIDTH], us / steps] for name, us in top]}
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gsm8k", required=True)
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--prompt_tokens", type=int, default=0,
                   help="prompts of exactly this many tokens (the long-context wave: 16 x 6000), not GSM8K chats")
    p.add_argument("--long_every", type=int, default=0,
                   help="every this many GSM8K prompts, one of --long_tokens tokens instead (the serving mix: 5)")
    p.add_argument("--long_tokens", type=int, default=3000)
    p.add_argument("--batch_max_tokens", type=int, default=0, help="the chunk budget (0: the engine's default)")
    p.add_argument("--disable_mixed_steps", action="store_true", help="the alternating schedule, for comparison")
    p.add_argument("--prompt_cache", action="store_true",
                   help="keep the prompt cache on, as a server runs (the warm-up's prompts then hit it)")
    p.add_argument("--trace_steps", type=int, default=0,
                   help="also record this many mixed and decode steps (from the --trace_from-th mixed one) with "
                        "torch.profiler: GPU time per step by kind and kernel")
    p.add_argument("--trace_from", type=int, default=TRACE_FROM, help="the mixed step the trace starts at")
    p.add_argument("--attention_calls", type=int, default=0, metavar="N",
                   help="eager (no CUDA graphs): after the run, each attention call of the N-th mixed step and of the "
                        "N-th decode step replayed alone and timed, beside its plan")
    p.add_argument("--model_dir", default=None, help="default: the embedded model")
    p.add_argument("--load_format", default="auto", help="dummy: random weights of the model's shape (step timing)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from lightllm.tools.prompts import chat_prompt_ids

    model_dir = model_dir_or_embedded(args.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(args.gsm8k) as f:
        questions = [json.loads(line)["question"] for line in f]
    if args.prompt_tokens or args.long_every:
        from benchmarks.bench_e2e_throughput import chat_template_ends, exact_length_prompt

        ends = chat_template_ends(tok)
    if args.prompt_tokens:
        prompts = [exact_length_prompt(tok, args.prompt_tokens, questions, j, ends) for j in range(args.num_prompts)]
    else:
        prompts = chat_prompt_ids(tok, questions[:args.num_prompts])
    if args.long_every:
        prompts = [exact_length_prompt(tok, args.long_tokens, questions, j, ends) if j % args.long_every == 0 else x
                   for j, x in enumerate(prompts)]
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=args.mtp_step) if args.mtp_step else {}
    max_len = auto_max_req_total_len([len(x) for x in prompts], args.max_new_tokens)
    start = StartArgs(model_dir=model_dir, load_format=args.load_format,
                      running_max_req_size=args.concurrency, max_req_total_len=max(1024, max_len),
                      disable_mixed_steps=args.disable_mixed_steps,
                      **({"batch_max_tokens": args.batch_max_tokens} if args.batch_max_tokens else {}),
                      disable_dynamic_prompt_cache=not args.prompt_cache,  # default: prefill every prompt
                      disable_cudagraph=bool(args.attention_calls), **mtp)
    on_gpu = torch.cuda.is_available()  # CPU: a smoke run of the script (no performance number)
    eng = OfflineEngine(start, device="cuda" if on_gpu else "cpu", dtype="bfloat16" if on_gpu else "float32")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    warm = [{"max_new_tokens": 8}] * min(len(prompts), args.concurrency)
    eng.generate(prompts[:len(warm)], warm)
    clocks = {"mixed": [], "decode": [], "prefill": []}
    profiles = {"mixed": cProfile.Profile(), "decode": cProfile.Profile()}
    b = eng.backend
    b.mixed = _timed(b.mixed, clocks["mixed"], sync, profiles["mixed"])
    attention_calls = {"mixed": [], "decode": []}  # --attention_calls: the N-th step of each kind
    b.decode = _timed(b.decode, clocks["decode"], sync, profiles["decode"])
    b.prefill_chunks = _timed(b.prefill_chunks, clocks["prefill"], sync)
    # every engine step, by what it ran (overlapped decode steps run outside b.decode)
    step_clocks = {k: [] for k in STEP_KINDS}
    decode_reqs = []  # requests per decode step
    run_step = b.run_step

    def kind_of(running) -> str:
        prefilling = any(r.in_prefill for r in running)
        decoding = any(not r.in_prefill for r in running)
        return "mixed" if prefilling and decoding and b.mixed_rows is not None else (
            "prefill" if prefilling and not decoding else "decode")

    counts = {k: 0 for k in STEP_KINDS}

    def timed_step(running, *a, **kw):
        kind = kind_of(running)
        if kind == "decode":
            decode_reqs.append(sum(not r.in_prefill and r.finish_reason is None for r in running))
        counts[kind] += 1
        if args.attention_calls and counts[kind] == args.attention_calls and kind in attention_calls:
            from benchmarks.profile_decode_step import recording_attention

            with recording_attention(attention_calls[kind]):
                return _timed(run_step, step_clocks[kind], sync)(running, *a, **kw)
        return _timed(run_step, step_clocks[kind], sync)(running, *a, **kw)

    b.run_step = timed_step
    tracer = _StepTracer(args.trace_steps, step_clocks["mixed"], args.trace_from) if args.trace_steps else None
    if tracer is not None:
        b.run_step = tracer.wrap(timed_step, kind_of)
    t0 = time.perf_counter()
    res = eng.generate(prompts, [{"max_new_tokens": args.max_new_tokens, "ignore_eos": bool(args.prompt_tokens)}]
                       * len(prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in res)
    host_profiles = {}
    for kind, prof in profiles.items():
        if clocks[kind]:  # pstats refuses a profile that never ran
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(PROFILE_ROWS)
            host_profiles[kind] = s.getvalue()
    summary = {k: {"steps": len(v), "ms_mean": 1000 * sum(v) / max(1, len(v))} for k, v in clocks.items()}
    by_step = {k: {"steps": len(v), "ms_mean": 1000 * sum(v) / max(1, len(v)), "s_total": sum(v)}
               for k, v in step_clocks.items()}
    mean_decode_batch = sum(decode_reqs) / max(1, len(decode_reqs))
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s); {summary}")
    print(f"engine steps (synchronized, by kind): {by_step}; mean decode batch {mean_decode_batch:.1f}")
    for kind, text in host_profiles.items():
        print(f"host profile of the {kind} steps (cProfile):\n{text}")
    if args.attention_calls:
        from benchmarks.profile_decode_step import print_attention_calls

        attention_calls = {kind: print_attention_calls(calls, f"{kind} step {args.attention_calls}")
                           for kind, calls in attention_calls.items() if calls}
    trace = tracer.report() if tracer is not None else None
    for kind, t in (trace or {}).items():
        print(f"traced {kind} steps: {t['steps']}, GPU kernel time per step {t['gpu_ms_per_step']:.2f} ms, "
              f"wall per step {t['wall_ms_per_step']:.2f} ms")
        for name, us in t["kernels_us_per_step"]:
            print(f"  {us:9.1f} us  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "wall_s": wall, "steps": summary, "engine_steps": by_step,
                       "mean_decode_batch": mean_decode_batch, "host_profiles": host_profiles, "trace": trace,
                       "attention_calls": attention_calls},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
