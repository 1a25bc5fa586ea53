"""Tensor parallelism's throughput (issue 31): Llama-3-8B's shape with random weights (``--load_format dummy``)
served at ``--tp 1`` and at each larger ``--tp`` the machine has GPUs for (and ``--tp 2 --dp 2``), with CUDA
graphs (``--enable_tp_cudagraph``) and eagerly, plain decoding and MTP K = 3 with a random eagle draft (the step's cost;
its acceptance means nothing), at batch 1 / 64 / 256 (closed loop, ``ignore_eos``). One server per (mode, arm),
its batches run in turn; each row's ``x_tp1`` is its tok/s over ``--tp 1``'s at the same mode and batch, measured
in the same run. On CPU (gloo ranks, ``--shape tiny``) it checks the path, not speed.

    python benchmarks/bench_tp.py --gsm8k .data/test.jsonl --out docs/data/perf/tp.json
"""
import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_e2e_throughput as e2e  # noqa: E402

from lightllm.tools.client import generate_body, model_dir_or_embedded, send_timed, serve  # noqa: E402
from lightllm.tools.prompts import chat_prompt_texts, gsm8k_path, load_gsm8k, take_cyclic  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

SHAPES = {
    "8b": e2e.LLAMA3_8B_SHAPE,
    # CPU: the path only (gloo ranks): 4 q / 2 kv heads split over 2 ranks
    "tiny": dict(e2e.LLAMA3_8B_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, torch_dtype="float32"),
}
MODES = {"plain": [], "mtp3": ["--mtp_mode", "eagle_with_att", "--mtp_step", "3"]}
MIN_TIMED_REQUESTS = 16  # each batch's timed wave has at least this many requests (batch 1: 16 in turn)
WARMUP_NEW_TOKENS = 8
DRAFT_STD = 0.02  # the random draft's weight scale

TABLE = [Column("mode", "mode", "s"), Column("arm", "arm", "s"), Column("batch", "batch", "d"),
         Column("output_tokens_per_s", "tok/s", ".1f"), Column("x_tp1", "x tp1", ".2f", "x"),
         Column("tokens_per_step", "tok/step", ".2f"), Column("latency_p50_s", "latency p50 s", ".3f")]


def arms(tp_sizes: Sequence[int], gpus: int, eager: bool) -> Dict[str, List[str]]:
    """Server flags by arm name: tp1, then tpN (graphs) and tpN_eager for each N > 1 the GPUs allow (on CPU: gloo
    ranks), and with two ranks tp2_dp2 (two DP groups of one rank each) the same way."""
    out = {"tp1": ["--tp", "1"]}
    sizes = [n for n in sorted(set(tp_sizes) - {1}) if not gpus or n <= gpus]
    for name, flags in [(f"tp{n}", ["--tp", str(n)]) for n in sizes] + \
            ([("tp2_dp2", ["--tp", "2", "--dp", "2"])] if 2 in sizes else []):
        out[name] = flags + ["--enable_tp_cudagraph"]
        if eager:
            out[f"{name}_eager"] = flags
    return out


def add_tp1_ratios(rows: List[dict]) -> List[dict]:
    """``x_tp1``: tok/s over the tp1 row of the same mode and batch (None without one)."""
    base = {(r["mode"], r["batch"]): r["output_tokens_per_s"] for r in rows if r["arm"] == "tp1"}
    for r in rows:
        b = base.get((r["mode"], r["batch"]))
        r["x_tp1"] = r["output_tokens_per_s"] / b if b else None
    return rows


def write_model(out_dir: str, shape: str, with_draft: bool) -> Dict[str, str]:
    """The dummy model dir (config and the embedded model's tokenizer), and a random eagle draft for it."""
    import torch
    from transformers import AutoConfig

    from lightllm.models.llama_mtp.train_module import random_draft

    model = e2e.write_dummy_model_dir(os.path.join(out_dir, "model"), SHAPES[shape], model_dir_or_embedded(None))
    dirs = {"model": model}
    if with_draft:
        dtype = torch.float32 if shape == "tiny" else torch.bfloat16
        dirs["draft"] = random_draft(AutoConfig.from_pretrained(model), os.path.join(out_dir, "draft"), True, 1,
                                     seed=0, std=DRAFT_STD, dtype=dtype)
    return dirs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm8k", default=None, help="GSM8K test JSONL (the prompts)")
    p.add_argument("--shape", choices=list(SHAPES), default="8b")
    p.add_argument("--tp_sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--no_eager", action="store_true", help="no eager arms beside the graphed ones")
    p.add_argument("--server_args", default="", help="more flags for every server")
    p.add_argument("--out", default="tp.json")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    work = tempfile.mkdtemp(prefix="bench_tp_")
    dirs = write_model(work, args.shape, "mtp3" in args.modes)
    tok = AutoTokenizer.from_pretrained(model_dir_or_embedded(None))  # its chat template too
    n = max(max(args.batches), MIN_TIMED_REQUESTS)
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", args.gsm8k), n)]
    texts = chat_prompt_texts(tok, take_cyclic(questions, n))
    common = ["--model_dir", dirs["model"], "--load_format", "dummy", "--running_max_req_size", str(max(args.batches)),
              "--max_req_total_len", "1024", "--disable_dynamic_prompt_cache", *args.server_args.split()]
    commit = e2e._git_commit()
    rows: List[dict] = []
    for mode in args.modes:
        draft = ["--mtp_draft_model_dir", dirs["draft"]] if mode != "plain" else []
        for arm, flags in arms(args.tp_sizes, gpus, not args.no_eager).items():
            log = os.path.join(work, f"server_{mode}_{arm}.log")
            t0 = time.perf_counter()
            with serve(common + MODES[mode] + draft + flags, log) as server:
                up_s = time.perf_counter() - t0
                for batch in args.batches:
                    warm = [generate_body(t, WARMUP_NEW_TOKENS, ignore_eos=True) for t in texts[:batch]]
                    send_timed(server.url, warm, batch)
                    bodies = [generate_body(t, args.max_new_tokens, ignore_eos=True)
                              for t in texts[:max(batch, MIN_TIMED_REQUESTS)]]
                    timed, wall = send_timed(server.url, bodies, batch)
                    row = e2e.summarize(arm, [e2e._result(t) for t in timed], wall)
                    rows.append({"mode": mode, "arm": arm, "batch": batch, "flags": flags, "server_up_s": up_s,
                                 "shape": args.shape, "gpus": gpus, "commit": commit, **row})
                    print(render_table(add_tp1_ratios(rows)[-1:], TABLE), flush=True)
                    write_json(args.out, add_tp1_ratios(rows))
    print(render_table(add_tp1_ratios(rows), TABLE))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
