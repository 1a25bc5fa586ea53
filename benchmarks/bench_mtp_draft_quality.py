"""Draft quality: mean accepted drafts and tokens per decode step for several K, and output
tokens/s with and without MTP, all in one run (in-process engine, greedy, strict
verification), on GSM8K test and the held-out prompts by kind, for one or more drafts.

Every arm decodes all prompts together (GSM8K test, then the held-out set); tokens per step
are then summed by prompt set. Strict MTP should be token-identical to plain decoding: the
JSON reports how many requests differ (bf16 batches can differ without
--enable_deterministic_inference), it does not fail on them.

    python benchmarks/bench_mtp_draft_quality.py --num_questions 200 --draft_dir default NEW_DRAFT --out q.json
"""
import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402 (after the path set-up)
from lightllm.tools.client import USAGE, auto_max_req_total_len, generate_offline, model_dir_or_embedded  # noqa: E402
from lightllm.tools.magpie_prompts import DEFAULT_HELDOUT_PATH, KIND_MATH, load_heldout  # noqa: E402
from lightllm.tools.prompts import chat_prompt_ids, gsm8k_path, load_gsm8k  # noqa: E402
from lightllm.tools.report import Column, ratio, render_table, write_json  # noqa: E402

DEFAULT_DRAFT = "default"  # --draft_dir value: the engine's own choice (the packaged draft)
GSM8K_TEST = "gsm8k_test"  # the prompt set name of the GSM8K questions
NON_MATH = "heldout_non_math"  # every held-out kind but math together
WARMUP_REQUESTS = 8
ARM_TABLE = (Column("draft", "draft"), Column("arm", "arm"), Column("mtp_step", "K"),
             Column("mean_accepted_drafts_per_step", "acc drafts/step", ".3f"),
             Column("mean_tokens_per_step", "tokens/step", ".3f"), Column("output_tokens_per_s", "out tok/s", ".1f"),
             Column("speedup_vs_no_mtp", "x no-MTP", ".2f"),
             Column("requests_differing_from_no_mtp", "differ from no-MTP"))


def tokens_per_step(results: Sequence) -> Optional[float]:
    """Committed tokens per decode step of ``results`` (None without a decode step)."""
    return ratio(sum(sum(r.accept_lens) for r in results), sum(len(r.accept_lens) for r in results))


def run_arm(draft: str, name: str, args: StartArgs, prompts: Sequence[List[int]], groups: Sequence[str],
            max_new_tokens: int) -> Dict:
    """One engine run over every prompt; ``groups[i]`` names prompt i's set (GSM8K or a held-out kind)."""
    params = [{"max_new_tokens": max_new_tokens}] * len(prompts)
    res, secs = generate_offline(args, prompts, params, warmup=min(WARMUP_REQUESTS, len(prompts)), progress=False)
    out_tokens = sum(len(r.token_ids) for r in res)
    steps = sum(len(r.accept_lens) for r in res)
    by_group = {g: [r for r, rg in zip(res, groups) if rg == g] for g in dict.fromkeys(groups)}
    by_group[NON_MATH] = [r for r, g in zip(res, groups) if g not in (GSM8K_TEST, KIND_MATH)]
    return {
        "draft": draft,
        "arm": name,
        "mtp_step": args.mtp_step,
        "requests": len(res),
        "output_tokens": out_tokens,
        "seconds": secs,
        "output_tokens_per_s": out_tokens / secs,
        "mean_accepted_drafts_per_step": ratio(sum(r.mtp_accepted_token_num for r in res), steps) or 0.0,
        "mean_tokens_per_step": tokens_per_step(res) or 1.0,
        "tokens_per_step_by_set": {g: tokens_per_step(rs) for g, rs in by_group.items() if rs},
        "token_ids": [r.token_ids for r in res],
    }


