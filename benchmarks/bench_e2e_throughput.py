"""End-to-end throughput: the real server vs transformers' own generate, same model, prompts and dtype.

For each server config (``--configs``; default: one config named ``engine``): start
``python -m lightllm.server.api_server`` with ``--server_args`` plus the config's own flags, warm
it up (so Triton compilation is not timed), send ``--num_prompts`` prompts with at most
``--concurrency`` in flight, greedy, ``--max_new_tokens`` each (``--ignore_eos``: exactly that
many), stop it. Then ``transformers`` generates for the same prompts in the server's dtype, in
batches of ``--hf_batch_size`` sorted by length (little padding: the baseline's best case; a
request's latency is its whole batch's time). Ratios of output tokens/s are to transformers and
to the first config. Prompts: GSM8K test questions in the model's chat template, or the lines of
``--prompt_file`` as they are. Output tokens count an EOS, as the server does.

"same text" columns are a sanity check, not a metric: the fraction of requests whose text
equals the first config's (strict MTP must reproduce plain decoding) and transformers'
(bf16 batch numerics can legitimately flip a near-tie, so < 1.0 on CUDA is normal).

``--matrix``: the in-process engine against transformers over models x modes x batches.

``--long_context``: long prompts on the in-process engine (``run_long_context``): time to first
token (one ``generate`` of 1 new token: admission, prefill, sampling) at ``--long_lens`` prompt
tokens on the embedded model and 2048 on the 8B-shaped dummy, against one transformers forward
of the same ids (bf16, SDPA, warmed up); then a wave of 16 concurrent ``--wave_lens`` LONG-token
prompts with ``--max_new_tokens`` each (tok/s) beside the same wave of SHORT-token prompts.
Prompts are GSM8K questions, repeated, in the chat template, cut to the exact token count.
Writes ``docs/data/perf/long_context.json`` by default.

``--serving``: serving under a realistic mix (``run_serving``). One server per ``--serving_modes``
arm (default plain, MTP K = 3 eagle strict, ASD usage), one after the other, each sent the same
``--num_prompts`` requests (default 512) closed-loop at ``--concurrency`` (default 64), streamed
from ``/v1/completions``: 80% GSM8K test questions in the chat template (``--max_new_tokens``,
default 256 here) and 20% (``--serving_long_fraction``) prompts of ``--serving_long_lens`` 2000-4000
tokens (seeded lengths, GSM8K questions repeated, cut so the server's tokenizer counts the length;
``--serving_long_new_tokens``, default 64), in a seeded order. Per arm: output tok/s, time to first
token, inter-token latency (all requests, the short ones, and the short ones while a long prompt
waits for its first token; the short ones' chunk gaps as vLLM counts ITL: SERVING_DEFINITIONS), and the
engine's decode clock from /metrics (mean decode batch, ms per decode step). The servers keep the engine's chunk budget
(``--batch_max_tokens``, default 2048: a long prompt takes several mixed steps; until the twenty-fourth
session this benchmark set 4096, the ``*_chunk4096`` arms). Ratios are to the first arm. Writes
``docs/data/perf/serving.json`` by default.

``--prefix_cache``: the radix prompt cache (``run_prefix_cache``; the workloads, client and rows are
``benchmarks/prefix_cache_workloads.py``). Two arms, cache on (the default server) and cache off
(``--disable_dynamic_prompt_cache``), each its own server with the section's flags, then
``--server_args``, then the arm's flag; ``--rounds`` rounds of on, off (``--prefix_arms``), so drift
shows between rounds. Every request is greedy with ``ignore_eos`` (the same lengths in both arms) and
streamed; TTFT is the first read that brings text. Per round and arm one server runs, one after the
other: (1) chat: ``--conversations`` (32) conversations at once, ``--turns`` (8) turns each, a
``--system_tokens`` (1000) system prompt (GSM8K train text cut to the count), each user message a
GSM8K test question, each reply (``--prefix_new_tokens``, 64) the history of the next turn, via
``/v1/chat/completions``: TTFT p50/p99 of turn 1 and of turns 2.., output tok/s, hit rates (usage
``cached_tokens`` / ``prompt_tokens``, and /metrics ``lightllm_prompt_cache_hit_tokens_total`` over
hit + computed), on/off ratios and the targets (TTFT p50 of turns 2.. <= 25% of off's; tok/s >= 1.5x);
(2) doc: ``--doc_questions`` (64) questions after one ``--doc_tokens`` (3000) document at
``--doc_concurrency`` (16); (3) resend: a ``--resend_tokens`` (6000) prompt sent once, then
``--resend_times`` (5) times with ``--resend_new_tokens`` (50) different tokens appended, 1 new token
each, one at a time via ``/v1/completions``: the resends' median TTFT beside the first send's (target
<= 15 ms). The server's ``--max_req_total_len`` is set to fit the longest request. Then (4) pressure,
on servers of their own: ``--pressure_conversations`` (128) conversations of ``--pressure_turns`` (3)
turns and ``--pressure_new_tokens`` (16) replies in a KV pool of ``--pressure_kv_tokens`` (default:
a tenth of the pool these servers get by default, running_max_req_size x (max_req_total_len +
mtp_step)): every request must succeed in both arms, the reply texts equal turn by turn, and the
cache-on arm evict (``lightllm_prompt_cache_evicted_tokens_total`` > 0). Writes
``docs/data/perf/prefix_cache.json`` by default.

    python benchmarks/bench_e2e_throughput.py --long_context

    python benchmarks/bench_e2e_throughput.py --serving --gsm8k .data/test.jsonl

    python benchmarks/bench_e2e_throughput.py --prefix_cache --rounds 2

    python benchmarks/bench_e2e_throughput.py --ignore_eos --out e2e.json \\
        --configs "plain=;mtp_k3=--mtp_mode eagle_with_att --mtp_step 3"
"""
import argparse
import bisect
import logging
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):  # run as a script from anywhere; the helpers
    if _path not in sys.path:
        sys.path.insert(0, _path)

from lightllm.tools.client import (  # noqa: E402 (after the path set-up)
    DECODE_CLOCK, ENGINE_CLOCK, MIXED_CLOCK, USAGE, StreamTrace, auto_max_req_total_len, completion_stream_body,
    free_device_memory, generate_body, model_dir_or_embedded, send_streamed, send_timed, serve, server_flags, warm_up,
    wave_server_flags)
from lightllm.tools.prompts import (chat_prompt_ids, chat_prompt_texts, fit_text_to_tokens, gsm8k_path,  # noqa: E402
                                    load_gsm8k, load_prompt_file, take_cyclic)
from lightllm.tools.report import Column, ratio, render_table, same_fraction, tokens_per_step, write_json  # noqa: E402
from lightllm.utils.server_launcher import (MetricsPage, http_process_pids, process_cpu_seconds,  # noqa: E402
                                            scrape)
from lightllm.server.metrics import METRICS_PUBLISH_S  # noqa: E402
import prefix_cache_workloads as pcw  # noqa: E402 (--prefix_cache's workloads and rows)

DEFAULT_OUT = "bench_e2e_throughput.json"
DEFAULT_CONFIG_NAME = "engine"
HF_NAME = "transformers"
PERCENTILES = (50, 90, 99)
# Llama-3-8B's shape (its config.json); weights are random (--load_format dummy)
LLAMA3_8B_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
    tie_word_embeddings=False, torch_dtype="bfloat16",
)


@dataclass(frozen=True)
class ServerConfig:
    """One server to benchmark: a name for the table and its flags (after the shared ones)."""

    name: str
    args: Tuple[str, ...]


def write_dummy_model_dir(out_dir: str, shape: Dict[str, object], tokenizer_dir: str) -> str:
    """A model dir for ``--load_format dummy``: ``shape`` as config.json plus the tokenizer files
    of ``tokenizer_dir`` (no weights)."""
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    write_json(os.path.join(out_dir, "config.json"), shape)
    return out_dir


def parse_configs(spec: Optional[str], shared_args: str = "") -> List[ServerConfig]:
    """``"name=ARGS;name2=ARGS2"`` (ARGS may be empty: ``"plain="``) -> configs, each with ``shared_args``
    first; ``None`` or blank: one config named ``engine`` with only the shared flags."""
    shared = tuple(shlex.split(shared_args or ""))
    if spec is None or not spec.strip():
        return [ServerConfig(DEFAULT_CONFIG_NAME, shared)]
    configs: List[ServerConfig] = []
    for part in filter(str.strip, spec.split(";")):  # a trailing ';' is fine
        name, sep, args = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--configs: {part.strip()!r} is not NAME=ARGS")
        if not name:
            raise ValueError(f"--configs: {part.strip()!r} has an empty name")
        if name == HF_NAME:
            raise ValueError(f"--configs: the name {HF_NAME!r} is taken by the baseline")
        if any(c.name == name for c in configs):
            raise ValueError(f"--configs: duplicate name {name!r}")
        configs.append(ServerConfig(name, shared + tuple(shlex.split(args))))
    if not configs:
        raise ValueError("--configs: no config given")
    return configs


@dataclass
class RequestResult:
    """What one request produced and how long it took (client side)."""

    latency_s: float
    output_tokens: int
    prompt_tokens: int
    text: str
    finish_reason: Optional[str] = None
    mtp_accepted_token_num: int = 0
    ttft_s: Optional[float] = None  # streaming only


