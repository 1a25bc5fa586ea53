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
import os
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.tools.client import USAGE, AsdSetting, generate_offline, model_dir_or_embedded  # noqa: E402 (after the path set-up)
from lightllm.tools.prompts import chat_prompt_ids, gsm8k_parser, load_gsm8k, solve_turns  # noqa: E402
from lightllm.tools.report import Column, render_table, tokens_per_step, write_json  # noqa: E402

DEFAULT_ARMS = f"strict,{USAGE.budget:g}:{USAGE.local_ratio:g}:{USAGE.max_mismatch},8:0.25:2"


@dataclass(frozen=True)
class ArmSpec:
    name: str
    asd: Optional[AsdSetting] = None  # None: strict (ASD flags unset)

    def start_args(self) -> Dict:
        return self.asd.start_args() if self.asd else {}


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
    return ArmSpec(text, AsdSetting(float(parts[0]), float(parts[1]), int(parts[2])))


def summarize(name: str, results, seconds: float) -> ArmResult:
    out = sum(len(r.token_ids) for r in results)
    acc = sum(r.mtp_accepted_token_num for r in results)
    relaxed = sum(r.asd_relaxed_token_num for r in results)
    steps = out - acc  # one committed target token per step, the prefill's included
    return ArmResult(name, tokens_per_step(out, acc), out, acc, relaxed, (acc - relaxed) / steps, seconds,
                     [r.token_ids for r in results])


def use_triton_kernels_on_cpu() -> None:
    """Route the CPU verify / scatter calls to the Triton kernels (interpreter)."""
    from lightllm.common.basemodel.triton_kernel import mtp_utils
    from lightllm.server.router.model_infer.mtp_speculative import draft, utils

    utils.mtp_verify_torch = mtp_utils.mtp_verify
    utils.mtp_asd_verify_torch = mtp_utils.mtp_asd_verify
    draft.mtp_scatter_next_token_ids_torch = mtp_utils.mtp_scatter_next_token_ids


TABLE = (Column("name", "arm"), Column("tokens_per_step", "tokens/step", ".3f"),
         Column("gain_vs_strict", "vs strict", "+.1%"), Column("relaxed_tokens", "relaxed tokens"),
         Column("exact_matches_per_step", "exact matches/step", ".3f"), Column("seconds", "s", ".0f"))


def render(results: List[ArmResult]) -> str:
    strict = next((r for r in results if r.name == "strict"), None)
    rows = [{**vars(r), "gain_vs_strict": r.tokens_per_step / strict.tokens_per_step - 1 if strict else None}
            for r in results]
    return render_table(rows, TABLE, markdown=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                parents=[gsm8k_parser("test", num_questions=32)])
    p.add_argument("--max_new_tokens", type=int, default=160)
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--arms", default=DEFAULT_ARMS)
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

    if a.triton_on_cpu:
        use_triton_kernels_on_cpu()
    tok = AutoTokenizer.from_pretrained(model_dir_or_embedded(None))
    prompts = chat_prompt_ids(tok, solve_turns(load_gsm8k(a.data, a.num_questions)))
    params = [{"max_new_tokens": a.max_new_tokens, "do_sample": False}] * len(prompts)
    results: List[ArmResult] = []
    running = a.running_max_req_size or len(prompts)
    max_len = max(map(len, prompts)) + a.max_new_tokens
    for arm in arms:
        start_args = StartArgs(mtp_mode="eagle_with_att", mtp_step=a.mtp_step, running_max_req_size=running,
                               max_req_total_len=max_len, **arm.start_args())
        res, seconds = generate_offline(start_args, prompts, params, device=a.device, dtype=a.dtype)
        results.append(summarize(arm.name, res, seconds))

    print(f"{len(prompts)} questions, {a.max_new_tokens} new tokens, K = {a.mtp_step}")
    print(render(results))
    if a.out:
        write_json(a.out, {"args": vars(a), "arms": [asdict(r) for r in results]}, indent=None)


if __name__ == "__main__":
    main()
