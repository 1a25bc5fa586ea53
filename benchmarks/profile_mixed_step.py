"""Where a mixed step's time goes: an in-process engine (the embedded model, eagle K = 3 by default)
serves GSM8K prompts at a fixed concurrency, so most steps mix decode rows with prompt chunks.
Prints the wall time per mixed / decode step (CUDA synchronized around each) and the host
profile (cProfile) of the mixed steps, and writes them as JSON.

    python benchmarks/profile_mixed_step.py --gsm8k .data/test.jsonl --out mixed_profile.json
"""
import argparse
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
TRACE_FROM = 50  # the first mixed step torch.profiler records (past the start-up's odd shapes)


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


class _MixedStepTracer:
    """torch.profiler around mixed steps TRACE_FROM .. TRACE_FROM + n: their kernels' GPU time."""

    def __init__(self, n: int, mixed_clock: list):
        self.n, self.clock, self.prof, self.walls = n, mixed_clock, None, []

    def wrap(self, step):
        def traced(running, *a, **kw):
            before = len(self.clock)
            on = TRACE_FROM <= before < TRACE_FROM + self.n
            if on and self.prof is None:
                import torch
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            out = step(running, *a, **kw)
            if on and len(self.clock) > before:
                self.walls.append(self.clock[-1])
                if len(self.walls) == self.n:
                    self.prof.stop()
            return out
        return traced

    def report(self):
        if self.prof is None or len(self.walls) < self.n:
            return None
        import torch

        events = self.prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in kernels)
        try:
            table = events.table(sort_by="self_cuda_time_total", row_limit=PROFILE_ROWS)
        except Exception:  # noqa: BLE001 - the sort key's name moved between torch versions
            table = events.table(sort_by="self_device_time_total", row_limit=PROFILE_ROWS)
        return {"steps": self.n, "gpu_ms_per_step": gpu_us / 1000 / self.n,
                "wall_ms_per_step": 1000 * sum(self.walls) / self.n, "table": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gsm8k", required=True)
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--prompt_tokens", type=int, default=0,
                   help="prompts of exactly this many tokens (the long-context wave: 16 x 6000), not GSM8K chats")
    p.add_argument("--disable_mixed_steps", action="store_true", help="the alternating schedule, for comparison")
    p.add_argument("--prompt_cache", action="store_true",
                   help="keep the prompt cache on, as a server runs (the warm-up's prompts then hit it)")
    p.add_argument("--trace_steps", type=int, default=0,
                   help="also record this many mixed steps (from the TRACE_FROM-th) with torch.profiler: GPU time by kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from lightllm.tools.prompts import chat_prompt_ids

    model_dir = model_dir_or_embedded(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(args.gsm8k) as f:
        questions = [json.loads(line)["question"] for line in f]
    if args.prompt_tokens:
        from benchmarks.bench_e2e_throughput import chat_template_ends, exact_length_prompt

        ends = chat_template_ends(tok)
        prompts = [exact_length_prompt(tok, args.prompt_tokens, questions, j, ends) for j in range(args.num_prompts)]
    else:
        prompts = chat_prompt_ids(tok, questions[:args.num_prompts])
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=args.mtp_step) if args.mtp_step else {}
    max_len = auto_max_req_total_len([len(x) for x in prompts], args.max_new_tokens)
    start = StartArgs(running_max_req_size=args.concurrency, max_req_total_len=max(1024, max_len),
                      disable_mixed_steps=args.disable_mixed_steps,
                      disable_dynamic_prompt_cache=not args.prompt_cache,  # default: prefill every prompt
                      **mtp)
    on_gpu = torch.cuda.is_available()  # CPU: a smoke run of the script (no performance number)
    eng = OfflineEngine(start, device="cuda" if on_gpu else "cpu", dtype="bfloat16" if on_gpu else "float32")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    warm = [{"max_new_tokens": 8}] * min(len(prompts), args.concurrency)
    eng.generate(prompts[:len(warm)], warm)
    clocks = {"mixed": [], "decode": [], "prefill": []}
    profile = cProfile.Profile()
    b = eng.backend
    b.mixed = _timed(b.mixed, clocks["mixed"], sync, profile)
    b.decode = _timed(b.decode, clocks["decode"], sync)
    b.prefill_chunks = _timed(b.prefill_chunks, clocks["prefill"], sync)
    # every engine step, by what it ran (overlapped decode steps run outside b.decode)
    step_clocks = {"mixed": [], "prefill": [], "decode": []}
    run_step = b.run_step

    def timed_step(running, *a, **kw):
        prefilling = any(r.in_prefill for r in running)
        decoding = any(not r.in_prefill for r in running)
        kind = "mixed" if prefilling and decoding and b.mixed_rows is not None else (
            "prefill" if prefilling and not decoding else "decode")
        return _timed(run_step, step_clocks[kind], sync)(running, *a, **kw)

    b.run_step = timed_step
    tracer = _MixedStepTracer(args.trace_steps, step_clocks["mixed"]) if args.trace_steps and on_gpu else None
    if tracer is not None:
        b.run_step = tracer.wrap(timed_step)
    t0 = time.perf_counter()
    res = eng.generate(prompts, [{"max_new_tokens": args.max_new_tokens, "ignore_eos": bool(args.prompt_tokens)}]
                       * len(prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in res)
    s = io.StringIO()
    if clocks["mixed"]:  # pstats refuses a profile that never ran
        pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(PROFILE_ROWS)
    summary = {k: {"steps": len(v), "ms_mean": 1000 * sum(v) / max(1, len(v))} for k, v in clocks.items()}
    by_step = {k: {"steps": len(v), "ms_mean": 1000 * sum(v) / max(1, len(v)), "s_total": sum(v)}
               for k, v in step_clocks.items()}
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s); {summary}")
    print(f"engine steps (synchronized, by kind): {by_step}")
    print(s.getvalue())
    trace = tracer.report() if tracer is not None else None
    if trace is not None:
        print(trace["table"])
        print(f"traced mixed steps: {trace['steps']}, GPU kernel time per step {trace['gpu_ms_per_step']:.2f} ms, "
              f"wall per step {trace['wall_ms_per_step']:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "wall_s": wall, "steps": summary, "engine_steps": by_step,
                       "mixed_host_profile": s.getvalue(), "mixed_trace": trace}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
