"""Draft quality: mean accepted drafts and tokens per decode step for several K, and
output tokens/s with and without MTP, all in one run (in-process engine, greedy).

    python benchmarks/bench_mtp_draft_quality.py --data PATH/test.jsonl --num_questions 200 --out q.json
"""
import argparse
import json
import time
from typing import List

from transformers import AutoTokenizer

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from lightllm.tools.train_mtp_draft import build_prompt_ids
from lightllm.utils.embedded_model import get_default_model_dir


def chat_prompts(path: str, n: int, tokenizer) -> List[List[int]]:
    with open(path) as f:
        questions = [json.loads(line)["question"] for line in f][:n]
    return build_prompt_ids(tokenizer, questions)


def run_arm(name: str, args: StartArgs, prompts, max_new_tokens: int) -> dict:
    eng = OfflineEngine(args)
    eos = eng.eos_token_ids()
    params = [{"max_new_tokens": max_new_tokens}] * len(prompts)
    eng.generate(prompts[:8], params[:8], eos_token_ids=eos)  # warm-up (kernel compiles)
    t0 = time.perf_counter()
    res = eng.generate(prompts, params, eos_token_ids=eos, progress=True)
    secs = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in res)
    steps = sum(len(r.accept_lens) for r in res)
    accepted = sum(r.mtp_accepted_token_num for r in res)
    decode_tokens = sum(sum(r.accept_lens) for r in res)
    del eng
    return {
        "arm": name,
        "mtp_step": args.mtp_step,
        "requests": len(res),
        "output_tokens": out_tokens,
        "seconds": secs,
        "output_tokens_per_s": out_tokens / secs,
        "mean_accepted_drafts_per_step": accepted / steps if steps else 0.0,
        "mean_tokens_per_step": decode_tokens / steps if steps else 1.0,
        "token_ids": [r.token_ids for r in res],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--num_questions", type=int, default=200)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--mtp_draft_model_dir", nargs="+", default=None)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--out", default="mtp_draft_quality.json")
    a = p.parse_args()
    model_dir = a.model_dir or get_default_model_dir()
    prompts = chat_prompts(a.data, a.num_questions, AutoTokenizer.from_pretrained(model_dir))
    common = dict(model_dir=a.model_dir, running_max_req_size=len(prompts), max_req_total_len=1024)
    rows = [run_arm("no_mtp", StartArgs(**common), prompts, a.max_new_tokens)]
    for k in a.steps:
        args = StartArgs(**common, mtp_mode=a.mtp_mode, mtp_step=k, mtp_draft_model_dir=a.mtp_draft_model_dir)
        rows.append(run_arm(f"{a.mtp_mode}_k{k}", args, prompts, a.max_new_tokens))
    base = rows[0]
    print(f"{'arm':<22} {'K':>2} {'acc drafts/step':>15} {'tokens/step':>11} {'out tok/s':>10} {'x no-MTP':>8} {'same as no-MTP':>14}")
    for r in rows:
        r["speedup_vs_no_mtp"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["identical_to_no_mtp"] = sum(x == y for x, y in zip(r["token_ids"], base["token_ids"])) / len(prompts)
        print(f"{r['arm']:<22} {r['mtp_step']:>2} {r['mean_accepted_drafts_per_step']:>15.3f} "
              f"{r['mean_tokens_per_step']:>11.3f} {r['output_tokens_per_s']:>10.1f} {r['speedup_vs_no_mtp']:>8.2f} "
              f"{r['identical_to_no_mtp']:>14.3f}")
    for r in rows:
        r.pop("token_ids")
    with open(a.out, "w") as f:
        json.dump({"num_questions": len(prompts), "max_new_tokens": a.max_new_tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