def summarize(name: str, results: Sequence[RequestResult], wall_s: float) -> Dict[str, object]:
    """Throughput and latency of one run: results of every request and the run's wall time."""
    if not results:
        raise ValueError(f"{name}: no results")
    if wall_s <= 0:
        raise ValueError(f"{name}: wall time must be > 0, got {wall_s}")
    out_tokens = sum(r.output_tokens for r in results)
    accepted = sum(r.mtp_accepted_token_num for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    row: Dict[str, object] = {
        "name": name, "num_requests": len(results), "wall_s": wall_s, "output_tokens": out_tokens,
        "requests_per_s": len(results) / wall_s, "output_tokens_per_s": out_tokens / wall_s,
        "mean_output_tokens": out_tokens / len(results), "mtp_accepted_tokens": accepted,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "tokens_per_step": tokens_per_step(out_tokens, accepted),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
    }
    for q, v in zip(PERCENTILES, np.percentile([r.latency_s for r in results], PERCENTILES)):
        row[f"latency_p{q}_s"] = float(v)
    return row


def add_ratios_to_baseline_and_first(rows: List[Dict[str, object]], baseline: Optional[Dict[str, object]],
                                     key: str = "output_tokens_per_s") -> None:
    """Set ``vs_first`` (each row / rows[0]) and, with a baseline, ``vs_<baseline>`` (each row / baseline) in place."""
    for row in rows:
        if baseline is not None:
            row[f"vs_{baseline['name']}"] = ratio(row[key], baseline[key])
        row["vs_first"] = ratio(row[key], rows[0][key])


TABLE_COLUMNS = [
    Column("name", "config"), Column("requests_per_s", "req/s", ".2f"),
    Column("output_tokens_per_s", "out tok/s", ".1f"),
    *(Column(f"latency_p{q}_s", f"p{q} s", ".2f") for q in PERCENTILES), Column("ttft_mean_s", "TTFT s", ".3f"),
    Column("tokens_per_step", "tok/step", ".2f"), Column("same_text_as_first", "same txt 1st", ".2f"),
    Column("same_text_as_hf", "same txt HF", ".2f"), Column(f"vs_{HF_NAME}", "x HF", ".2f"),
    Column("vs_first", "x 1st", ".2f"),
]


def _result(timed) -> RequestResult:
    out = timed.response
    if timed.streamed_tokens is None:  # /generate
        return RequestResult(timed.latency_s, out["count_output_tokens"], out["prompt_tokens"], out["generated_text"][0],
                             out["finish_reason"], out.get("mtp_accepted_token_num", 0))
    details = out.get("details") or {}  # /generate_stream's final event
    return RequestResult(timed.latency_s, timed.streamed_tokens, details.get("prompt_tokens", -1),
                         out["generated_text"], out["finish_reason"], details.get("mtp_accepted_token_num", 0),
                         timed.ttft_s)


def run_engine(config: ServerConfig, prompts: List[str], args, log_dir: str) -> Tuple[dict, List[RequestResult]]:
    log_path = os.path.join(log_dir, f"server_{config.name}.log")
    print(f"[{config.name}] starting server: {' '.join(config.args) or '(defaults)'}  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    with serve(config.args, log_path) as server:
        print(f"[{config.name}] up in {time.perf_counter() - t0:.1f}s at {server.url}", flush=True)
        params = {"ignore_eos": args.ignore_eos}
        n_warm = min(args.warmup_requests, len(prompts))
        if n_warm:
            warm = [generate_body(p, min(args.warmup_tokens, args.max_new_tokens), **params) for p in prompts[:n_warm]]
            _, warm_s = send_timed(server.url, warm, args.concurrency, args.stream)
            print(f"[{config.name}] warm-up: {n_warm} requests in {warm_s:.1f}s", flush=True)
        bodies = [generate_body(p, args.max_new_tokens, **params) for p in prompts]
        timed, wall = send_timed(server.url, bodies, args.concurrency, args.stream, config.name)
    results = [_result(t) for t in timed]
    row = summarize(config.name, results, wall)
    row["server_args"] = list(config.args)
    row["finish_reasons"] = dict(Counter(str(r.finish_reason) for r in results))
    print(f"[{config.name}] {len(results)} requests in {wall:.2f}s, {row['output_tokens_per_s']:.1f} out tok/s",
          flush=True)
    return row, results


def run_transformers(model_dir: str, device: str, dtype_name: str, prompts: List[str], args,
                     eos_ids: List[int]) -> Tuple[dict, List[RequestResult]]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dtype = getattr(torch, dtype_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    greedy = dict(do_sample=False, pad_token_id=pad_id, eos_token_id=eos_ids)
    gen_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens,
                               min_new_tokens=args.max_new_tokens if args.ignore_eos else 0, **greedy)
    # the server tokenizes with add_special_tokens=True: the same ids here
    ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))  # little padding: the baseline's best case
    batches = [order[i:i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]

    # warm-up: CUDA context, cuBLAS handles, allocator
    warm_cfg = GenerationConfig(max_new_tokens=2, min_new_tokens=0, **greedy)
    _hf_generate(model, [ids[i] for i in batches[0]], pad_id, generation_config=warm_cfg)
    results: List[Optional[RequestResult]] = [None] * len(prompts)
    eos = set(eos_ids)
    bar = tqdm(total=len(prompts), desc=HF_NAME, unit="req", leave=False)
    t0 = time.perf_counter()
    for batch in batches:
        new, lat = _hf_generate(model, [ids[i] for i in batch], pad_id, generation_config=gen_cfg)
        for row, i in enumerate(batch):
            toks = new[row].tolist()
            first_eos = None if args.ignore_eos else next((j for j, t in enumerate(toks) if t in eos), None)
            n = len(toks) if first_eos is None else first_eos + 1  # the server counts the EOS too
            results[i] = RequestResult(
                latency_s=lat, output_tokens=n, prompt_tokens=len(ids[i]),
                text=tok.decode(toks[:n], skip_special_tokens=True),
                finish_reason="length" if first_eos is None else "eos",
            )
        bar.update(len(batch))
    wall = time.perf_counter() - t0
    bar.close()
    row = summarize(HF_NAME, results, wall)
    row["tokens_per_step"] = None
    row["batch_size"] = args.hf_batch_size
    print(f"[{HF_NAME}] {len(prompts)} prompts in {wall:.2f}s, {row['output_tokens_per_s']:.1f} out tok/s", flush=True)
    model = None  # the last reference
    free_device_memory()
    return row, results


def resolve_model_and_dtype(configs: List[ServerConfig], device: str) -> Tuple[str, str]:
    """The model dir and dtype every config serves (parsed with the server's own flag parser)."""
    from lightllm.server.api_cli import make_argument_parser

    parser = make_argument_parser()
    seen = set()
    for c in configs:
        ns = parser.parse_args(list(c.args))
        dtype = ns.data_type or ("bfloat16" if device == "cuda" else "float32")
        seen.add((ns.model_dir, dtype))
    if len(seen) != 1:
        raise ValueError(f"configs serve different models/dtypes {sorted(map(str, seen))}: "
                         "one transformers baseline cannot match them all")
    model_dir, dtype = seen.pop()
    return model_dir_or_embedded(model_dir), dtype


def build_prompts(args, model_dir: str) -> List[str]:
    if args.prompt_file:
        return take_cyclic(load_prompt_file(args.prompt_file, args.num_prompts), args.num_prompts)
    from transformers import AutoTokenizer

    questions = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k), args.num_prompts)]
    return chat_prompt_texts(AutoTokenizer.from_pretrained(model_dir), take_cyclic(questions, args.num_prompts))


# --matrix: the in-process engine against transformers per model, mode and batch
MATRIX_MODES = {
    "plain": {},
    "mtp3": dict(mtp_mode="eagle_with_att", mtp_step=3),
    "asd_usage": dict(mtp_mode="eagle_with_att", mtp_step=3, **USAGE.start_args()),
}
MATRIX_MODES["plain_det"] = dict(enable_deterministic_inference=True)
MATRIX_MODES["mtp3_det"] = dict(MATRIX_MODES["mtp3"], enable_deterministic_inference=True)
MATRIX_MODES["dspark3"] = dict(MATRIX_MODES["mtp3"], mtp_mode="dspark")
MATRIX_MODES["dspark_asd_usage"] = dict(MATRIX_MODES["asd_usage"], mtp_mode="dspark")
# plain decoding with each step committed before the next is launched (the overlap schedule's baseline)
MATRIX_MODES["plain_no_overlap"] = dict(disable_overlap_schedule=True)
MATRIX_MODELS = ("embedded", "llama3_8b_dummy")
MATRIX_BATCHES = {"embedded": {"plain": (1, 64, 256), "mtp3": (1, 64), "asd_usage": (1, 64),
                               "plain_det": (1, 64), "mtp3_det": (1, 64), "dspark3": (1, 64),
                               "dspark_asd_usage": (1, 64), "plain_no_overlap": (1, 64)},
                  "llama3_8b_dummy": {"plain": (1, 64, 256)}}
# Each cell's engine waves cover at least this many distinct prompts (batch 1: one per wave),
# so a cell's tokens per step is not one prompt's.
MIN_TIMED_PROMPTS = 16


@dataclass
class Wave:
    """One timed wave: ``batch`` requests submitted at once, each ``max_new_tokens`` long."""

    tokens: int
    wall_s: float
    steps: int = 0  # engine decode steps (prefill steps left out)
    step_s: float = 0.0  # the engine's own clock inside those decode steps
    decode_steps: int = 0  # per-request decode steps, summed
    decode_tokens: int = 0  # tokens those steps committed
    other_s: float = 0.0  # the engine's clock in its other (prefill) steps


def matrix_row(model: str, mode: str, batch: int, engine: Sequence[Wave], hf: Sequence[Wave], commit: str) -> dict:
    """One JSON row of docs/data/perf/bench_vs_hf.json from the waves of one cell (pooled)."""
    def rate(waves):
        return sum(w.tokens for w in waves) / sum(w.wall_s for w in waves) if waves else None

    steps = sum(w.steps for w in engine)
    return {
        "model": model, "mode": mode, "batch": batch,
        "engine_tok_s": rate(engine), "hf_tok_s": rate(hf),
        "tokens_per_step": sum(w.decode_tokens for w in engine) / max(1, sum(w.decode_steps for w in engine)),
        "step_ms": 1e3 * sum(w.step_s for w in engine) / steps if steps else None,
        # per wave: prefill steps, and the wall time outside every step (host bookkeeping)
        "prefill_ms_per_wave": 1e3 * sum(w.other_s for w in engine) / len(engine) if engine else None,
        "outside_steps_ms_per_wave": (1e3 * sum(w.wall_s - w.step_s - w.other_s for w in engine) / len(engine)
                                      if engine else None),
        "waves": len(engine), "commit": commit,
    }


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine_wave(eng, prompts, max_new_tokens: int) -> Wave:
    params = [{"max_new_tokens": max_new_tokens, "ignore_eos": True}] * len(prompts)
    eng.router.take_timing()
    t0 = time.perf_counter()
    res = eng.generate(prompts, params)
    _sync()
    wall = time.perf_counter() - t0
    timing = eng.router.take_timing()
    return Wave(sum(len(r.token_ids) for r in res), wall, timing.decode_steps, timing.decode_seconds,
                sum(len(r.accept_lens) for r in res), sum(sum(r.accept_lens) for r in res),
                timing.seconds - timing.decode_seconds)


def _hf_generate(model, prompts: Sequence[List[int]], pad_id: int, **kwargs) -> Tuple[object, float]:
    """Greedy ``model.generate`` over the left-padded prompts: the new tokens and the seconds they took."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    _sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id, **kwargs)
    _sync()
    return out[:, width:], time.perf_counter() - t0


def _hf_wave(model, prompts, max_new_tokens: int, pad_id: int) -> Wave:
    new, seconds = _hf_generate(model, prompts, pad_id, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return Wave(new.numel(), seconds)


def _matrix_model_dir(model: str, embedded: str) -> Tuple[str, str]:
    """The model dir and --load_format of a MATRIX_MODELS name."""
    if model == "llama3_8b_dummy":
        return write_dummy_model_dir(os.path.join(tempfile.mkdtemp(), model), LLAMA3_8B_SHAPE, embedded), "dummy"
    return embedded, "auto"


def _load_hf(model_dir: str, load_format: str, device: str, dtype):
    """transformers' model of the engine's: the same weights, or random ones (initialised on the device) for dummy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype,
                                                    attn_implementation="sdpa").eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def _git_commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO_ROOT).stdout.strip()


