"""Where a long prompt's time to first token goes, on an in-process engine (the embedded model).

For each engine configuration: the median wall time of one ``generate()`` of 1 new token per prompt
length (as ``bench_e2e_throughput --long_context`` times it), then one profiled run of the longest
prompt (torch.profiler): the GPU's kernel time against the wall time, the kernel launches, and the
host operators that took the most time. A wall time far above the kernel time is host-bound work
(kernel launches of an eager forward, Python between them).

    python benchmarks/profile_prefill.py --gsm8k .data/test.jsonl --out prefill_profile.json
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.bench_e2e_throughput import chat_template_ends, exact_length_prompt  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

REPEATS = 5  # timed prompts per length (one warm-up before them)
TOP_OPS = 15  # host operators listed per configuration
# name -> StartArgs fields on top of the shared ones
CONFIGS: Dict[str, Dict[str, object]] = {
    "default": {},
    "one chunk": {"batch_max_tokens": 6144},
    "prefill graphs to 512": {"graph_max_prefill_tokens": 512},
}
TABLE = [Column("config", "config"), Column("prompt_tokens", "prompt tokens", "d"),
         Column("ttft_ms", "TTFT ms", ".1f"), Column("profiled_wall_ms", "profiled wall ms", ".1f"),
         Column("kernel_ms", "GPU kernel ms", ".1f"), Column("kernels", "kernels", "d"),
         Column("steps", "steps", "d")]


def _profile(eng, ids: List[int]) -> Dict[str, object]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.generate([ids], [{"max_new_tokens": 1, "ignore_eos": True}])
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kernels) / 1e3  # us -> ms
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)
    return {"profiled_wall_ms": wall_ms, "kernel_ms": kernel_ms, "kernels": len(kernels), "host_ops": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gsm8k", required=True, help="GSM8K test jsonl (the prompts' text)")
    p.add_argument("--lens", type=int, nargs="+", default=[2048, 6000])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine
    from lightllm.tools.client import auto_max_req_total_len, free_device_memory, model_dir_or_embedded
    from lightllm.tools.prompts import load_gsm8k

    model_dir = model_dir_or_embedded(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ends = chat_template_ends(tok)
    texts = [q.question for q in load_gsm8k(args.gsm8k)]
    prompts = {n: [exact_length_prompt(tok, n, texts, j, ends) for j in range(2 + REPEATS)] for n in args.lens}
    rows, host_ops = [], {}
    for name in args.configs:
        eng = OfflineEngine(StartArgs(model_dir=model_dir, running_max_req_size=1,
                                      max_req_total_len=auto_max_req_total_len(args.lens, 1),
                                      disable_dynamic_prompt_cache=True, **CONFIGS[name]))
        chunk = eng.args.batch_max_tokens or eng.args.max_req_total_len
        for n in args.lens:
            first = prompts[n]
            eng.generate([first[0]], [{"max_new_tokens": 1, "ignore_eos": True}])  # warm-up at this length
            times = []
            for ids in first[1:1 + REPEATS]:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.generate([ids], [{"max_new_tokens": 1, "ignore_eos": True}])
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            prof = _profile(eng, first[-1])
            host_ops[f"{name} / {n}"] = prof.pop("host_ops")
            rows.append({"config": name, "prompt_tokens": n, "ttft_ms": statistics.median(times),
                         "steps": -(-n // chunk), **prof})
            print(f"[{name}] {n} tokens: {rows[-1]['ttft_ms']:.1f} ms", flush=True)
        eng = None
        free_device_memory()
    print(render_table(rows, TABLE))
    for key, table in host_ops.items():
        print(f"\n== host operators, {key}\n{table}")
    if args.out:
        write_json(args.out, {"rows": rows, "host_ops": host_ops, "configs": {k: CONFIGS[k] for k in args.configs}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
