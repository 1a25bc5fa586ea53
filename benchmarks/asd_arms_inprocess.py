"""Tokens per step of strict MTP and ASD arms on GSM8K test questions, in-process (OfflineEngine).

A small, HTTP-free companion of ``python -m lightllm.tools.eval_gsm8k`` for looking into
tokens/step on any device (CPU included): every arm decodes the same questions in one batch;
the table gives tokens/step, relaxed tokens and exact draft matches per step, and the JSON
keeps the token ids of every arm.

    python benchmarks/asd_arms_inprocess.py --data PATH/test.jsonl --num_questions 32 \\
        --max_new_tokens 160 --arms strict,2.0625:0.25:2,8:0.25:2 --out arms.json

An arm is ``strict`` or ``B:g:m``. ``--triton_on_cpu`` runs the Triton verify and scatter
kernels (under TRITON_INTERPRET=1) instead of their PyTorch twins when the engine is on CPU.
"""
import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class ArmSpec:
    name: str
    budget: Optional[float] = None  # None: strict (ASD flags unset)
    local_ratio: Optional[float] = None
    max_mismatch: Optional[int] = None

    def start_args(self) -> Dict:
        if self.budget is None:
            return {}
        return dict(mtp_asd_regret_budget=self.budget, mtp_asd_local_regret_ratio=self.local_ratio,
                    mtp_asd_block_max_mismatch=self.max_mismatch)


@dataclass
class ArmResult:
    name: str
    tokens_per_step: float
    output_tokens: int
    accepted_drafts: int
    relaxed_tokens: int
    exact_matches_per_step: float
    seconds: float
    token_ids: List[List[int]]


def parse_arm(text: str) -> ArmSpec:
    if text == "strict":
        return ArmSpec("strict")
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"arm {text!r}: use 'strict' or B:g:m (e.g. 2.0625:0.25:2)")
    return ArmSpec(text, float(parts[0]), float(parts[1]), int(parts[2]))


def summarize(name: str, results, seconds: float) -> ArmResult:
    out = sum(len(r.token_ids) for r in results)
    acc = sum(r.mtp_accepted_token_num for r in results)
    relaxed = sum(r.asd_relaxed_token_num for r in results)
    steps = out - acc  # one committed target token per step, the prefill's included
    return ArmResult(name, out / steps, out, acc, relaxed, (acc - relaxed) / steps, seconds,
                     [r.token_ids for r in results])


def use_triton_kernels_on_cpu() -> None:
    """Route the CPU verify / scatter calls to the Triton kernels (interpreter)."""
    from lightllm.common.basemodel.triton_kernel import mtp_utils
    from lightllm.server.router.model_infer.mtp_speculative import draft, utils

    utils.mtp_verify_torch = mtp_utils.mtp_verify
    utils.mtp_asd_verify_torch = mtp_utils.mtp_asd_verify
    draft.mtp_scatter_next_token_ids_torch = mtp_utils.mtp_scatter_next_token_ids


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="GSM8K test jsonl")
    p.add_argument("--num_questions", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=160)
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--arms", default="strict,2.0625:0.25:2,8:0.25:2")
    p.add_argument("--running_max_req_size", type=int, default=None,
                   help="requests decoded together (default: all; fewer admits the rest as others finish)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the server's)")
    p.add_argument("--triton_on_cpu", action="store_true")
    p.add_argument("--out", default=None, help="JSON results path")
    a = p.parse_args(argv)
    try:
        arms = [parse_arm(t) for t in a.arms.split(",")]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"--arms: {e}")

    import torch

    if a.triton_on_cpu or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from transformers import AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine
    from lightllm.tools.eval_gsm8k import chat_prompt_text, load_questions
    from lightllm.utils.embedded_model import get_default_model_dir

    if a.triton_on_cpu:
        use_triton_kernels_on_cpu()
    tok = AutoTokenizer.from_pretrained(get_default_model_dir())
    questions = load_questions(a.data, a.num_questions)
    prompts = [tok.encode(chat_prompt_text(tok, q.question), add_special_tokens=True) for q in questions]
    params = [{"max_new_tokens": a.max_new_tokens, "do_sample": False}] * len(prompts)
    results: List[ArmResult] = []
    running = a.running_max_req_size or len(prompts)
    max_len = max(map(len, prompts)) + a.max_new_tokens
    for arm in arms:
        eng = OfflineEngine(StartArgs(mtp_mode="eagle_with_att", mtp_step=a.mtp_step, running_max_req_size=running,
                                      max_req_total_len=max_len, **arm.start_args()),
                            device=a.device, dtype=a.dtype)
        t0 = time.perf_counter()
        res = eng.generate(prompts, params, eos_token_ids=eng.eos_token_ids(), progress=True)
        results.append(summarize(arm.name, res, time.perf_counter() - t0))
        del eng

    strict = next((r for r in results if r.name == "strict"), None)
    print(f"{len(prompts)} questions, {a.max_new_tokens} new tokens, K = {a.mtp_step}")
    print("| arm | tokens/step | vs strict | relaxed tokens | exact matches/step | s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rel = f"{r.tokens_per_step / strict.tokens_per_step - 1:+.1%}" if strict else "-"
        print(f"| {r.name} | {r.tokens_per_step:.3f} | {rel} | {r.relaxed_tokens} | {r.exact_matches_per_step:.3f} "
              f"| {r.seconds:.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "arms": [asdict(r) for r in results]}, f)


if __name__ == "__main__":
    main()
