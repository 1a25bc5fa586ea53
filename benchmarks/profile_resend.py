"""Where a resent long prompt's time to first token goes, without HTTP: a ``--resend_tokens``
(6000) prompt, then ``--resend_times`` (5) copies with ``--resend_new_tokens`` (50) different
tokens appended (the texts of ``bench_e2e_throughput --prefix_cache``'s resend workload), each
with one new token, on an in-process engine (the embedded model) with the prompt cache on and off.

Prints, per arm, the median of: tokenization (``tokenizer.encode`` on the whole text, and the
server's ``PromptEncoder`` after the first send), the engine's whole ``generate`` (admission, steps,
CUDA synchronized), and the backend's step calls inside it; then the host profile (cProfile) of
the cached resends. Writes them as JSON.
The HTTP server's time to first token (``bench_e2e_throughput --prefix_cache``) less these two is
the HTTP process and its queues.

    python benchmarks/profile_resend.py --gsm8k .data/test.jsonl --out resend_profile.json
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402
from lightllm.server.offline_engine import OfflineEngine  # noqa: E402
from lightllm.tools.client import model_dir_or_embedded  # noqa: E402
from lightllm.tools.prompts import gsm8k_path, load_gsm8k  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402
import prefix_cache_workloads as pcw  # noqa: E402 (the resend workload's texts)

PROFILE_ROWS = 25  # functions printed
STEP_METHODS = ("prefill_chunks", "mixed", "decode")  # the backend's step calls
TOKENIZE_REPEATS = 3  # encodes of each prompt (the median is reported)
TABLE = [Column("arm", "arm"), Column("tokenize_ms", "tokenize ms", ".2f"),
         Column("encoder_ms", "server encoder ms", ".2f"),
         Column("first_engine_ms", "first send engine ms", ".2f"),
         Column("resend_engine_ms", "resend engine ms", ".2f"), Column("resend_step_ms", "resend steps ms", ".2f"),
         Column("resend_host_ms", "resend outside steps ms", ".2f"), Column("cached_tokens", "cached tokens")]


def _timed(fn: Callable, clock: List[float], sync: Callable[[], None]) -> Callable:
    def wrapper(*a, **kw):
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sync()
            clock.append(time.perf_counter() - t0)
    return wrapper


def _ms(xs: List[float]) -> float:
    return 1000.0 * statistics.median(xs)


def run_arm(cache: bool, prompts: List[List[int]], max_len: int, device: str, dtype: str,
            profile: cProfile.Profile) -> Dict[str, object]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = StartArgs(running_max_req_size=4, max_req_total_len=max_len, disable_dynamic_prompt_cache=not cache)
    eng = OfflineEngine(start, device=device, dtype=dtype)
    one = [{"max_new_tokens": 1}]
    # warm-up: the first send's and a resend's shapes, on prompts that share no prefix with those sent
    # later (every token shifted), so the timed first send is uncached and every resend prefills its suffix
    vocab = eng.backend.model.vocab_size
    for p in prompts[:2]:
        eng.generate([[(t + 1) % vocab for t in p]], one)
    step_clock: List[float] = []
    b = eng.backend
    for name in STEP_METHODS:
        setattr(b, name, _timed(getattr(b, name), step_clock, sync))
    engine, steps, cached = [], [], []
    for i, p in enumerate(prompts):
        del step_clock[:]
        if i > 0 and cache:
            profile.enable()
        sync()
        t0 = time.perf_counter()
        res = eng.generate([p], one)[0]
        sync()
        engine.append(time.perf_counter() - t0)
        if i > 0 and cache:
            profile.disable()
        steps.append(sum(step_clock))
        cached.append(res.prompt_cached_tokens)
    eng.close()
    resend_engine, resend_steps = engine[1:], steps[1:]
    return {"arm": "on" if cache else "off", "first_engine_ms": 1000.0 * engine[0],
            "resend_engine_ms": _ms(resend_engine), "resend_step_ms": _ms(resend_steps),
            "resend_host_ms": _ms([e - s for e, s in zip(resend_engine, resend_steps)]),
            "cached_tokens": statistics.median(cached[1:]), "engine_ms": [1000.0 * x for x in engine],
            "step_ms": [1000.0 * x for x in steps], "cached": cached}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl (train.jsonl beside it)")
    p.add_argument("--gsm8k_train", default=None)
    p.add_argument("--resend_tokens", type=int, default=6000)
    p.add_argument("--resend_times", type=int, default=5)
    p.add_argument("--resend_new_tokens", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    tok = AutoTokenizer.from_pretrained(model_dir_or_embedded(None))
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k))]
    texts = [q.question for q in load_gsm8k(gsm8k_path("train", args.gsm8k_train))]
    first, resends = pcw.resend_texts(tok, texts, questions, args.resend_tokens, args.resend_times,
                                      args.resend_new_tokens)
    from lightllm.server.httpserver.prompt_encoder import PromptEncoder

    tokenize, encoder = [], []
    for t in resends:
        for _ in range(TOKENIZE_REPEATS):
            t0 = time.perf_counter()
            tok.encode(t, add_special_tokens=True)  # the tokenizer on the whole text
            tokenize.append(time.perf_counter() - t0)
    enc = PromptEncoder.of(tok)  # what HttpServerManager.encode_prompt runs: a resend after the first send
    enc.encode(first)
    for t in resends:
        t0 = time.perf_counter()
        enc.encode(t, add_special_tokens=True)
        encoder.append(time.perf_counter() - t0)
    prompts = [tok.encode(t, add_special_tokens=True) for t in [first] + resends]
    max_len = max(len(x) for x in prompts) + 2
    profile = cProfile.Profile()
    rows = [run_arm(cache, prompts, max_len, device, dtype, profile) for cache in (True, False)]
    for r in rows:
        r["tokenize_ms"], r["encoder_ms"] = _ms(tokenize), _ms(encoder)
    s = io.StringIO()
    pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(PROFILE_ROWS)
    print(render_table(rows, TABLE))
    print(s.getvalue())
    if args.out:
        write_json(args.out, {"args": vars(args), "device": device, "prompt_tokens": [len(x) for x in prompts],
                              "rows": rows, "resend_host_profile": s.getvalue()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
