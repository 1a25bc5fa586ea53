"""Calibrate ASD's q25 setting on GSM8K TRAIN questions (the calibration recipe of docs/asd.md).

1. Generate the calibration cohort (the first ``--num_questions`` train questions, chat
   template applied, greedy) in-process twice with ``OfflineEngine``: strict (ASD flag unset)
   and ASD with ``B = 0``. Unless both are token-identical on every request the tool stops
   with a non-zero exit status and names the first differing request: a calibration on an
   engine whose B = 0 is not strict would be meaningless.
2. During the strict run a verify observer sees every verify step. For each request of the
   step it finds the first rejected position ``j`` (the first ``d_j != t_j``); when ``d_j``
   is a real draft token it takes the regret ``r_j = z_j[t_j] - z_j[d_j]`` from the processed
   logits and the ratio ``r_j / (K - j)`` (regret per unit of suffix value). Positive ratios
   are kept.
3. ``q`` = their linearly interpolated 25th percentile (numpy's default ``quantile``).
   Suggested flags: ``B = g = q``, ``m = 1``.

    python -m lightllm.tools.asd_calibrate --data ../shared/data/gsm8k/train.jsonl \\
        --num_questions 64 --mtp_step 3 --out calib.json

``--data`` defaults to train.jsonl in ``$LIGHTLLM_GSM8K_DIR`` or ``../shared/data/gsm8k`` beside the checkout.
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence

from lightllm.tools.client import AsdSetting, auto_max_req_total_len, generate_offline, model_dir_or_embedded, server_flags
from lightllm.tools.prompts import chat_prompt_ids, gsm8k_path, load_gsm8k, solve_turns
from lightllm.tools.report import first_difference

QUANTILE = 0.25


class CalibrationError(RuntimeError):
    """The calibration cannot go on (B = 0 is not strict, no positive ratio, ...)."""


# --------------------------------------------------------------------------- pure parts


def first_rejection_ratios(record) -> List[float]:
    """Positive ``r_j / (K - j)`` at each request's first rejected position of one verify step.

    ``record`` is a ``VerifyStepRecord``: requests own ``K + 1`` consecutive rows; row ``j``
    checks draft ``drafts[row]`` (``d_j``) against ``target_ids[row]`` (``t_j``); the bonus
    row ``K`` has no draft. A request whose drafts all match, or whose first mismatch has no
    real draft (``d_j < 0`` or ``>= vocab``), or whose ratio is 0 (a tie) gives nothing.
    Computed on the record's device; only the kept ratios come to the host.
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


# --------------------------------------------------------------------------- running


def _generate(args, model_dir, asd_budget, max_len: int, prompts, params, observer=None):
    """One in-process engine run; the engine (and its memory) is gone when this returns."""
    from lightllm.server.core.objs.start_args_type import StartArgs

    start_args = StartArgs(model_dir=model_dir, mtp_mode=args.mtp_mode, mtp_step=args.mtp_step,
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
    model_dir = args.model_dir
    tok_dir = model_dir_or_embedded(model_dir)
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
    strict = _generate(args, model_dir, None, max_len, prompts, params, observer=observe)
    t_strict = time.perf_counter() - t0
    t0 = time.perf_counter()
    b0 = _generate(args, model_dir, 0.0, max_len, prompts, params)
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
        "q25": q,
        "count": len(ratios),
        "suggested_flags": suggested_flags(q),
        "b0_identical": True,
        "num_questions": len(questions),
        "data": os.path.abspath(args.data),
        "model_dir": tok_dir,
        "mtp_mode": args.mtp_mode,
        "mtp_step": args.mtp_step,
        "mtp_draft_model_dir": args.mtp_draft_model_dir,
        "max_new_tokens": args.max_new_tokens,
        "verify_steps": steps[0],
        "output_tokens": sum(len(r.token_ids) for r in strict),
        "ratio_min": min(ratios),
        "ratio_median": statistics.median_high(ratios),
        "ratio_max": max(ratios),
        "strict_s": t_strict,
        "b0_s": t_b0,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.asd_calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="GSM8K TRAIN jsonl ({question, answer}; default: see above)")
    p.add_argument("--num_questions", type=int, default=64, help="calibration cohort: the first N questions")
    p.add_argument("--model_dir", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--mtp_draft_model_dir", nargs="+", default=None,
                   help="draft dir(s) (default: the packaged draft for the model)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--running_max_req_size", type=int, default=64)
    p.add_argument("--max_req_total_len", type=int, default=None,
                   help="default: longest prompt + max_new_tokens, rounded up to 64")
    p.add_argument("--out", default="calib.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.data = gsm8k_path("train", args.data)
    if args.model_dir:
        args.model_dir = os.path.abspath(args.model_dir)
    if args.mtp_draft_model_dir:
        args.mtp_draft_model_dir = [os.path.abspath(d) for d in args.mtp_draft_model_dir]
    try:
        calib = calibrate(args)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump(calib, f, indent=2)
    print(f"B = 0 token-identical to strict on all {calib['num_questions']} requests")
    print(f"positive first-rejection ratios: {calib['count']} (of {calib['verify_steps']} verify steps)")
    print(f"q25 = {calib['q25']!r}")
    print(f"suggested flags: {calib['suggested_flags']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