def measure(model_dir: Optional[str], prompts: Sequence[List[int]], groups: Sequence[str], drafts: Sequence[str],
            steps: Sequence[int], mtp_mode: str, max_new_tokens: int, asd_usage: bool = False,
            deterministic: bool = False) -> List[Dict]:
    """The no-MTP arm, then every draft at every K (strict, and with ``asd_usage`` the ASD usage
    setting too); each MTP row counts the requests whose tokens differ from no-MTP. ``deterministic``:
    every arm with --enable_deterministic_inference (CUDA), under which strict rows differ in none."""
    common = dict(model_dir=model_dir, running_max_req_size=len(prompts),
                  max_req_total_len=auto_max_req_total_len([len(p) for p in prompts], max_new_tokens),
                  enable_deterministic_inference=deterministic)
    rows = [run_arm("-", "no_mtp", StartArgs(**common), prompts, groups, max_new_tokens)]
    for draft in drafts:
        dirs = None if draft == DEFAULT_DRAFT else draft.split(",")
        for k in steps:
            for asd, suffix in [({}, "")] + ([(USAGE.start_args(), "_asd_usage")] if asd_usage else []):
                args = StartArgs(**common, mtp_mode=mtp_mode, mtp_step=k, mtp_draft_model_dir=dirs, **asd)
                rows.append(run_arm(draft, f"{mtp_mode}_k{k}{suffix}", args, prompts, groups, max_new_tokens))
    base, base_ids = rows[0], rows[0]["token_ids"]
    for r in rows:
        r["speedup_vs_no_mtp"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["requests_differing_from_no_mtp"] = sum(a != b for a, b in zip(r.pop("token_ids"), base_ids))
    return rows


def set_table(rows: Sequence[Dict], draft: str, markdown: bool = False) -> str:
    """Tokens per step of one draft: a row per prompt set, a column per arm (K, and the ASD arms)."""
    mine = [r for r in rows if r["draft"] == draft]
    sets = list(dict.fromkeys(g for r in mine for g in r["tokens_per_step_by_set"]))
    table = [{"set": g, **{r["arm"]: r["tokens_per_step_by_set"].get(g) for r in mine}} for g in sets]
    columns = [Column("set", f"{draft}: set")] + [
        Column(r["arm"], f"K={r['mtp_step']}" + (" usage" if r["arm"].endswith("_asd_usage") else ""), ".3f")
        for r in mine]
    return render_table(table, columns, markdown)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="GSM8K test jsonl (default: $LIGHTLLM_GSM8K_DIR or "
                                                "../shared/data/gsm8k beside the checkout)")
    p.add_argument("--num_questions", type=int, default=200, help="GSM8K test questions (0: none)")
    p.add_argument("--heldout", default=DEFAULT_HELDOUT_PATH, help="held-out prompts by kind ('' for none)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--draft_dir", nargs="+", default=[DEFAULT_DRAFT],
                   help=f"drafts to compare, each a dir (several dirs of one draft: comma-separated) or "
                        f"'{DEFAULT_DRAFT}' (the engine's packaged draft, as without --mtp_draft_model_dir)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--asd_usage", action="store_true", help="each K also at the ASD usage setting (2.0625, 0.25, 2)")
    p.add_argument("--deterministic", action="store_true",
                   help="every arm with --enable_deterministic_inference (CUDA): strict MTP then differs from "
                        "no-MTP in no request (bf16 batches otherwise can, at near-ties)")
    p.add_argument("--out", default="mtp_draft_quality.json")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir_or_embedded(a.model_dir))
    questions = [q.question for q in load_gsm8k(gsm8k_path("test", a.data), a.num_questions)] if a.num_questions else []
    heldout = load_heldout(a.heldout) if a.heldout else []
    prompts = chat_prompt_ids(tok, questions + [h["prompt"] for h in heldout])
    groups = [GSM8K_TEST] * len(questions) + [h["kind"] for h in heldout]
    rows = measure(a.model_dir, prompts, groups, a.draft_dir, a.steps, a.mtp_mode, a.max_new_tokens, a.asd_usage,
                   a.deterministic)
    print(render_table(rows, ARM_TABLE))
    for draft in a.draft_dir:
        print()
        print(set_table(rows, draft))
    out = {"num_questions": len(questions), "heldout": a.heldout and os.path.relpath(a.heldout, REPO_ROOT),
           "heldout_prompts": len(heldout),
           "max_new_tokens": a.max_new_tokens, "deterministic": a.deterministic, "drafts": a.draft_dir, "rows": rows,
           "tokens_per_step_tables": {d: set_table(rows, d, markdown=True) for d in a.draft_dir}}
    write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
