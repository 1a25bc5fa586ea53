"""Calibrate ASD's q25 setting on GSM8K TRAIN questions (the calibration recipe of docs/asd.md).

1. Generate the calibration cohort (the first ``--num_questions`` train questions, chat
   template applied, greedy) in-process twice: strict (ASD flag unset) and ASD with ``B = 0``.
   Unless both are token-identical on every request the tool stops with a non-zero exit status:
   a calibration on an engine whose B = 0 is not strict would be meaningless.
2. During the strict run a verify observer sees every verify step and takes, at each request's
   first rejected position ``j``, the positive ratios ``r_j / (K - j)`` (regret per unit of
   suffix value, ``first_rejection_ratios``).
3. ``q`` = their 25th percentile. Suggested flags: ``B = g = q``, ``m = 1``.

    python -m lightllm.tools.asd_calibrate --data ../shared/data/gsm8k/train.jsonl \\
        --num_questions 64 --mtp_step 3 --out calib.json
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence

from lightllm.tools.client import (AsdSetting, auto_max_req_total_len, engine_parser, generate_offline,
                                   model_dir_or_embedded, server_flags)
from lightllm.tools.prompts import chat_prompt_ids, gsm8k_parser, load_gsm8k, run_tool, solve_turns
from lightllm.tools.report import first_difference, write_json

QUANTILE = 0.25


class CalibrationError(RuntimeError):
    """The calibration cannot go on (B = 0 is not strict, no positive ratio, ...)."""


def first_rejection_ratios(record) -> List[float]:
    """Positive ``r_j / (K - j)``, ``r_j = z_j[t_j] - z_j[d_j]`` (processed logits), at each request's first
    rejected position ``j`` of one verify step (a ``VerifyStepRecord``: ``K + 1`` rows per request, the bonus
    row ``K`` without a draft). Nothing from a request whose drafts all match, whose first mismatch has no
    real draft (``d_j < 0`` or ``>= vocab``), or whose ratio is 0 (a tie). Only the kept ratios leave the device.
    """
    import torch

    k = record.mtp_step
    logits = record.processed_logits  # [rows, vocab]
    rows, vocab = logits.shape
    if rows % (k + 1):
        raise ValueError(f"{rows} rows is not a whole number of requests of K + 1 = {k + 1} rows")
    n = rows // (k + 1)
    if n == 0 or k == 0:
        return []
    drafts = record.drafts.reshape(n, k + 1)[:, :k].long()  # [num_reqs, K]
    targets = record.target_ids.reshape(n, k + 1)[:, :k].long()  # [num_reqs, K]
    mismatch = drafts != targets  # [num_reqs, K]
    j = mismatch.to(torch.int32).argmax(dim=1)  # [num_reqs] first mismatch (0 when none: masked below)
    d = drafts.gather(1, j[:, None].long()).squeeze(1)  # [num_reqs]
    t = targets.gather(1, j[:, None].long()).squeeze(1)  # [num_reqs]
    valid = mismatch.any(dim=1) & (d >= 0) & (d < vocab)  # [num_reqs]
    row = torch.arange(n, device=logits.device) * (k + 1) + j.long()  # [num_reqs]
    z = logits[row].float()  # [num_reqs, vocab]
    regret = z.gather(1, t[:, None]).squeeze(1) - z.gather(1, d.clamp(0, vocab - 1)[:, None]).squeeze(1)
    ratio = regret / (k - j).float()  # [num_reqs]
    keep = valid & (ratio > 0)
    return ratio[keep].tolist()


def q25(values: Sequence[float]) -> float:
    """Linearly interpolated 25th percentile (numpy's default ``quantile``)."""
    import numpy as np

    if not len(values):
        raise ValueError("no values: the 25th percentile of an empty set is undefined")
    return float(np.quantile(np.asarray(values, dtype=np.float64), QUANTILE))


def suggested_flags(q: float) -> str:
    return " ".join(server_flags(**AsdSetting.q25(q).start_args()))


def check_train_split(path: str) -> None:
    if "test" in os.path.basename(path).lower():
        raise CalibrationError(f"{path} looks like a test split: calibrate on GSM8K TRAIN questions, never test")


def _generate(args, asd_budget, max_len: int, prompts, params, observer=None):
    """One in-process engine run; the engine (and its memory) is gone when this returns."""
    from lightllm.server.core.objs.start_args_type import StartArgs

    start_args = StartArgs(model_dir=args.model_dir, mtp_mode=args.mtp_mode, mtp_step=args.mtp_step,
                           mtp_draft_model_dir=args.mtp_draft_model_dir, mtp_asd_regret_budget=asd_budget,
                           running_max_req_size=args.running_max_req_size, max_req_total_len=max_len)
    results, _ = generate_offline(start_args, prompts, params, verify_observer=observer)
    return results


def calibrate(args) -> Dict:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from transformers import AutoTokenizer

    check_train_split(args.data)
    tok_dir = model_dir_or_embedded(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    questions = load_gsm8k(args.data, args.num_questions)
    prompts = chat_prompt_ids(tokenizer, solve_turns(questions))  # eval_gsm8k's prompts
    max_len = args.max_req_total_len or auto_max_req_total_len([len(p) for p in prompts], args.max_new_tokens)
    params = [{"max_new_tokens": args.max_new_tokens, "do_sample": False}] * len(prompts)

    ratios: List[float] = []
    steps = [0]

    def observe(record) -> None:
        steps[0] += 1
        ratios.extend(first_rejection_ratios(record))

    t0 = time.perf_counter()
    strict = _generate(args, None, max_len, prompts, params, observer=observe)
    t_strict = time.perf_counter() - t0
    t0 = time.perf_counter()
    b0 = _generate(args, 0.0, max_len, prompts, params)
    t_b0 = time.perf_counter() - t0

    diff = first_difference([r.token_ids for r in strict], [r.token_ids for r in b0])
    if diff is not None:
        i, pos = diff
        n_diff = sum(a.token_ids != b.token_ids for a, b in zip(strict, b0))
        raise CalibrationError(
            f"ASD with B = 0 is not token-identical to strict: {n_diff} of {len(prompts)} requests differ; first: "
            f"request {i} (question {questions[i].index} of {args.data}), token position {pos} "
            f"(strict {strict[i].token_ids[pos:pos + 4]} vs B=0 {b0[i].token_ids[pos:pos + 4]}). Refusing to calibrate."
        )
    if not ratios:
        raise CalibrationError(
            f"no positive first-rejection ratio in {steps[0]} verify steps (the draft never missed, or only on ties); "
            f"use more questions or a longer --max_new_tokens")
    q = q25(ratios)
    return {
        "q25": q, "count": len(ratios), "suggested_flags": suggested_flags(q), "b0_identical": True,
        "num_questions": len(questions), "data": os.path.abspath(args.data), "model_dir": tok_dir,
        "mtp_mode": args.mtp_mode, "mtp_step": args.mtp_step, "mtp_draft_model_dir": args.mtp_draft_model_dir,
        "max_new_tokens": args.max_new_tokens, "verify_steps": steps[0],
        "output_tokens": sum(len(r.token_ids) for r in strict),
        "ratio_min": min(ratios), "ratio_median": statistics.median_high(ratios), "ratio_max": max(ratios),
        "strict_s": t_strict, "b0_s": t_b0,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parents = [gsm8k_parser("train", num_questions=64), engine_parser(running_max_req_size=64)]
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.asd_calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    p.add_argument("--out", default="calib.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        calib = calibrate(args)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write_json(args.out, calib)
    print(f"B = 0 token-identical to strict on all {calib['num_questions']} requests")
    print(f"positive first-rejection ratios: {calib['count']} (of {calib['verify_steps']} verify steps)")
    print(f"q25 = {calib['q25']!r}")
    print(f"suggested flags: {calib['suggested_flags']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_tool(main)
