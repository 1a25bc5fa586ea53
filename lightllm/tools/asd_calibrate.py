"""Calibrate ASD's q25 setting on GSM8K TRAIN questions (the ASD reference's recipe, ASD.md §5).

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
3. ``q`` = their linearly interpolated 25th percentile (``h = (n - 1) / 4``, as numpy's
   default ``quantile``). Suggested flags: ``B = g = q``, ``m = 1``.

    python -m lightllm.tools.asd_calibrate --data /work/shared/data/gsm8k/train.jsonl \\
        --num_questions 64 --mtp_step 3 --out calib.json
"""
import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

QUANTILE = 0.25
Q25_MAX_MISMATCH = 1  # the recipe's m


class CalibrationError(RuntimeError):
    """The calibration cannot go on (B = 0 is not strict, no positive ratio, ...)."""


# ---------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------


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
    """Linearly interpolated 25th percentile: ``h = (n - 1) * 0.25`` (numpy's default method)."""
    if not values:
        raise ValueError("no values: the 25th percentile of an empty set is undefined")
    v = sorted(float(x) for x in values)
    h = (len(v) - 1) * QUANTILE
    lo, hi = math.floor(h), math.ceil(h)
    return v[lo] + (h - lo) * (v[hi] - v[lo])


def suggested_flags(q: float) -> str:
    return (f"--mtp_asd_regret_budget {q!r} --mtp_asd_local_regret_ratio {q!r} "
            f"--mtp_asd_block_max_mismatch {Q25_MAX_MISMATCH}")


def first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> Optional[tuple]:
    """(request position, token position) of the first difference of two outputs, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            pos = next((p for p, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return i, pos
    return None


def check_train_split(path: str) -> None:
    if "test" in os.path.basename(path).lower():
        raise CalibrationError(f"{path} looks like a test split: calibrate on GSM8K TRAIN questions, never test")


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def _generate(args, model_dir: Optional[str], asd_budget: Optional[float], max_len: int, prompts, params,
              observer=None):
    """One in-process engine run; the engine (and its memory) is gone when this returns."""
    import torch

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine

    engine = OfflineEngine(StartArgs(
        model_dir=model_dir,
        mtp_mode=args.mtp_mode,
        mtp_step=args.mtp_step,
        mtp_draft_model_dir=args.mtp_draft_model_dir,
        mtp_asd_regret_budget=asd_budget,
        running_max_req_size=args.running_max_req_size,
        max_req_total_len=max_len,
    ))
    engine.backend.verify_observer = observer
    results = engine.generate(prompts, params, eos_token_ids=engine.eos_token_ids(), progress=True)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def calibrate(args) -> Dict:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from transformers import AutoTokenizer

    from lightllm.tools.eval_gsm8k import auto_max_req_total_len, chat_prompt_text, load_questions

    check_train_split(args.data)
    model_dir = args.model_dir
    if model_dir is None:
        from lightllm.utils.embedded_model import get_default_model_dir

        tok_dir = get_default_model_dir()
    else:
        tok_dir = model_dir
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    questions = load_questions(args.data, args.num_questions)
    # the same ids the HTTP server makes of the same text (eval_gsm8k sends text)
    prompts = [tokenizer.encode(chat_prompt_text(tokenizer, q.question), add_special_tokens=True) for q in questions]
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
    s = sorted(ratios)
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
        "ratio_min": s[0],
        "ratio_median": s[len(s) // 2],
        "ratio_max": s[-1],
        "strict_s": t_strict,
        "b0_s": t_b0,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.asd_calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="GSM8K TRAIN jsonl ({question, answer})")
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
