"""Draft quality: mean accepted drafts and tokens per decode step for several K, and
output tokens/s with and without MTP, all in one run (in-process engine, greedy).

    python benchmarks/bench_mtp_draft_quality.py --data PATH/test.jsonl --num_questions 200 --out q.json
"""
import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from transformers import AutoTokenizer  # noqa: E402 (after the path set-up)

from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402
from lightllm.tools.client import generate_offline, model_dir_or_embedded  # noqa: E402
from lightllm.tools.prompts import chat_prompt_ids, gsm8k_path, load_gsm8k  # noqa: E402
from lightllm.tools.report import Column, ratio, render_table, same_fraction, write_json  # noqa: E402

TABLE = (Column("arm", "arm"), Column("mtp_step", "K"), Column("mean_accepted_drafts_per_step", "acc drafts/step", ".3f"),
         Column("mean_tokens_per_step", "tokens/step", ".3f"), Column("output_tokens_per_s", "out tok/s", ".1f"),
         Column("speedup_vs_no_mtp", "x no-MTP", ".2f"), Column("identical_to_no_mtp", "same as no-MTP", ".3f"))


def run_arm(name: str, args: StartArgs, prompts, max_new_tokens: int) -> dict:
    params = [{"max_new_tokens": max_new_tokens}] * len(prompts)
    res, secs = generate_offline(args, prompts, params, warmup=8)
    out_tokens = sum(len(r.token_ids) for r in res)
    steps = sum(len(r.accept_lens) for r in res)
    return {
        "arm": name,
        "mtp_step": args.mtp_step,
        "requests": len(res),
        "output_tokens": out_tokens,
        "seconds": secs,
        "output_tokens_per_s": out_tokens / secs,
        "mean_accepted_drafts_per_step": ratio(sum(r.mtp_accepted_token_num for r in res), steps) or 0.0,
        "mean_tokens_per_step": ratio(sum(sum(r.accept_lens) for r in res), steps) or 1.0,
        "token_ids": [r.token_ids for r in res],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default=None, help="GSM8K test jsonl (default: $LIGHTLLM_GSM8K_DIR or "
                                                "../shared/data/gsm8k beside the checkout)")
    p.add_argument("--num_questions", type=int, default=200)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--mtp_draft_model_dir", nargs="+", default=None)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--out", default="mtp_draft_quality.json")
    a = p.parse_args()
    model_dir = model_dir_or_embedded(a.model_dir)
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", a.data), a.num_questions)]
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), questions)
    common = dict(model_dir=a.model_dir, running_max_req_size=len(prompts), max_req_total_len=1024)
    rows = [run_arm("no_mtp", StartArgs(**common), prompts, a.max_new_tokens)]
    for k in a.steps:
        args = StartArgs(**common, mtp_mode=a.mtp_mode, mtp_step=k, mtp_draft_model_dir=a.mtp_draft_model_dir)
        rows.append(run_arm(f"{a.mtp_mode}_k{k}", args, prompts, a.max_new_tokens))
    base = rows[0]
    for r in rows:
        r["speedup_vs_no_mtp"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["identical_to_no_mtp"] = same_fraction(r["token_ids"], base["token_ids"])
    print(render_table(rows, TABLE))
    for r in rows:
        r.pop("token_ids")
    write_json(a.out, {"num_questions": len(prompts), "max_new_tokens": a.max_new_tokens, "rows": rows})


if __name__ == "__main__":
    main()