def run_matrix(args) -> List[dict]:
    """Per model: transformers and the engine's modes, waves alternating within each batch."""
    import torch
    from transformers import AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commit = _git_commit()
    embedded = model_dir_or_embedded(None)
    tok = AutoTokenizer.from_pretrained(embedded)
    largest = max(max(b) for m in MATRIX_BATCHES.values() for b in m.values())
    questions = load_gsm8k(gsm8k_path("test", args.gsm8k), largest * max(args.waves, MIN_TIMED_PROMPTS))
    all_prompts = chat_prompt_ids(tok, [q.question for q in questions])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows = []
    for model in args.matrix_models:
        model_dir, load_format = _matrix_model_dir(model, embedded)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the engine's default
        hf = None if args.skip_hf else _load_hf(model_dir, load_format, device, dtype)
        for mode, batches in MATRIX_BATCHES[model].items():
            if mode not in args.matrix_modes:
                continue
            eng = OfflineEngine(StartArgs(model_dir=model_dir, load_format=load_format, **MATRIX_MODES[mode],
                                          running_max_req_size=max(batches), max_req_total_len=1024,
                                          disable_cudagraph=args.disable_cudagraph, disable_dynamic_prompt_cache=True))
            for batch in batches:
                def wave_prompts(w: int) -> List[List[int]]:  # wave w's own slice of the prompts
                    return [all_prompts[(w * batch + i) % len(all_prompts)] for i in range(batch)]

                _engine_wave(eng, wave_prompts(0), args.warmup_tokens)
                with_hf = hf is not None and mode == "plain"
                if with_hf:
                    _hf_wave(hf, wave_prompts(0), args.warmup_tokens, pad_id)
                eng_waves, hf_waves = [], []
                for w in range(max(args.waves, -(-MIN_TIMED_PROMPTS // batch))):
                    eng_waves.append(_engine_wave(eng, wave_prompts(w), args.max_new_tokens))
                    if with_hf and w < args.waves:  # transformers: the first --waves waves
                        hf_waves.append(_hf_wave(hf, wave_prompts(w), args.max_new_tokens, pad_id))
                rows.append(matrix_row(model, mode, batch, eng_waves, hf_waves, commit))
                graphs = eng.backend.decode_step.graphs
                rows[-1]["graph_capture_s"] = graphs.capture_seconds if graphs else None
                rows[-1]["graph_capture_mib"] = graphs.capture_mib if graphs else None
                prefill = eng.backend.step_rows.graphs if eng.backend.step_rows is not None else None
                rows[-1]["prefill_graph_capture_s"] = prefill.capture_seconds if prefill else None
                rows[-1]["prefill_graph_capture_mib"] = prefill.capture_mib if prefill else None
                print(render_table([rows[-1]], MATRIX_TABLE), flush=True)
                write_json(args.out, rows)
            eng = None
            free_device_memory()
        hf = None
        free_device_memory()
    return rows


def add_matrix_ratios(rows: List[dict]) -> List[dict]:
    """``vs_hf``: engine tok/s over transformers' at the same model and batch (its plain cell);
    ``vs_plain``: over the engine's plain decoding at the same model and batch."""
    plain = {(r["model"], r["batch"]): r for r in rows if r["mode"] == "plain"}
    for r in rows:
        base = plain.get((r["model"], r["batch"]), {})
        r["vs_hf"] = ratio(r["engine_tok_s"], base.get("hf_tok_s"))
        r["vs_plain"] = ratio(r["engine_tok_s"], base.get("engine_tok_s"))
    return rows


MATRIX_TABLE = (
    Column("model", "model", ""), Column("mode", "mode", ""), Column("batch", "batch", "d"),
    Column("engine_tok_s", "engine tok/s", ".1f"), Column("hf_tok_s", "hf tok/s", ".1f"),
    Column("vs_hf", "x hf", ".2f"), Column("vs_plain", "x plain", ".2f"),
    Column("tokens_per_step", "tok/step", ".3f"), Column("step_ms", "step ms", ".2f"),
    Column("prefill_ms_per_wave", "prefill ms/wave", ".2f"),
    Column("outside_steps_ms_per_wave", "host ms/wave", ".2f"),
)


# --long_context: time to first token on long prompts, and waves of 16 long vs short prompts
LONG_CONTEXT_OUT = os.path.join("docs", "data", "perf", "long_context.json")
LONG_PROMPT_LENS = (512, 2048, 6000)  # the embedded model's TTFT prompts
DUMMY_8B_PROMPT_LENS = (2048,)
LONG_WAVE_REQUESTS = 16
LONG_WAVE_LENS = (6000, 150)  # the long wave's and the short wave's prompt tokens
TTFT_REPEATS = 5  # timed prompts per length (median), after one untimed
HF_REPEATS = 5  # timed transformers forwards per length (median), after one untimed
USER_TEXT_MARK = "@@USER_TEXT@@"  # where the user turn goes in the chat template's text


def chat_template_ends(tokenizer) -> Tuple[List[int], List[int]]:
    """The chat template's token ids before and after one user turn's text (generation prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": USER_TEXT_MARK}], add_generation_prompt=True,
                                         tokenize=False)
    head, mark, tail = text.partition(USER_TEXT_MARK)
    if not mark:
        raise ValueError("the chat template dropped the user turn's text")
    return tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False)


def exact_length_prompt(tokenizer, n_tokens: int, texts: Sequence[str], start: int = 0,
                        ends: Optional[Tuple[List[int], List[int]]] = None) -> List[int]:
    """Prompt ids of exactly ``n_tokens``: the chat template around a user turn made of ``texts``
    (from ``start``, cycling, one blank line apart), its tokens cut to fit."""
    head, tail = ends or chat_template_ends(tokenizer)
    need = n_tokens - len(head) - len(tail)
    if need < 1:
        raise ValueError(f"{n_tokens} tokens cannot hold the chat template ({len(head) + len(tail)} tokens)")
    if not texts:
        raise ValueError("no texts to build a prompt from")
    body: List[int] = []
    i = start
    while len(body) < need:  # each text adds at least its blank line's token
        body += tokenizer.encode(texts[i % len(texts)] + "\n\n", add_special_tokens=False)
        i += 1
    return head + body[:need] + tail


def usable_prompt_len(n_tokens: int, max_positions: Optional[int], new_tokens: int) -> int:
    """``n_tokens``, or the longest prompt that leaves room for ``new_tokens`` within the model's positions."""
    return n_tokens if max_positions is None else min(n_tokens, max_positions - new_tokens)


def long_context_result(ttft_ms: Dict[str, Dict[int, float]], hf_prefill_ms: Dict[str, Dict[int, float]],
                        c16_long_tok_s: Optional[float], c16_short_tok_s: Optional[float], commit: str,
                        meta: Dict[str, object]) -> Dict[str, object]:
    """docs/data/perf/long_context.json: milliseconds by model and prompt length (JSON keys are strings)."""
    def by_len(table):
        return {model: {str(n): ms for n, ms in sorted(per_len.items())} for model, per_len in table.items()}

    return {"ttft_ms": by_len(ttft_ms), "hf_prefill_ms": by_len(hf_prefill_ms), "c16_long_tok_s": c16_long_tok_s,
            "c16_short_tok_s": c16_short_tok_s, "commit": commit, "meta": meta}


def ttft_rows(result: Dict[str, object]) -> List[dict]:
    """The printed table's rows: one per model and prompt length."""
    rows = []
    for model, per_len in result["ttft_ms"].items():
        for n, ms in per_len.items():
            hf = result["hf_prefill_ms"].get(model, {}).get(n)
            rows.append({"model": model, "prompt_tokens": int(n), "ttft_ms": ms, "hf_prefill_ms": hf,
                         "hf_over_engine": ratio(hf, ms)})
    return rows


LONG_TABLE = (
    Column("model", "model"), Column("prompt_tokens", "prompt tokens", "d"), Column("ttft_ms", "engine TTFT ms", ".1f"),
    Column("hf_prefill_ms", "hf forward ms", ".1f"), Column("hf_over_engine", "hf / engine", ".2f"),
)


def wave_rows(result: Dict[str, object], args) -> List[dict]:
    """The printed table of the two waves (embedded model)."""
    return [{"wave": f"{LONG_WAVE_REQUESTS} x {n} tokens", "max_new_tokens": args.max_new_tokens,
             "tok_s": result[key]} for n, key in zip(args.wave_lens, ("c16_long_tok_s", "c16_short_tok_s"))]


WAVE_TABLE = (Column("wave", "wave (embedded)"), Column("max_new_tokens", "new tokens each", "d"),
              Column("tok_s", "out tok/s", ".1f"))


def _median_ms(fn, inputs: Sequence) -> float:
    """Median wall ms of ``fn(x)`` over ``inputs`` (the device synchronized around each)."""
    times = []
    for x in inputs:
        _sync()
        t0 = time.perf_counter()
        fn(x)
        _sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _hf_forward(model):
    """One forward of a prompt's ids, no KV cache kept, logits of the last position only where supported."""
    import inspect

    import torch

    kwargs = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1

    def forward(ids: List[int]):
        with torch.inference_mode():
            return model(torch.tensor([ids], device=model.device), **kwargs)

    return forward


def _engine_first_token(eng):
    def first_token(ids: List[int]):
        return eng.generate([ids], [{"max_new_tokens": 1, "ignore_eos": True}])

    return first_token


def run_long_context(args) -> Dict[str, object]:
    """Per model: transformers' forwards first (then freed), then one engine for the TTFTs and,
    on the embedded model, the two waves."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the engine's default
    embedded = model_dir_or_embedded(None)
    tok = AutoTokenizer.from_pretrained(embedded)  # the dummy model's tokenizer too
    ends = chat_template_ends(tok)
    texts = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k))]
    ttft: Dict[str, Dict[int, float]] = {}
    hf_ms: Dict[str, Dict[int, float]] = {}
    waves: Dict[str, float] = {}  # "long" / "short" -> tok/s
    clipped: Dict[str, Dict[int, int]] = {}  # model -> asked prompt length -> the one run
    engine_args: Dict[str, Dict[str, int]] = {}
    for model in args.long_models:
        model_dir, load_format = _matrix_model_dir(model, embedded)
        max_positions = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)

        def fit(n: int, new_tokens: int) -> int:  # the longest prompt the model's positions allow, said when shorter
            usable = usable_prompt_len(n, max_positions, new_tokens)
            if usable != n:
                clipped.setdefault(model, {})[n] = usable
                print(f"[{model}] {n} prompt + {new_tokens} new tokens exceed max_position_embeddings "
                      f"{max_positions}: {usable}-token prompts instead", flush=True)
            return usable

        with_waves = model == "embedded"
        lens = [fit(n, 1) for n in (args.long_lens if model == "embedded" else DUMMY_8B_PROMPT_LENS)]
        wave_lens = [fit(n, args.max_new_tokens) for n in args.wave_lens] if with_waves else []
        # TTFT prompt j of a length starts at question j: no two timed prompts are the same
        prompts = {n: [exact_length_prompt(tok, n, texts, j, ends) for j in range(1 + TTFT_REPEATS)] for n in lens}
        if not args.skip_hf:
            hf = _load_hf(model_dir, load_format, device, dtype)
            forward = _hf_forward(hf)
            for n in lens:
                forward(prompts[n][0])  # warm-up
                hf_ms.setdefault(model, {})[n] = _median_ms(forward, prompts[n][1:1 + HF_REPEATS])
                print(f"[{model}] transformers forward, {n} tokens: {hf_ms[model][n]:.1f} ms", flush=True)
            hf = forward = None
            free_device_memory()
        eng = OfflineEngine(StartArgs(model_dir=model_dir, load_format=load_format,
                                      running_max_req_size=LONG_WAVE_REQUESTS if with_waves else 1,
                                      max_req_total_len=auto_max_req_total_len(lens + wave_lens, args.max_new_tokens),
                                      disable_cudagraph=args.disable_cudagraph,
                                      # prefill speed: every prompt from token 0 (repeats are not served from cache)
                                      disable_dynamic_prompt_cache=True))
        engine_args[model] = {"max_req_total_len": eng.args.max_req_total_len,
                              "batch_max_tokens": eng.args.batch_max_tokens}
        first_token = _engine_first_token(eng)
        for n in lens:
            first_token(prompts[n][0])  # warm-up: kernel compilation at this length
            ttft.setdefault(model, {})[n] = _median_ms(first_token, prompts[n][1:])
            print(f"[{model}] engine TTFT, {n} tokens: {ttft[model][n]:.1f} ms", flush=True)
        if with_waves:
            wave = {n: [exact_length_prompt(tok, n, texts, j, ends) for j in range(LONG_WAVE_REQUESTS)]
                    for n in wave_lens}
            _engine_wave(eng, wave[wave_lens[1]], args.warmup_tokens)
            for kind, n in zip(("long", "short"), wave_lens):
                timed = [_engine_wave(eng, wave[n], args.max_new_tokens) for _ in range(args.waves)]
                waves[kind] = sum(w.tokens for w in timed) / sum(w.wall_s for w in timed)
                print(f"[{model}] {LONG_WAVE_REQUESTS} x {n}-token prompts, {args.max_new_tokens} new tokens each: "
                      f"{waves[kind]:.1f} tok/s", flush=True)
        eng = first_token = None
        free_device_memory()
    meta = {
        "device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "dtype": str(dtype).replace("torch.", ""), "ttft": "wall ms of one generate() of 1 new token, median of "
        f"{TTFT_REPEATS}", "hf": f"one forward (SDPA, no cache), median of {HF_REPEATS}",
        "wave_requests": LONG_WAVE_REQUESTS, "wave_lens": list(args.wave_lens), "max_new_tokens": args.max_new_tokens,
        "waves": args.waves, "disable_cudagraph": args.disable_cudagraph, "clipped": clipped,
        "engine_args": engine_args,
    }
    return long_context_result(ttft, hf_ms, waves.get("long"), waves.get("short"), _git_commit(), meta)


# --serving: one server per mode, a closed-loop mix of short and long prompts, streamed
SERVING_OUT = os.path.join("docs", "data", "perf", "serving.json")
SMALL_CHUNK_TOKENS = 512  # the *_chunk512 arms: prompt tokens per step (inter-token latency against TTFT)
WHOLE_PROMPT_CHUNK_TOKENS = 4096  # the *_chunk4096 arms: a long prompt in one step (this benchmark's base before)
NO_WAIT_STEPS = 0  # the *_wait0 arms: --router_max_wait_tokens 0 (admit at every step, not one decode step apart)
SERVING_MODES = {"plain": MATRIX_MODES["plain"], "mtp": MATRIX_MODES["mtp3"], "asd_usage": MATRIX_MODES["asd_usage"],
                 "dspark": MATRIX_MODES["dspark3"], "dspark_asd_usage": MATRIX_MODES["dspark_asd_usage"],
                 "plain_no_overlap": MATRIX_MODES["plain_no_overlap"],
                 "mtp_chunk512": dict(MATRIX_MODES["mtp3"], batch_max_tokens=SMALL_CHUNK_TOKENS),
                 "asd_usage_chunk512": dict(MATRIX_MODES["asd_usage"], batch_max_tokens=SMALL_CHUNK_TOKENS),
                 "mtp_chunk4096": dict(MATRIX_MODES["mtp3"], batch_max_tokens=WHOLE_PROMPT_CHUNK_TOKENS),
                 "mtp_wait0": dict(MATRIX_MODES["mtp3"], router_max_wait_tokens=NO_WAIT_STEPS),
                 "asd_usage_wait0": dict(MATRIX_MODES["asd_usage"], router_max_wait_tokens=NO_WAIT_STEPS)}
DEFAULT_SERVING_MODES = ("plain", "mtp", "asd_usage")
SERVING_NUM_PROMPTS = 512
SERVING_SHORT_NEW_TOKENS = 256
SERVING_LONG_NEW_TOKENS = 64  # at most --max_new_tokens unless given
SERVING_LONG_FRACTION = 0.2
SERVING_LONG_LENS = (2000, 4000)
SERVING_CLIENT_PROCS = 4
SERVING_PERCENTILES = (50, 99)
SHORT, LONG = "short", "long"
LONG_START_STRIDE = 97  # long prompt j starts at GSM8K question 97 j: no two alike
SERVING_RATIO_KEYS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_short_ms_p50", "itl_short_ms_p99",
                      "itl_short_during_long_prefill_ms_p99", "mean_decode_batch")
SERVING_DEFINITIONS = {
    "clock": "client side, time.perf_counter of the benchmark's client processes (one monotonic clock)",
    "output_tok_s": "completion tokens of all requests / (last response's end - first request's send)",
    "ttft_ms": "first chunk with a token - the request's send",
    "itl_ms": "per token after a request's first chunk: a chunk of n tokens arriving g ms after the previous "
              "chunk gives n samples of g / n (MTP: one step commits several tokens, each gets its share); "
              "chunks read in one network read count as one",
    "itl_short_ms": "itl_ms of the short requests only",
    "chunk_gap_short_ms": "the gaps between a short request's consecutive chunks, one sample per gap whatever its "
                          "tokens (vLLM benchmark_serving's ITL: with MTP a step's tokens share one gap)",
    "itl_short_during_long_prefill_ms": "itl_ms of the short requests whose gap overlaps a long request's "
                                        "window from its send to its first token (queued or being prefilled)",
    "long_prefill_time_share": "the union of those windows / the run's wall time",
    "mean_decode_batch": "/metrics delta over the timed run: requests decoded / steps that decoded (decode and mixed steps)",
    "decode_step_ms": "/metrics delta: engine seconds in decode steps / decode steps",
    "prefill_steps": "/metrics delta: batch steps that were not decode steps (mixed steps included)",
    "itl_router_ms": "/metrics delta of lightllm_inter_token_latency_seconds (the router's clock between two updates "
                     "of a request, every request), the quantile estimated linearly within its bucket",
    "http_cpu_share": "the HTTP processes' user + system CPU seconds over the timed run (all of them with "
                      "--httpserver_workers) / its wall time",
    "http_cpu_share_by_process": "the same for each HTTP process, process 0 (the API server) first",
    "update_delivery_ms": "/metrics delta of lightllm_update_delivery_seconds (the router's send of a step's updates "
                          "to the HTTP process's event loop handling them, one per message), estimated as itl_router_ms",
}
ROUTER_ITL = "lightllm_inter_token_latency_seconds"
UPDATE_DELIVERY = "lightllm_update_delivery_seconds"


@dataclass(frozen=True)
class ServingRequest:
    kind: str  # SHORT or LONG
    text: str  # the prompt as /v1/completions takes it
    prompt_tokens: int  # the server's count of it (add_special_tokens=True)
    max_new_tokens: int


def _server_token_count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=True))  # as the server's encode_prompt


def exact_length_prompt_text(tokenizer, n_tokens: int, texts: Sequence[str], start: int = 0) -> Tuple[str, int]:
    """(the text, its server token count) of a chat prompt of ``n_tokens``: one user turn made of
    ``texts`` from ``start`` (cycling, one blank line apart), its tokens cut to fit. Text, unlike
    ``exact_length_prompt``'s ids, is re-tokenized by the server: the cut is moved until the count
    is ``n_tokens``, or the closest not above it (a cut can swing by one token)."""
    if not texts:
        raise ValueError("no texts to build a prompt from")
    overhead = _server_token_count(tokenizer, chat_prompt_texts(tokenizer, [""])[0])
    if n_tokens <= overhead:
        raise ValueError(f"{n_tokens} tokens cannot hold the chat template ({overhead} tokens)")
    return fit_text_to_tokens(tokenizer, n_tokens, texts, start, n_tokens - overhead,
                              lambda t: chat_prompt_texts(tokenizer, [t])[0], lambda t: _server_token_count(tokenizer, t))


def build_serving_workload(tokenizer, questions: Sequence[str], num_requests: int, long_fraction: float,
                           long_lens: Sequence[int], short_new_tokens: int, long_new_tokens: int,
                           seed: int = 0) -> List[ServingRequest]:
    """``round(num_requests * long_fraction)`` long prompts of seeded lengths in [long_lens[0],
    long_lens[1]], the rest GSM8K questions in order (cycling) in the chat template, in a seeded
    order."""
    lo, hi = long_lens
    if not 1 <= lo <= hi:
        raise ValueError(f"long prompt lengths: need 1 <= LO <= HI, got {lo} {hi}")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"the long fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    n_long = round(num_requests * long_fraction)
    n_short = num_requests - n_long
    lens = [rng.randint(lo, hi) for _ in range(n_long)]
    kinds = [LONG] * n_long + [SHORT] * n_short
    rng.shuffle(kinds)
    short_texts = chat_prompt_texts(tokenizer, take_cyclic(questions, n_short)) if n_short else []
    shorts = iter(ServingRequest(SHORT, t, _server_token_count(tokenizer, t), short_new_tokens) for t in short_texts)
    longs = iter(ServingRequest(LONG, *exact_length_prompt_text(tokenizer, n, questions, j * LONG_START_STRIDE),
                                long_new_tokens) for j, n in enumerate(lens))
    return [next(longs) if k == LONG else next(shorts) for k in kinds]


def serving_mode_flags(mode: str) -> List[str]:
    """A SERVING_MODES entry as server flags (a True value is a flag without a value)."""
    start_args = SERVING_MODES[mode]
    return (server_flags(**{k: v for k, v in start_args.items() if not isinstance(v, bool)})
            + [f"--{k}" for k, v in start_args.items() if v is True])


def merge_windows(windows: Sequence[Tuple[float, float]]) -> Tuple[List[float], List[float]]:
    """The union of [start, end] windows as disjoint intervals in order: (starts, ends)."""
    starts: List[float] = []
    ends: List[float] = []
    for a, b in sorted(windows):
        if starts and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def overlaps_any(a: float, b: float, starts: Sequence[float], ends: Sequence[float]) -> bool:
    """The gap (a, b) shares time with one of the disjoint, ordered intervals (``merge_windows``)."""
    i = bisect.bisect_left(starts, b) - 1  # the last interval starting before b: the latest end of those
    return i >= 0 and ends[i] > a


def long_prefill_windows(requests: Sequence[ServingRequest],
                         traces: Sequence[StreamTrace]) -> List[Tuple[float, float]]:
    """Each long request's time from its send to its first token (its end when none came)."""
    return [(t.sent_s, t.chunks[0][0] if t.chunks else t.done_s) for r, t in zip(requests, traces) if r.kind == LONG]


def itl_samples(trace: StreamTrace, starts: Sequence[float] = (),
                ends: Sequence[float] = ()) -> List[Tuple[float, bool]]:
    """(ms, tagged) per token after the request's first chunk. A chunk of n tokens that came g ms
    after the previous chunk gives n samples of g / n ms: with MTP one step commits several tokens,
    which the server sends in one chunk, and each token gets its share of the gap (the first chunk's
    tokens have no gap before them: TTFT). Tagged: the gap overlaps one of the intervals."""
    out = []
    for (a, _), (b, n) in zip(trace.chunks, trace.chunks[1:]):
        tagged = overlaps_any(a, b, starts, ends)
        out += [(1e3 * (b - a) / n, tagged)] * n
    return out


def chunk_gaps_ms(trace: StreamTrace) -> List[float]:
    """The gaps between the request's consecutive chunks, in ms (none before its first: TTFT)."""
    return [1e3 * (b - a) for (a, _), (b, _) in zip(trace.chunks, trace.chunks[1:])]


def _percentiles(name: str, xs: Sequence[float]) -> Dict[str, Optional[float]]:
    values = np.percentile(xs, SERVING_PERCENTILES) if len(xs) else [None] * len(SERVING_PERCENTILES)
    return {f"{name}_p{q}": None if v is None else float(v) for q, v in zip(SERVING_PERCENTILES, values)}


def engine_clock_fields(grown: Optional[MetricsPage]) -> Dict[str, Optional[float]]:
    """The engine's step clock over a run from the growth of its /metrics (None: not scraped)."""
    if grown is None:
        return {k: None for k in ("mean_decode_batch", "decode_step_ms", "decode_steps", "prefill_steps",
                                  "prefill_step_ms", "mixed_steps", "mixed_step_ms", "mean_batch", "engine_busy_s")}
    engine_s, batch_steps, batch_reqs = (grown.value(n, 0.0) for n in ENGINE_CLOCK)
    decode_s, decode_steps, decode_reqs = (grown.value(n, 0.0) for n in DECODE_CLOCK)
    mixed_s, mixed_steps, mixed_reqs = (grown.value(n, 0.0) for n in MIXED_CLOCK)
    prefill_steps = batch_steps - decode_steps
    return {"mean_decode_batch": ratio(decode_reqs + mixed_reqs, decode_steps + mixed_steps),
            "mixed_steps": int(mixed_steps), "mixed_step_ms": ratio(1e3 * mixed_s, mixed_steps),
            "decode_step_ms": ratio(1e3 * decode_s, decode_steps), "decode_steps": int(decode_steps),
            "prefill_steps": int(prefill_steps),
            "prefill_step_ms": ratio(1e3 * (engine_s - decode_s), prefill_steps),
            "mean_batch": ratio(batch_reqs, batch_steps), "engine_busy_s": engine_s}


def _fmt_ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def router_itl_fields(grown: Optional[MetricsPage], http_cpu_s: Optional[Sequence[float]],
                      wall_s: float) -> Dict[str, object]:
    """The same run seen by the server: the router's inter-token latency (its histogram's growth, every
    request, estimated within buckets), the updates' way to the HTTP process's event loop, and that
    process's CPU time per wall second (near 1: it is the bottleneck, and the client's chunk gaps are its
    queueing, not the engine's steps). ``http_cpu_s``: each HTTP process's CPU seconds over the run."""
    def ms(name: str, q: float) -> Optional[float]:
        v = None if grown is None else grown.quantile(name, q)
        return None if v is None else 1e3 * v

    p50, p99 = ms(ROUTER_ITL, 0.5), ms(ROUTER_ITL, 0.99)
    return {"itl_router_ms_p50": p50, "itl_router_ms_p99": p99,
            "itl_router_p99_over_p50": ratio(p99, p50) if p50 and p99 is not None else None,
            "update_delivery_ms_p50": ms(UPDATE_DELIVERY, 0.5), "update_delivery_ms_p99": ms(UPDATE_DELIVERY, 0.99),
            "http_cpu_share": None if http_cpu_s is None or wall_s <= 0 else sum(http_cpu_s) / wall_s,
            "http_cpu_share_by_process": None if http_cpu_s is None or wall_s <= 0 else [c / wall_s for c in http_cpu_s]}


def serving_row(mode: str, requests: Sequence[ServingRequest], traces: Sequence[StreamTrace],
                grown: Optional[MetricsPage] = None, http_cpu_s: Optional[Sequence[float]] = None) -> Dict[str, object]:
    """One arm's JSON row (SERVING_DEFINITIONS) from its requests' traces and its /metrics growth."""
    if len(requests) != len(traces) or not traces:
        raise ValueError(f"{mode}: {len(requests)} requests, {len(traces)} traces")
    starts, ends = merge_windows(long_prefill_windows(requests, traces))
    wall = max(t.done_s for t in traces) - min(t.sent_s for t in traces)
    out_tokens = sum(t.output_tokens for t in traces)
    ttft = {k: [1e3 * t.ttft_s for r, t in zip(requests, traces) if t.chunks and k in (None, r.kind)]
            for k in (None, SHORT, LONG)}
    itl_all, itl_short, itl_short_tagged, gaps_short = [], [], [], []
    for r, t in zip(requests, traces):
        samples = itl_samples(t, starts, ends)
        itl_all += [ms for ms, _ in samples]
        if r.kind == SHORT:
            gaps_short += chunk_gaps_ms(t)
            itl_short += [ms for ms, _ in samples]
            itl_short_tagged += [ms for ms, tagged in samples if tagged]
    row: Dict[str, object] = {
        "mode": mode, "requests": len(traces), "short_requests": sum(r.kind == SHORT for r in requests),
        "long_requests": sum(r.kind == LONG for r in requests), "wall_s": wall, "output_tokens": out_tokens,
        "prompt_tokens": sum(t.prompt_tokens for t in traces), "output_tok_s": out_tokens / wall if wall > 0 else None,
        "tokens_per_step": tokens_per_step(out_tokens, sum(t.mtp_accepted_token_num for t in traces)),
        **_percentiles("ttft_ms", ttft[None]), **_percentiles("ttft_short_ms", ttft[SHORT]),
        **_percentiles("ttft_long_ms", ttft[LONG]), **_percentiles("itl_ms", itl_all),
        **_percentiles("itl_short_ms", itl_short),
        **_percentiles("itl_short_during_long_prefill_ms", itl_short_tagged),
        **_percentiles("chunk_gap_short_ms", gaps_short),
        "itl_short_samples": len(itl_short), "itl_short_during_long_prefill_samples": len(itl_short_tagged),
        "long_prefill_time_share": sum(b - a for a, b in zip(starts, ends)) / wall if wall > 0 else None,
        "finish_reasons": dict(Counter(str(t.finish_reason) for t in traces)),
        # requests whose streamed chunks' tokens differ from their usage count (0 expected)
        "stream_token_mismatches": sum(sum(n for _, n in t.chunks) != t.output_tokens for t in traces),
    }
    row["itl_short_p99_over_p50"] = ratio(row["itl_short_ms_p99"], row["itl_short_ms_p50"])
    row["chunk_gap_short_p99_over_p50"] = ratio(row["chunk_gap_short_ms_p99"], row["chunk_gap_short_ms_p50"])
    row["itl_short_during_long_prefill_p99_over_p50"] = ratio(row["itl_short_during_long_prefill_ms_p99"],
                                                              row["itl_short_during_long_prefill_ms_p50"])
    row.update(engine_clock_fields(grown))
    row.update(router_itl_fields(grown, http_cpu_s, wall))
    return row


def add_serving_ratios(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """``KEY_vs_first`` = each row's KEY / the first row's, for SERVING_RATIO_KEYS (in place)."""
    for row in rows:
        for key in SERVING_RATIO_KEYS:
            row[f"{key}_vs_first"] = ratio(row[key], rows[0][key])
    return rows


SERVING_TABLE = (
    Column("mode", "mode"), Column("requests", "req", "d"), Column("output_tok_s", "out tok/s", ".1f"),
    Column("output_tok_s_vs_first", "x 1st", ".2f"), Column("ttft_ms_p50", "TTFT p50 ms", ".1f"),
    Column("ttft_ms_p99", "TTFT p99 ms", ".1f"), Column("itl_ms_p50", "ITL p50", ".2f"),
    Column("itl_ms_p99", "ITL p99", ".2f"), Column("itl_short_ms_p50", "short ITL p50", ".2f"),
    Column("itl_short_ms_p99", "short ITL p99", ".2f"),
    Column("chunk_gap_short_ms_p50", "short gap p50", ".2f"), Column("chunk_gap_short_ms_p99", "gap p99", ".2f"),
    Column("itl_short_during_long_prefill_ms_p50", "during long prefill p50", ".2f"),
    Column("itl_short_during_long_prefill_ms_p99", "p99", ".2f"),
    Column("itl_short_during_long_prefill_p99_over_p50", "p99/p50", ".2f"),
    Column("itl_short_ms_p99_vs_first", "short p99 x 1st", ".2f"), Column("tokens_per_step", "tok/step", ".2f"),
    Column("mean_decode_batch", "decode batch", ".1f"), Column("decode_step_ms", "decode step ms", ".2f"),
)


def workload_summary(workload: Sequence[ServingRequest]) -> Dict[str, object]:
    def lens(kind):
        return [r.prompt_tokens for r in workload if r.kind == kind]

    return {kind: {"requests": len(lens(kind)), "prompt_tokens_min": min(lens(kind), default=None),
                   "prompt_tokens_mean": statistics.fmean(lens(kind)) if lens(kind) else None,
                   "prompt_tokens_max": max(lens(kind), default=None),
                   "max_new_tokens": next((r.max_new_tokens for r in workload if r.kind == kind), None)}
            for kind in (SHORT, LONG)}


def run_serving(args) -> Dict[str, object]:
    """One server per mode, one after the other, each sent the same workload; the JSON after every arm."""
    import torch
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shared = tuple(shlex.split(args.server_args or ""))
    model_dir, dtype = resolve_model_and_dtype([ServerConfig("serving", shared)], device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k))]
    t0 = time.perf_counter()
    workload = build_serving_workload(tok, questions, args.num_prompts, args.serving_long_fraction,
                                      args.serving_long_lens, args.max_new_tokens, args.serving_long_new_tokens,
                                      args.seed)
    summary = workload_summary(workload)
    print(f"workload: {summary[SHORT]['requests']} short + {summary[LONG]['requests']} long "
          f"({summary[LONG]['prompt_tokens_min']}-{summary[LONG]['prompt_tokens_max']} tokens) requests, "
          f"built in {time.perf_counter() - t0:.1f}s; concurrency {args.concurrency}, "
          f"{args.client_procs} client processes", flush=True)
    max_len = auto_max_req_total_len([r.prompt_tokens + r.max_new_tokens for r in workload], 0)
    # the engine's own chunk budget (a long prompt takes several mixed steps, as a user's server runs it), not
    # wave_server_flags' one-request chunk; --server_args last: they win
    base = server_flags(running_max_req_size=args.concurrency, max_req_total_len=max_len) + list(shared)
    bodies = [completion_stream_body(r.text, r.max_new_tokens, args.ignore_eos) for r in workload]
    warm_texts = [r.text for r in workload]
    warm_tokens = min([args.warmup_tokens] + [r.max_new_tokens for r in workload])  # within max_req_total_len
    log_dir = tempfile.mkdtemp(prefix="bench_serving_")
    meta = {"model_dir": model_dir, "device": device, "dtype": dtype,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__,
            "prompt_source": gsm8k_path("test", args.gsm8k), "workload": summary, "server_flags": base,
            "log_dir": log_dir}
    rows: List[Dict[str, object]] = []
    for mode in args.serving_modes:
        flags = base + serving_mode_flags(mode)
        log_path = os.path.join(log_dir, f"server_{mode}.log")
        print(f"[{mode}] starting server: {' '.join(flags)}  (log: {log_path})", flush=True)
        t0 = time.perf_counter()
        with serve(flags, log_path) as server:
            print(f"[{mode}] up in {time.perf_counter() - t0:.1f}s at {server.url}", flush=True)
            n_warm = min(args.warmup_requests, len(workload))
            if n_warm:  # the mix's first requests: the long prompts' kernels too
                t0 = time.perf_counter()
                warm_up(server.url, warm_texts, warm_tokens, args.concurrency, requests=n_warm)
                print(f"[{mode}] warm-up: {n_warm} requests in {time.perf_counter() - t0:.1f}s", flush=True)
            settle_s = metrics_settle_s(flags)
            time.sleep(settle_s)
            pids = http_process_pids(server.proc.pid, server.log_path)
            before, cpu0 = scrape(server.url), processes_cpu_seconds(pids)
            client_lag: List[Tuple[float, float]] = []
            traces = send_streamed(server.url, bodies, args.concurrency, args.client_procs, mode, lag=client_lag)
            cpu1 = processes_cpu_seconds(pids)  # before the settle: the window is the run's
            time.sleep(settle_s)
            grown = scrape(server.url) - before
        row = serving_row(mode, workload, traces, grown,
                          None if cpu0 is None or cpu1 is None else [b - a for a, b in zip(cpu0, cpu1)])
        row["server_args"] = flags
        # the clients' own lag: a client that lags stamps chunks late, inflating the ITL it reports
        row.update(_percentiles("client_loop_lag_ms", [1e3 * x for _, x in client_lag]))
        rows.append(row)
        add_serving_ratios(rows)
        print(f"[{mode}] {row['requests']} requests in {row['wall_s']:.2f}s, {row['output_tok_s']:.1f} out tok/s, "
              f"short ITL p50 / p99 {row['itl_short_ms_p50']:.2f} / {row['itl_short_ms_p99']:.2f} ms, "
              f"chunk gaps {row['chunk_gap_short_ms_p50']:.2f} / {row['chunk_gap_short_ms_p99']:.2f} ms, "
              f"router ITL p50 / p99 {_fmt_ms(row['itl_router_ms_p50'])} / {_fmt_ms(row['itl_router_ms_p99'])}, "
              f"update delivery p50 / p99 {_fmt_ms(row['update_delivery_ms_p50'])} / "
              f"{_fmt_ms(row['update_delivery_ms_p99'])} ms, HTTP CPU {_fmt_ms(row['http_cpu_share'])} s/s", flush=True)
        result = {"commit": _git_commit(), "args": vars(args), "meta": meta, "definitions": SERVING_DEFINITIONS,
                  "arms": rows}
        write_json(args.out, result)  # after every arm: a run cut short keeps its finished arms
    return result


def processes_cpu_seconds(pids: Sequence[int]) -> Optional[List[float]]:
    """CPU seconds each process used so far (None when one cannot be read)."""
    each = [process_cpu_seconds(pid) for pid in pids]
    return None if any(c is None for c in each) else each


def metrics_settle_s(flags: Sequence[str]) -> float:
    """How long to wait before scraping a server started with ``flags``: with several HTTP processes
    (--httpserver_workers) a page holds the others' counts as of their last publish."""
    n = int(flags[flags.index("--httpserver_workers") + 1]) if "--httpserver_workers" in flags else 1
    return 2 * METRICS_PUBLISH_S if n > 1 else 0.0


# --prefix_cache: the radix prompt cache, cache on vs off, one server per arm and round
PREFIX_CACHE_OUT = os.path.join("docs", "data", "perf", "prefix_cache.json")
PREFIX_MAIN_WORKLOADS = ("chat", "doc", "resend")  # on one server per arm and round; pressure on its own
PRESSURE_POOL_FRACTION = 0.1
PREFIX_WARM_SHORT = 32  # at most this many short warm-up requests per server
PREFIX_DEFINITIONS = {
    "clock": "client side, time.perf_counter of the benchmark process",
    "ttft_ms": "the first network read with reply text (or the finish) - the request's send",
    "ttft_turn1_ms": "ttft_ms of each conversation's first turn (resend: the first send)",
    "ttft_later_ms": "ttft_ms of turns 2.. (resend: the resends)",
    "output_tok_s": "completion tokens of all requests / the run's wall time (first send to last reply; rounds: "
                    "summed)",
    "usage_hit_rate": "sum of usage.prompt_tokens_details.cached_tokens / sum of usage.prompt_tokens",
    "metrics_hit_rate": f"/metrics growth over the run: {pcw.CACHE_HIT_TOKENS} / ({pcw.CACHE_HIT_TOKENS} + "
                        f"{pcw.CACHE_COMPUTED_TOKENS})",
    "metrics_evicted_tokens": f"/metrics growth of {pcw.CACHE_EVICTED_TOKENS} over the run",
    "KEY_on_over_off": "the cache-on arm's KEY / the cache-off arm's (pooled over rounds; ratios_by_round: per round)",
    "output_differences": "per conversation turn: the reply text of the two arms compared (same round)",
}


def _measured(url: str, arm: str, rnd: int, send) -> pcw.ArmRun:
    """``send()`` -> (replies per conversation, wall s) between two scrapes of /metrics."""
    before = scrape(url)
    replies, wall = send()
    after = scrape(url)
    return pcw.ArmRun(arm, rnd, replies, wall, pcw.cache_counters(after - before), pcw.cache_gauges(after))


def _one_turn_each(sent: Tuple[List[pcw.Reply], float]) -> Tuple[List[List[pcw.Reply]], float]:
    """Single requests as one-turn conversations (``ArmRun``'s shape)."""
    replies, wall = sent
    return [[r] for r in replies], wall


def _resend(url: str, work: pcw.PrefixWorkloads, desc: str) -> Tuple[List[List[pcw.Reply]], float]:
    """The first send, then the resends one at a time (each 1 new token): one 'conversation'."""
    first, w0 = pcw.run_requests(url, pcw.COMPLETIONS_PATH, [pcw.completion_body(work.resend_first, 1)], 1)
    rest, w1 = pcw.run_requests(url, pcw.COMPLETIONS_PATH, [pcw.completion_body(p, 1) for p in work.resend_prompts],
                                1, desc)
    return [first + rest], w0 + w1


def prefix_warm_texts(tok, texts: Sequence[str], questions: Sequence[str], lens: Sequence[int],
                      short: int) -> List[str]:
    """Untimed prompts: one per workload length (each its own GSM8K train text, sharing no prefix
    with the workloads or each other past the template's first tokens), then ``short`` GSM8K questions."""
    out = [exact_length_prompt_text(tok, n, texts, pcw.WARM_START + 300 * j)[0] for j, n in enumerate(lens)]
    return out + chat_prompt_texts(tok, [questions[-1 - i] for i in range(min(short, len(questions)))])


def run_prefix_cache(args) -> Dict[str, object]:
    """Per round: per arm (cache on, cache off) a server for the chat, document and resend
    workloads, then per arm a server with a small KV pool for the pressure workload; the JSON
    after every arm."""
    import torch
    from transformers import AutoTokenizer

    from lightllm.server.api_cli import make_argument_parser
    from lightllm.server.router.model_infer.mode_backend.base_backend import CPU_DEFAULT_KV_TOKENS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shared = tuple(shlex.split(args.server_args or ""))
    model_dir, dtype = resolve_model_and_dtype([ServerConfig("prefix_cache", shared)], device)
    parser = make_argument_parser()
    if pcw.OFF in args.prefix_arms:  # before any server: a server without the prompt cache does not know the flag
        try:
            parser.parse_args(pcw.ARM_FLAGS[pcw.OFF])
        except SystemExit:
            raise SystemExit(f"this server has no {pcw.ARM_FLAGS[pcw.OFF][0]} (no prompt cache yet?): "
                             f"run --prefix_arms {pcw.ON}") from None
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k))]
    texts = [q.question for q in load_gsm8k(gsm8k_path("train", args.gsm8k_train))]
    t0 = time.perf_counter()
    work = pcw.build_prefix_workloads(tok, texts, questions, args.system_tokens, args.conversations, args.turns,
                                      args.doc_tokens, args.doc_questions, args.resend_tokens, args.resend_times,
                                      args.resend_new_tokens, args.pressure_conversations, args.pressure_turns)
    print(f"workloads built in {time.perf_counter() - t0:.1f}s: {work.summary()}", flush=True)
    selected = [w for w in pcw.WORKLOADS if w in args.prefix_workloads]
    main_workloads = [w for w in selected if w in PREFIX_MAIN_WORKLOADS]
    new = args.prefix_new_tokens
    need = {"chat": pcw.conversation_max_len(tok, work.system_tokens, work.chat_turns, new) + new,
            "doc": max((pcw.server_token_count(tok, m) for m in work.doc_messages), default=1)
            + pcw.TEMPLATE_MARGIN + new,
            "resend": max([work.resend_first_tokens] + work.resend_prompt_tokens) + 1,
            "pressure": pcw.conversation_max_len(tok, work.system_tokens, work.pressure_turns,
                                                 args.pressure_new_tokens) + args.pressure_new_tokens}
    main_len = auto_max_req_total_len([need[w] for w in main_workloads] or [1], 0)
    running = max([args.conversations if "chat" in selected else 1, args.doc_concurrency if "doc" in selected else 1])
    main_flags = wave_server_flags(None, running, main_len) + list(shared)
    pressure_len = auto_max_req_total_len([need["pressure"]], 0)
    pressure_flags = wave_server_flags(None, args.pressure_conversations, pressure_len) + list(shared)
    ns = parser.parse_args(pressure_flags)  # --server_args may change the running size, lengths, MTP
    mtp_step = ns.mtp_step if ns.mtp_mode else 0
    pool_rule = (f"--pressure_kv_tokens {args.pressure_kv_tokens}" if args.pressure_kv_tokens else
                 f"{PRESSURE_POOL_FRACTION} x the default pool of the pressure servers' flags when memory does not "
                 f"bound it (running_max_req_size {ns.running_max_req_size} x (max_req_total_len "
                 f"{ns.max_req_total_len} + mtp_step {mtp_step})" + (f", at most the CPU default "
                 f"{CPU_DEFAULT_KV_TOKENS}" if device == "cpu" else "") + "), at least one full request")
    pool = args.pressure_kv_tokens or pcw.pressure_pool_tokens(
        ns.running_max_req_size, ns.max_req_total_len, mtp_step, CPU_DEFAULT_KV_TOKENS if device == "cpu" else None,
        PRESSURE_POOL_FRACTION)
    pressure_flags += ["--max_total_token_num", str(pool)]
    print(f"pressure KV pool: {pool} tokens ({pool_rule})", flush=True)
    warm_short = min(args.warmup_requests, PREFIX_WARM_SHORT)
    warm_lens = {"main": [n for n in (work.system_tokens + 64, work.doc_tokens + 64, work.resend_first_tokens)
                          if n + args.warmup_tokens <= main_len],
                 "pressure": [n for n in (work.system_tokens + 64,) if n + args.warmup_tokens <= pressure_len]}
    warm = {g: prefix_warm_texts(tok, texts, questions, lens, warm_short) if args.warmup_requests else []
            for g, lens in warm_lens.items()}
    log_dir = tempfile.mkdtemp(prefix="bench_prefix_cache_")
    meta = {"model_dir": model_dir, "dtype": dtype, "torch": torch.__version__,
            "prompt_source": {"test": gsm8k_path("test", args.gsm8k), "train": gsm8k_path("train", args.gsm8k_train)},
            "workloads": work.summary(), "server_flags": {"main": main_flags, "pressure": pressure_flags},
            "arm_flags": pcw.ARM_FLAGS, "pressure_kv_tokens": pool, "pressure_kv_tokens_rule": pool_rule,
            "log_dir": log_dir, "servers": []}
    runs: Dict[str, List[pcw.ArmRun]] = {w: [] for w in selected}
    diffs: Dict[str, List[Dict[str, int]]] = {"chat": [], "pressure": []}

    def result() -> Dict[str, object]:
        out = {}
        for w in selected:
            entry = pcw.workload_entry(runs[w], args.prefix_arms)
            if w in diffs:
                entry["output_differences"] = diffs[w]
            if w == "chat":
                entry["done"] = pcw.chat_done(entry["ratios"])
            elif w == "resend":
                entry["done"] = pcw.resend_done(entry["arms"].get(pcw.ON))
            elif w == "pressure":
                entry["done"] = pcw.pressure_done(entry["arms"], diffs[w])
            out[w] = entry
        return {"commit": _git_commit(), "device": device,
                "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "args": vars(args), "meta": meta,
                "definitions": PREFIX_DEFINITIONS, "workloads": out}

    def started(group: str, arm: str, rnd: int, flags: List[str], log_path: str, server, t0: float) -> None:
        with open(log_path) as f:
            pool_now = pcw.kv_pool_from_log(f.read())
        meta["servers"].append({"group": group, "arm": arm, "round": rnd, "flags": flags, "log": log_path,
                                "up_s": time.perf_counter() - t0, "kv_pool_tokens": pool_now})
        print(f"[{group} {arm} r{rnd}] up in {time.perf_counter() - t0:.1f}s at {server.url} "
              f"(KV pool {pool_now} tokens)", flush=True)
        if warm[group]:
            t0 = time.perf_counter()
            warm_up(server.url, warm[group], args.warmup_tokens, min(16, len(warm[group])), requests=len(warm[group]))
            print(f"[{group} {arm} r{rnd}] warm-up: {len(warm[group])} requests in {time.perf_counter() - t0:.1f}s",
                  flush=True)

    def report(w: str, run: pcw.ArmRun) -> None:
        row = pcw.arm_row(f"{run.arm} r{run.round}", [run])
        print(f"[{w} {run.arm} r{run.round}] {row['requests']} requests ({row['failed']} failed) in "
              f"{row['wall_s']:.2f}s, {row['output_tok_s'] or 0:.1f} out tok/s, TTFT first / later p50 "
              f"{row['ttft_turn1_ms_p50'] or float('nan'):.1f} / {row['ttft_later_ms_p50'] or float('nan'):.1f} ms, "
              f"hit rate (usage) {row['usage_hit_rate']}", flush=True)

    for rnd in range(args.rounds):
        by_arm: Dict[str, Dict[str, pcw.ArmRun]] = {}
        for group, flags, group_workloads in (("main", main_flags, main_workloads),
                                              ("pressure", pressure_flags, [w for w in selected if w == "pressure"])):
            if not group_workloads:
                continue
            for arm in args.prefix_arms:
                arm_flags = flags + pcw.ARM_FLAGS[arm]
                log_path = os.path.join(log_dir, f"server_{group}_{arm}_r{rnd}.log")
                print(f"[{group} {arm} r{rnd}] starting server: {' '.join(arm_flags)}  (log: {log_path})", flush=True)
                t0 = time.perf_counter()
                with serve(arm_flags, log_path) as server:
                    started(group, arm, rnd, arm_flags, log_path, server, t0)
                    for w in group_workloads:
                        desc = f"{w} {arm} r{rnd}"
                        if w == "chat":
                            run = _measured(server.url, arm, rnd, lambda: pcw.run_conversations(
                                server.url, work.system, work.chat_turns, new, desc))
                        elif w == "doc":
                            bodies = [pcw.chat_body([{"role": "user", "content": m}], new) for m in work.doc_messages]
                            run = _measured(server.url, arm, rnd, lambda: _one_turn_each(pcw.run_requests(
                                server.url, pcw.CHAT_PATH, bodies, args.doc_concurrency, desc)))
                        elif w == "resend":
                            run = _measured(server.url, arm, rnd, lambda: _resend(server.url, work, desc))
                        else:
                            run = _measured(server.url, arm, rnd, lambda: pcw.run_conversations(
                                server.url, work.system, work.pressure_turns, args.pressure_new_tokens, desc))
                        runs[w].append(run)
                        by_arm.setdefault(w, {})[arm] = run
                        report(w, run)
                for w in diffs:
                    if w in group_workloads and arm == args.prefix_arms[-1] and len(by_arm.get(w, {})) == 2:
                        diffs[w].append({"round": rnd, **pcw.output_differences(by_arm[w][pcw.ON].replies,
                                                                                 by_arm[w][pcw.OFF].replies)})
                write_json(args.out, result())  # after every arm: a run cut short keeps its finished arms
    return result()


def print_prefix_cache(result: Dict[str, object]) -> None:
    """A table per workload (the pooled arms, then each round's when there are several), its ratios
    and its done-means."""
    for w, entry in result["workloads"].items():
        rows = list(entry["arms"].values()) + (entry["rows"] if result["args"]["rounds"] > 1 else [])
        print(f"\n{w}:")
        print(render_table(rows, pcw.WORKLOAD_TABLES[w]))
        shown = {k: v for k, v in entry["ratios"].items() if v is not None}
        if shown:
            print("on / off: " + ", ".join(f"{k.replace('_on_over_off', '')} {v:.3f}" for k, v in shown.items()))
        if entry.get("output_differences"):
            print("output differences (on vs off): " + "; ".join(
                f"r{d['round']}: {d['different']} of {d['compared']} turns differ, {d['missing']} missing"
                for d in entry["output_differences"]))
        if "done" in entry:
            print("done: " + ", ".join(f"{k} {'-' if v is None else ('yes' if v else 'NO')}"
                                       for k, v in entry["done"].items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server_args", default="",
                   help="flags for every server (one string, shell-quoted; --serving: after its own, so they win)")
    p.add_argument("--configs", default=None,
                   help='named server configs "name=ARGS;name2=ARGS2" (after --server_args); ratios are to the first')
    p.add_argument("--num_prompts", type=int, default=None,
                   help=f"requests (default 64; --serving: {SERVING_NUM_PROMPTS} per arm)")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help=f"default 128; --serving: {SERVING_SHORT_NEW_TOKENS}, of the short requests")
    p.add_argument("--ignore_eos", action="store_true", help="every request generates exactly max_new_tokens")
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight (--serving: closed-loop)")
    p.add_argument("--stream", action="store_true", help="use /generate_stream and report mean TTFT")
    p.add_argument("--hf_batch_size", type=int, default=64)
    p.add_argument("--skip_hf", action="store_true", help="no transformers baseline (ratios to the first config only)")
    p.add_argument("--warmup_requests", type=int, default=None,
                   help="untimed requests per server before the run (default: --concurrency, at most --num_prompts)")
    p.add_argument("--warmup_tokens", type=int, default=16, help="max_new_tokens of the warm-up requests")
    p.add_argument("--gsm8k", default=None, help="GSM8K jsonl ({question, answer} per line; default: test.jsonl in "
                                                 "$LIGHTLLM_GSM8K_DIR or ../shared/data/gsm8k beside the checkout)")
    p.add_argument("--prompt_file", default=None, help="prompts, one per line, used as is (instead of GSM8K)")
    p.add_argument("--out", default=None,
                   help=f"JSON results path (default: {DEFAULT_OUT}; --long_context: {LONG_CONTEXT_OUT}; "
                        f"--serving: {SERVING_OUT}; --prefix_cache: {PREFIX_CACHE_OUT})")
    p.add_argument("--matrix", action="store_true",
                   help="in-process engine vs transformers over models x modes x batches (CUDA; "
                        "writes the rows of docs/data/perf/bench_vs_hf.json to --out)")
    p.add_argument("--matrix_models", nargs="+", default=list(MATRIX_MODELS), choices=MATRIX_MODELS)
    p.add_argument("--matrix_modes", nargs="+", default=list(MATRIX_MODES), choices=list(MATRIX_MODES),
                   help="--matrix: the engine modes to run (ratios to plain need plain)")
    p.add_argument("--waves", type=int, default=2,
                   help="--matrix: timed waves per cell; --long_context: per wave length (pooled)")
    p.add_argument("--disable_cudagraph", action="store_true", help="--matrix, --long_context: eager engine decode")
    p.add_argument("--long_context", action="store_true",
                   help="in-process engine: time to first token on long prompts vs a transformers forward, and "
                        f"{LONG_WAVE_REQUESTS} concurrent long vs short prompts (CUDA; writes {LONG_CONTEXT_OUT})")
    p.add_argument("--long_models", nargs="+", default=list(MATRIX_MODELS), choices=MATRIX_MODELS,
                   help=f"--long_context: the models (the 8B-shaped dummy: TTFT at {DUMMY_8B_PROMPT_LENS} tokens)")
    p.add_argument("--long_lens", type=int, nargs="+", default=list(LONG_PROMPT_LENS),
                   help="--long_context: the embedded model's TTFT prompt lengths (tokens)")
    p.add_argument("--wave_lens", type=int, nargs=2, default=list(LONG_WAVE_LENS), metavar=("LONG", "SHORT"),
                   help=f"--long_context: prompt tokens of the long and the short {LONG_WAVE_REQUESTS}-request waves")
    p.add_argument("--serving", action="store_true",
                   help="one server per --serving_modes arm, a closed-loop streamed mix of short GSM8K and long "
                        f"prompts: output tok/s, TTFT, inter-token latency, decode batch (writes {SERVING_OUT})")
    p.add_argument("--serving_modes", nargs="+", default=list(DEFAULT_SERVING_MODES), choices=list(SERVING_MODES),
                   help="--serving: the arms, in order (ratios are to the first)")
    p.add_argument("--serving_long_fraction", type=float, default=SERVING_LONG_FRACTION,
                   help="--serving: the share of long prompts")
    p.add_argument("--serving_long_lens", type=int, nargs=2, default=list(SERVING_LONG_LENS), metavar=("LO", "HI"),
                   help="--serving: long prompts' tokens, drawn uniformly in [LO, HI] (seeded)")
    p.add_argument("--serving_long_new_tokens", type=int, default=None,
                   help=f"--serving: max_new_tokens of the long requests (default {SERVING_LONG_NEW_TOKENS}, "
                        "at most --max_new_tokens)")
    p.add_argument("--seed", type=int, default=0, help="--serving: the long prompts' lengths and the order")
    p.add_argument("--client_procs", type=int, default=SERVING_CLIENT_PROCS,
                   help="--serving: client processes sharing the concurrency (one Python client may lag "
                        "behind thousands of chunks per second)")
    p.add_argument("--prefix_cache", action="store_true",
                   help="the prompt cache on vs off (--disable_dynamic_prompt_cache): multi-turn chats, a shared "
                        f"document, a resent long prompt, memory pressure (writes {PREFIX_CACHE_OUT})")
    p.add_argument("--prefix_workloads", nargs="+", default=list(pcw.WORKLOADS), choices=list(pcw.WORKLOADS),
                   help="--prefix_cache: the workloads to run")
    p.add_argument("--prefix_arms", nargs="+", default=[pcw.ON, pcw.OFF], choices=[pcw.ON, pcw.OFF],
                   help="--prefix_cache: the arms, in order within each round (on: the default server; off: "
                        "--disable_dynamic_prompt_cache)")
    p.add_argument("--rounds", type=int, default=1,
                   help="--prefix_cache: rounds of the arms (on, off, on, off, ...: drift shows between rounds)")
    p.add_argument("--gsm8k_train", default=None,
                   help="--prefix_cache: GSM8K train jsonl, the long texts (default: train.jsonl beside test.jsonl's "
                        "default place)")
    p.add_argument("--prefix_new_tokens", type=int, default=64,
                   help="--prefix_cache: max_new_tokens (ignore_eos) of the chat and document requests")
    p.add_argument("--system_tokens", type=int, default=1000, help="--prefix_cache: the chats' system prompt tokens")
    p.add_argument("--conversations", type=int, default=32, help="--prefix_cache: concurrent chat conversations")
    p.add_argument("--turns", type=int, default=8, help="--prefix_cache: turns per chat conversation")
    p.add_argument("--doc_tokens", type=int, default=3000, help="--prefix_cache: the shared document's tokens")
    p.add_argument("--doc_questions", type=int, default=64, help="--prefix_cache: questions about the document")
    p.add_argument("--doc_concurrency", type=int, default=16, help="--prefix_cache: document questions in flight")
    p.add_argument("--resend_tokens", type=int, default=6000, help="--prefix_cache: the resent prompt's tokens")
    p.add_argument("--resend_times", type=int, default=5, help="--prefix_cache: resends after the first send")
    p.add_argument("--resend_new_tokens", type=int, default=50,
                   help="--prefix_cache: tokens of the text appended to each resend")
    p.add_argument("--pressure_conversations", type=int, default=128,
                   help="--prefix_cache: concurrent conversations under memory pressure")
    p.add_argument("--pressure_turns", type=int, default=3, help="--prefix_cache: turns per pressure conversation")
    p.add_argument("--pressure_new_tokens", type=int, default=16,
                   help="--prefix_cache: max_new_tokens (ignore_eos) of the pressure replies")
    p.add_argument("--pressure_kv_tokens", type=int, default=None,
                   help="--prefix_cache: the pressure servers' --max_total_token_num (default: "
                        f"{PRESSURE_POOL_FRACTION} x the pool the server sizes by default for their flags when memory "
                        "does not bound it, as on an H200 with the embedded model)")
    args = p.parse_args(argv)
    if sum((args.serving, args.long_context, args.matrix, args.prefix_cache)) > 1:
        p.error("--serving, --long_context, --matrix and --prefix_cache are separate runs")
    if args.prefix_cache:
        for name in ("rounds", "prefix_new_tokens", "system_tokens", "conversations", "turns", "doc_tokens",
                     "doc_questions", "doc_concurrency", "resend_tokens", "resend_new_tokens",
                     "pressure_conversations", "pressure_turns", "pressure_new_tokens"):
            if getattr(args, name) < 1:
                p.error(f"--{name} must be >= 1")
        if args.resend_times < 0:
            p.error("--resend_times must be >= 0")
        if args.pressure_kv_tokens is not None and args.pressure_kv_tokens < 1:
            p.error("--pressure_kv_tokens must be >= 1")
        if len(set(args.prefix_arms)) != len(args.prefix_arms):
            p.error("--prefix_arms: an arm twice")
    if args.num_prompts is None:
        args.num_prompts = SERVING_NUM_PROMPTS if args.serving else 64
    if args.max_new_tokens is None:
        args.max_new_tokens = SERVING_SHORT_NEW_TOKENS if args.serving else 128
    if args.serving_long_new_tokens is None:
        args.serving_long_new_tokens = min(SERVING_LONG_NEW_TOKENS, args.max_new_tokens)
    lo, hi = args.serving_long_lens
    if not 1 <= lo <= hi:
        p.error("--serving_long_lens: need 1 <= LO <= HI")
    if not 0.0 <= args.serving_long_fraction <= 1.0:
        p.error("--serving_long_fraction must be in [0, 1]")
    for name in ("num_prompts", "max_new_tokens", "concurrency", "hf_batch_size", "serving_long_new_tokens",
                 "client_procs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.long_lens + args.wave_lens) < 1:
        p.error("--long_lens and --wave_lens must be >= 1")
    if args.warmup_requests is None:
        args.warmup_requests = args.concurrency
    if args.out is None:
        args.out = (LONG_CONTEXT_OUT if args.long_context else SERVING_OUT if args.serving
                    else PREFIX_CACHE_OUT if args.prefix_cache else DEFAULT_OUT)
    return args


def _exit_on_sigterm(signum, frame):
    # SystemExit unwinds through the ``finally`` that stops the running server (a bare SIGTERM would not)
    sys.exit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    import torch
    import transformers

    if args.serving:
        result = run_serving(args)
        print()
        print(render_table(result["arms"], SERVING_TABLE))
        print(f"\nx 1st: relative to '{result['arms'][0]['mode']}'. during long prefill: short requests' "
              "inter-token gaps that overlap a long request's wait for its first token.")
        print(f"wrote {args.out}")
        return 0
    if args.prefix_cache:
        result = run_prefix_cache(args)
        print_prefix_cache(result)
        print(f"\nwrote {args.out}")
        return 0
    if args.long_context:
        result = run_long_context(args)
        print(render_table(ttft_rows(result), LONG_TABLE))
        print(render_table(wave_rows(result, args), WAVE_TABLE), flush=True)
        write_json(args.out, result)
        print(f"wrote {args.out}")
        return 0
    if args.matrix:
        rows = add_matrix_ratios(run_matrix(args))
        print(render_table(rows, MATRIX_TABLE), flush=True)
        write_json(args.out, rows)
        return 0
    configs = parse_configs(args.configs, args.server_args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir, dtype = resolve_model_and_dtype(configs, device)
    prompts = build_prompts(args, model_dir)
    log_dir = tempfile.mkdtemp(prefix="bench_e2e_")  # the servers' logs
    print(f"model {model_dir} | {device} {dtype} | {len(prompts)} prompts x {args.max_new_tokens} tokens "
          f"(ignore_eos={args.ignore_eos}) | concurrency {args.concurrency} | hf batch {args.hf_batch_size}",
          flush=True)

    rows: List[dict] = []
    texts: Dict[str, List[str]] = {}
    for config in configs:
        row, results = run_engine(config, prompts, args, log_dir)
        texts[config.name] = [r.text for r in results]
        if args.ignore_eos and any(r.output_tokens != args.max_new_tokens for r in results):
            print(f"WARNING [{config.name}]: --ignore_eos but some requests did not generate "
                  f"{args.max_new_tokens} tokens: {dict(Counter(str(r.output_tokens) for r in results))}", flush=True)
        rows.append(row)

    hf_row = None
    if not args.skip_hf:
        from lightllm.server.httpserver.manager import load_eos_token_ids
        from transformers import AutoTokenizer

        eos_ids = load_eos_token_ids(model_dir, AutoTokenizer.from_pretrained(model_dir))
        hf_row, hf_results = run_transformers(model_dir, device, dtype, prompts, args, eos_ids)
        texts[HF_NAME] = [r.text for r in hf_results]
        for row in rows:
            if row["prompt_tokens"] != hf_row["prompt_tokens"]:
                print(f"WARNING [{row['name']}]: server saw {row['prompt_tokens']} prompt tokens, "
                      f"transformers {hf_row['prompt_tokens']}: the prompts differ", flush=True)

    first = configs[0].name
    table_rows = rows + ([hf_row] if hf_row else [])
    for row in table_rows:
        row["same_text_as_first"] = same_fraction(texts[row["name"]], texts[first])
        row["same_text_as_hf"] = same_fraction(texts[row["name"]], texts[HF_NAME]) if hf_row else None
    add_ratios_to_baseline_and_first(table_rows, hf_row)

    print()
    print(render_table(table_rows, TABLE_COLUMNS))
    print(f"\nx HF / x 1st: output tokens/s relative to transformers / to '{first}'.")

    meta = {
        "model_dir": model_dir, "device": device, "dtype": dtype,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "num_prompts": len(prompts), "prompt_source": args.prompt_file or gsm8k_path("test", args.gsm8k),
        "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos, "concurrency": args.concurrency,
        "stream": args.stream, "hf_batch_size": args.hf_batch_size, "server_args": args.server_args,
        "configs": [asdict(c) for c in configs], "log_dir": log_dir,
    }
    write_json(args.out, {"meta": meta, "engine": rows, HF_NAME: hf_row})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
