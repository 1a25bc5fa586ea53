"""GSM8K evaluation of ASD through the real server, one server per arm.

Arms, in run order (every one is ``--mtp_mode`` on with ``--mtp_step K`` unless said otherwise):

- ``strict``    ASD flag unset: strict greedy verification, the reference of every comparison;
- ``asd_b0``    ``B = 0``: the ASD code path with strict semantics. It must be token-identical
                to ``strict`` on EVERY request; any difference makes the tool exit non-zero
                (after writing its results): a result without this check is not a result;
- ``asd_q25``   the calibration recipe ``B = g = q``, ``m = 1`` (``q`` from
                ``python -m lightllm.tools.asd_calibrate``: ``--calib calib.json`` or ``--q25 q``);
- ``asd_usage`` the usage setting ``B = 2.0625, g = 0.25, m = 2`` (docs/asd.md);
- ``asd_B<b>``  the budget sweep ``B = b`` (``--sweep``), ``g = 0.25, m = 2``;
- ``baseline``  no MTP at all (only with ``--with_baseline``).

For each arm: start ``python -m lightllm.server.api_server`` with the arm's flags, warm it up
(so kernel compilation is not timed), send every question (at most ``--concurrency`` in flight)
to ``/generate``, greedy, and read the accept-length histogram from ``/metrics`` around the
timed wave. Results are rewritten after every arm, so a run cut short keeps what it measured;
``--time_budget_s`` skips the optional arms that would not fit. The draft files are hashed
before each server starts and after it stops; arms that ran with different drafts fail the run.
Throughput ratios are to ``strict`` and to ``asd_b0``: ``asd_b0`` does strict's work, so its own
ratio to ``strict`` is the run's noise (a WARNING above 5%; for ratios that do not depend on
server starts use ``benchmarks/bench_asd_budgets.py``).

Output in ``--out_dir``: ``results.json`` (config, summaries, B = 0 check), ``results.md``
(table + the exact command line), ``requests_<arm>.jsonl`` (one record per question),
``server_<arm>.log``, ``budget_sweep.png``, ``accept_len_hist.png``.
"""
import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from lightllm.tools.client import (BATCH_STEP_SECONDS, MTP_ACCEPT_LEN, USAGE, WARMUP_MAX_NEW_TOKENS, WARMUP_REQUESTS,
                                   AsdSetting, auto_max_req_total_len, engine_parser, generate_body,
                                   model_dir_or_embedded, send_all, serve, server_flags, wave_server_flags, warm_up)
from lightllm.tools.prompts import (Question, chat_prompt_texts, extract_answer, gsm8k_parser, is_correct, load_gsm8k,
                                    run_tool, solve_turns)
from lightllm.tools.report import Column, first_token_difference, ratio, render_table, tokens_per_step, write_json
from lightllm.utils.server_launcher import scrape

SWEEP_GATES = (USAGE.local_ratio, USAGE.max_mismatch)  # the sweep's fixed g and m
DEFAULT_SWEEP = "0.5,1,2,4,8"
NAMED_ARMS = ("strict", "asd_b0", "asd_q25", "asd_usage")
STRICT, ASD_B0, BASELINE = "strict", "asd_b0", "baseline"
REQUIRED_ARMS = (STRICT, ASD_B0)  # the reference and its identity check always run
THROUGHPUT_NOISE_WARN = 0.05  # |B = 0 tok/s / strict tok/s - 1| above this: flag the run


@dataclass(frozen=True)
class Arm:
    name: str
    mtp: bool = True
    asd: Optional[AsdSetting] = None  # None: ASD off

    def server_flags(self, mtp_mode: str, mtp_step: int, draft_dirs: Optional[Sequence[str]]) -> List[str]:
        if not self.mtp:
            return []
        return server_flags(mtp_mode=mtp_mode, mtp_step=mtp_step, mtp_draft_model_dir=draft_dirs or None,
                            **(self.asd.start_args() if self.asd else {}))


def build_arms(named: Sequence[str], q25: Optional[float], sweep: Sequence[float], with_baseline: bool) -> List[Arm]:
    """The arms in run order: strict, asd_b0, [asd_q25], [asd_usage], sweep, [baseline]
    (the required ones first, so a time budget drops only optional arms)."""
    unknown = sorted(set(named) - set(NAMED_ARMS))
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r} (valid: {', '.join(NAMED_ARMS)})")
    missing = [a for a in REQUIRED_ARMS if a not in named]
    if missing:
        raise ValueError(f"arm {missing[0]!r} is required: B = 0 must be checked against strict in the same run")
    if "asd_q25" in named and q25 is None:
        raise ValueError("arm 'asd_q25' needs --calib calib.json or --q25 VALUE (python -m lightllm.tools.asd_calibrate)")
    if q25 is not None and not (math.isfinite(q25) and q25 >= 0):
        raise ValueError(f"q25 must be finite and >= 0, got {q25}")
    arms = [Arm(STRICT), Arm(ASD_B0, asd=AsdSetting(0.0))]
    if "asd_q25" in named:
        arms.append(Arm("asd_q25", asd=AsdSetting.q25(q25)))
    if "asd_usage" in named:
        arms.append(Arm("asd_usage", asd=USAGE))
    for b in sweep:
        if not (math.isfinite(b) and b >= 0):
            raise ValueError(f"sweep budgets must be finite and >= 0, got {b}")
        arms.append(Arm(f"asd_B{b:g}", asd=AsdSetting(b, *SWEEP_GATES)))
    if with_baseline:
        arms.append(Arm(BASELINE, mtp=False))
    dup = sorted(n for n, count in Counter(a.name for a in arms).items() if count > 1)
    if dup:
        raise ValueError(f"arm {dup[0]!r} given twice")
    return arms


def parse_float_list(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


@dataclass
class RequestRecord:
    index: int  # question index in the data file
    token_ids: List[int]
    text: str
    count_output_tokens: int
    mtp_accepted_token_num: int
    asd_relaxed_token_num: int
    asd_regret_spent: float
    finish_reason: Optional[str]
    pred: Optional[float]
    gold: float
    correct: bool

    @classmethod
    def from_response(cls, q: Question, resp: Dict) -> "RequestRecord":
        text = resp["generated_text"][0]
        pred = extract_answer(text)
        counts = {k: resp[k] for k in ("count_output_tokens", "mtp_accepted_token_num", "asd_relaxed_token_num",
                                       "asd_regret_spent", "finish_reason")}
        return cls(index=q.index, token_ids=[t["id"] for t in resp["tokens"]], text=text, **counts, pred=pred,
                   gold=q.gold, correct=is_correct(pred, q.gold))


@dataclass
class ArmSummary:
    name: str
    budget: Optional[float]
    local_ratio: Optional[float]
    max_mismatch: Optional[int]
    mtp: bool
    num_requests: int
    accuracy: float
    tokens_per_step: Optional[float]  # sum count / sum(count - accepted)
    mean_accept_len: Optional[float]  # from the server's accept-len histogram (decode steps)
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    differs_from_strict: Optional[float]  # share of requests; None for strict itself
    mean_regret_spent: float
    mean_relaxed_tokens: float
    accept_len_hist: Dict[int, int] = field(default_factory=dict)
    speedup_vs_strict: Optional[float] = None  # output tokens/s ratio
    speedup_vs_b0: Optional[float] = None  # output tokens/s ratio to the B = 0 arm (strict's work)
    requests_per_s_vs_strict: Optional[float] = None
    arm_total_s: Optional[float] = None  # server start + warm-up + timed wave + stop
    engine_s: Optional[float] = None  # the router's time inside batch steps during the wave
    engine_tokens_per_s: Optional[float] = None  # output tokens per second of engine_s
    engine_speedup_vs_strict: Optional[float] = None
    engine_speedup_vs_b0: Optional[float] = None


def differing_requests(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> List[int]:
    """Positions whose token ids differ (the lists are in the same question order)."""
    if len(a) != len(b):
        raise ValueError(f"different request counts: {len(a)} vs {len(b)}")
    for x, y in zip(a, b):
        if x.index != y.index:
            raise ValueError(f"request order differs: question {x.index} vs {y.index}")
    return [i for i, (x, y) in enumerate(zip(a, b)) if x.token_ids != y.token_ids]


def mean_accept_len(hist: Dict[int, int]) -> Optional[float]:
    n = sum(hist.values())
    return sum(k * c for k, c in hist.items()) / n if n else None


def summarize_arm(arm: Arm, records: Sequence[RequestRecord], wall_s: float,
                  strict: Optional[Sequence[RequestRecord]], hist: Optional[Dict[int, int]] = None,
                  engine_s: Optional[float] = None) -> ArmSummary:
    n = len(records)
    if n == 0:
        raise ValueError(f"arm {arm.name}: no requests")
    tokens = sum(r.count_output_tokens for r in records)
    differs = None
    if strict is not None and arm.name != STRICT:
        differs = len(differing_requests(records, strict)) / n
    hist = dict(hist or {})
    asd = asdict(arm.asd) if arm.asd else dict.fromkeys(AsdSetting.__dataclass_fields__)  # B, g, m (None: unset)
    return ArmSummary(
        name=arm.name, **asd, mtp=arm.mtp, num_requests=n, accuracy=sum(r.correct for r in records) / n,
        tokens_per_step=tokens_per_step(tokens, sum(r.mtp_accepted_token_num for r in records)),
        mean_accept_len=mean_accept_len(hist), output_tokens=tokens, wall_s=wall_s,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else float("nan"),
        requests_per_s=n / wall_s if wall_s > 0 else float("nan"), differs_from_strict=differs,
        mean_regret_spent=sum(r.asd_regret_spent for r in records) / n,
        mean_relaxed_tokens=sum(r.asd_relaxed_token_num for r in records) / n,
        accept_len_hist=hist, engine_s=engine_s, engine_tokens_per_s=ratio(tokens, engine_s),
    )


def add_speedups_vs_strict_and_b0(summaries: List[ArmSummary]) -> None:
    """Each arm's throughput over the strict and the B = 0 arm of the same run (in place)."""
    strict = next((s for s in summaries if s.name == STRICT), None)
    b0 = next((s for s in summaries if s.name == ASD_B0), None)
    for s in summaries:
        if strict is not None:
            s.speedup_vs_strict = ratio(s.output_tokens_per_s, strict.output_tokens_per_s)
            s.requests_per_s_vs_strict = ratio(s.requests_per_s, strict.requests_per_s)
            s.engine_speedup_vs_strict = ratio(s.engine_tokens_per_s, strict.engine_tokens_per_s)
        if b0 is not None:
            s.speedup_vs_b0 = ratio(s.output_tokens_per_s, b0.output_tokens_per_s)
            s.engine_speedup_vs_b0 = ratio(s.engine_tokens_per_s, b0.engine_tokens_per_s)


def throughput_noise_note(summaries: Sequence[ArmSummary]) -> Optional[str]:
    """The B = 0 arm does strict's work, so its tok/s ratio to strict is this run's noise."""
    b0 = next((s for s in summaries if s.name == ASD_B0), None)
    if b0 is None or b0.speedup_vs_strict is None:
        return None
    noise = abs(b0.speedup_vs_strict - 1.0)
    note = (f"Throughput noise check: B = 0 does exactly strict's work and measured {b0.speedup_vs_strict:.3f}x "
            f"strict's tok/s; ratios within {noise:.3f} of 1 are not distinguishable from noise.")
    if b0.engine_speedup_vs_strict is not None:
        note += f" On the engine's clock B = 0 measured {b0.engine_speedup_vs_strict:.3f}x strict."
    return ("WARNING: " + note) if noise > THROUGHPUT_NOISE_WARN else note


@dataclass
class B0Check:
    passed: bool
    num_requests: int
    num_differing: int
    first_question_index: Optional[int] = None  # question index of the first differing request
    first_token_position: Optional[int] = None

    def message(self) -> str:
        if self.passed:
            return f"B = 0 identity check PASSED: asd_b0 is token-identical to strict on all {self.num_requests} requests"
        return (f"B = 0 identity check FAILED: {self.num_differing} of {self.num_requests} requests differ from "
                f"strict; first: question {self.first_question_index}, token position {self.first_token_position}")


def check_b0(strict: Sequence[RequestRecord], b0: Sequence[RequestRecord]) -> B0Check:
    diff = differing_requests(b0, strict)
    if not diff:
        return B0Check(True, len(strict), 0)
    i = diff[0]
    return B0Check(False, len(strict), len(diff), strict[i].index,
                   first_token_difference(strict[i].token_ids, b0[i].token_ids))


DIGEST_HEX_CHARS = 16


def files_digest(dirs: Sequence[str]) -> str:
    """sha256 over the names and bytes of every file in these directories (sorted)."""
    h = hashlib.sha256()
    for d in dirs:
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                h.update(name.encode() + b"\0")
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()[:DIGEST_HEX_CHARS]


def check_same_draft(digests: Dict[str, Optional[str]]) -> Optional[str]:
    """An error message when the arms did not all run with the same draft files, else None."""
    known = {name: d for name, d in digests.items() if d is not None}
    if len(set(known.values())) <= 1:
        return None
    return "the draft files changed during the run: " + ", ".join(f"{n} {d}" for n, d in known.items())


SUMMARY_COLUMNS = (
    Column("name", "arm"), Column("budget", "B", "g"), Column("local_ratio", "g", "g"), Column("max_mismatch", "m", "d"),
    Column("accuracy", "accuracy", ".2%"), Column("tokens_per_step", "tokens/step", ".3f"),
    Column("mean_accept_len", "accept_len", ".3f"), Column("output_tokens_per_s", "out tok/s", ".1f"),
    Column("requests_per_s", "req/s", ".2f"), Column("speedup_vs_strict", "tok/s vs strict", ".3f", "x"),
    Column("speedup_vs_b0", "tok/s vs B=0", ".3f", "x"), Column("engine_tokens_per_s", "engine tok/s", ".1f"),
    Column("engine_speedup_vs_strict", "engine vs strict", ".3f", "x"),
    Column("engine_speedup_vs_b0", "engine vs B=0", ".3f", "x"),
    Column("differs_from_strict", "differs from strict", ".1%"), Column("mean_regret_spent", "mean regret", ".4f"),
    Column("mean_relaxed_tokens", "mean relaxed", ".2f"), Column("wall_s", "wall s", ".1f"),
    Column("arm_total_s", "arm s", ".1f"),
)


def render_markdown(summaries: Sequence[ArmSummary], b0: Optional[B0Check], command: str,
                    setup: Dict[str, object]) -> str:
    lines = ["# GSM8K: strict MTP vs ASD", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items()]
    lines += ["", f"**{b0.message()}**" if b0 is not None else "**B = 0 identity check NOT RUN**", ""]
    lines.append(render_table(summaries, SUMMARY_COLUMNS, markdown=True))
    noise = throughput_noise_note(summaries)
    if noise is not None:
        lines += ["", f"**{noise}**"]
    legend = ("tokens/step = sum(count_output_tokens) / sum(count_output_tokens - mtp_accepted_token_num) "
              f"(the prefill step included); accept_len = mean of the server's {MTP_ACCEPT_LEN} "
              "histogram over the timed wave's decode steps; wall s = the timed wave (throughput is over it); "
              "engine tok/s = output tokens / the router's time inside batch steps during the wave "
              f"({BATCH_STEP_SECONDS}: leaves out the HTTP front end and the client); "
              "arm s = server start + warm-up + timed wave + stop; B/g/m '-' = flag unset.")
    return "\n".join(lines + ["", legend, "", "Command:", "", "```", command, "```", ""])


def _save_figure(fig, out_dir: str, name: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=120)
    plt.close(fig)


def plot_results(summaries: Sequence[ArmSummary], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {s.name: s for s in summaries}
    family = sorted([s for s in summaries if (s.local_ratio, s.max_mismatch) == SWEEP_GATES
                     and s.budget is not None], key=lambda s: s.budget)
    budgets = sorted({round(s.budget, 4) for s in summaries if s.budget is not None})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, attr, label in ((axes[0], "accuracy", "accuracy (%)"), (axes[1], "output_tokens_per_s", "output tokens/s")):
        scale = 100.0 if attr == "accuracy" else 1.0
        if family:
            ax.plot([s.budget for s in family], [scale * getattr(s, attr) for s in family], "o-",
                    label="ASD g={:g}, m={} (sweep + usage)".format(*SWEEP_GATES))
        for name, marker in ((ASD_B0, "s"), ("asd_q25", "D")):
            if name in by:
                ax.plot([by[name].budget], [scale * getattr(by[name], attr)], marker, markersize=8, label=name)
        for name, style, color in ((STRICT, "--", "gray"), (BASELINE, ":", "black")):
            if name in by:
                ax.axhline(scale * getattr(by[name], attr), linestyle=style, color=color, label=name)
        ax.set_xscale("symlog", linthresh=0.25)
        if budgets:
            ax.set_xlim(-0.05, 1.5 * max(budgets) if max(budgets) > 0 else 1.0)
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets], rotation=45, fontsize=8)
            ax.minorticks_off()
        ax.set(xlabel="regret budget B", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("GSM8K: accuracy and throughput against the ASD budget")
    _save_figure(fig, out_dir, "budget_sweep.png")

    with_hist = [s for s in summaries if sum(s.accept_len_hist.values()) > 0]
    if with_hist:
        ks = list(range(1, max(k for s in with_hist for k, c in s.accept_len_hist.items() if c > 0) + 1))
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ks) + 0.3 * len(with_hist)), 4.5))
        width = 0.8 / len(with_hist)
        for i, s in enumerate(with_hist):
            total = sum(s.accept_len_hist.values())
            ax.bar([k - 0.4 + width * (i + 0.5) for k in ks], [s.accept_len_hist.get(k, 0) / total for k in ks],
                   width=width, label=f"{s.name} (mean {s.mean_accept_len:.2f})")
        ax.set(xticks=ks, xlabel="accept_len (committed tokens per request per verify step)",
               ylabel="share of decode steps", title="Accept-length histogram per arm (server /metrics)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        _save_figure(fig, out_dir, "accept_len_hist.png")


@dataclass
class ArmRun:
    records: List[RequestRecord]
    wall_s: float  # the timed wave
    accept_len_hist: Dict[int, int]
    total_s: float = 0.0  # server start to stop (set by main)
    draft_digest: Optional[str] = None  # the draft files before the server started and after it stopped
    engine_s: Optional[float] = None  # the router's time inside batch steps during the timed wave


def run_arm(arm: Arm, base_flags: List[str], arm_flags: List[str], questions: Sequence[Question],
            prompts: Sequence[str], args, out_dir: str, draft_check_dirs: Optional[Sequence[str]] = None) -> ArmRun:
    check = draft_check_dirs if arm.mtp and draft_check_dirs else None
    digest_before = files_digest(check) if check else None
    log = os.path.join(out_dir, f"server_{arm.name}.log")
    print(f"[{arm.name}] starting server: {' '.join(base_flags + arm_flags)}", flush=True)
    with serve(base_flags + arm_flags, log) as server:
        if args.warmup > 0:
            warm_up(server.url, prompts, args.max_new_tokens, args.concurrency, args.warmup)
        before = scrape(server.url)
        bodies = [generate_body(p, args.max_new_tokens, return_details=True) for p in prompts]
        t0 = time.perf_counter()
        responses = send_all(server.url, bodies, args.concurrency, arm.name)
        wall = time.perf_counter() - t0
        grown = scrape(server.url) - before
    records = [RequestRecord.from_response(q, r) for q, r in zip(questions, responses)]
    with open(os.path.join(out_dir, f"requests_{arm.name}.jsonl"), "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in records)
    digest_after = files_digest(check) if check else None  # "before->after": changed while the server ran
    digest = digest_before if digest_after == digest_before else f"{digest_before}->{digest_after}"
    return ArmRun(records, wall, grown.histogram(MTP_ACCEPT_LEN), draft_digest=digest,
                  engine_s=grown.value(BATCH_STEP_SECONDS))


def read_calib_q25(path: str, mtp_step: int) -> float:
    with open(path) as f:
        calib = json.load(f)
    if "q25" not in calib:
        raise ValueError(f"{path}: no 'q25' (write it with python -m lightllm.tools.asd_calibrate)")
    if calib.get("mtp_step") not in (None, mtp_step):
        print(f"warning: {path} was calibrated with --mtp_step {calib['mtp_step']}, this run uses {mtp_step}",
              file=sys.stderr)
    return float(calib["q25"])


def parse_args(argv=None) -> argparse.Namespace:
    parents = [gsm8k_parser("test"), engine_parser(running_help="server flag (default: --concurrency)")]
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.eval_gsm8k", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calib", default=None, help="calib.json of asd_calibrate (its q25)")
    cal.add_argument("--q25", type=float, default=None, help="q for the asd_q25 arm (B = g = q, m = 1)")
    p.add_argument("--arms", default=None,
                   help=f"named arms, comma-separated (default: {','.join(NAMED_ARMS)}, asd_q25 only with a q); "
                        f"strict and asd_b0 are required")
    p.add_argument("--sweep", default=DEFAULT_SWEEP, help="sweep budgets B (g = 0.25, m = 2); '' for none")
    p.add_argument("--with_baseline", action="store_true", help="also run a no-MTP arm")
    p.add_argument("--warmup", type=int, default=WARMUP_REQUESTS,
                   help=f"untimed warm-up requests per arm ({WARMUP_MAX_NEW_TOKENS} tokens each)")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="skip the remaining optional arms once the time spent plus the last arm's time exceeds this "
                        "(strict and asd_b0 always run)")
    a = p.parse_args(argv)
    if a.concurrency < 1:
        p.error("--concurrency must be >= 1")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m lightllm.tools.eval_gsm8k " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    q25 = args.q25 if args.calib is None else read_calib_q25(args.calib, args.mtp_step)
    named = [a.strip() for a in args.arms.split(",")] if args.arms else [
        a for a in NAMED_ARMS if a != "asd_q25" or q25 is not None]
    try:
        arms = build_arms(named, q25, parse_float_list(args.sweep), args.with_baseline)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from lightllm.utils.embedded_model import default_draft_dir_for

    model_dir, draft_dirs = args.model_dir, args.mtp_draft_model_dir  # None: the server's embedded model, its draft
    tok_dir = model_dir_or_embedded(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    draft_check_dirs = draft_dirs or [d for d in [default_draft_dir_for(tok_dir, args.mtp_mode)] if d]
    questions = load_gsm8k(args.data, args.num_questions)
    if any(q.gold is None for q in questions):
        raise ValueError(f"{args.data}: every question needs an answer")
    prompts = chat_prompt_texts(tokenizer, solve_turns(questions))
    prompt_lens = [len(tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    max_len = args.max_req_total_len or auto_max_req_total_len(prompt_lens, args.max_new_tokens)
    base_flags = wave_server_flags(model_dir, args.running_max_req_size or args.concurrency, max_len)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"{len(questions)} questions, arms: {', '.join(a.name for a in arms)}", flush=True)

    setup = {
        "data": os.path.abspath(args.data), "questions": len(questions), "model_dir": tok_dir,
        "mtp_mode": args.mtp_mode, "mtp_step (K)": args.mtp_step,
        "draft": " ".join(draft_dirs) if draft_dirs else "server default", "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency, "q25": q25, "server flags (every arm)": " ".join(base_flags),
    }
    t_start = time.perf_counter()
    runs: Dict[str, ArmRun] = {}
    skipped: List[str] = []
    last_arm_s = 0.0
    for arm in arms:
        elapsed = time.perf_counter() - t_start
        if args.time_budget_s and arm.name not in REQUIRED_ARMS and elapsed + last_arm_s > args.time_budget_s:
            print(f"[{arm.name}] skipped: {elapsed:.0f} s spent, the last arm took {last_arm_s:.0f} s, "
                  f"--time_budget_s {args.time_budget_s:g}", flush=True)
            skipped.append(arm.name)
            continue
        t0 = time.perf_counter()
        flags = arm.server_flags(args.mtp_mode, args.mtp_step, draft_dirs)
        runs[arm.name] = run_arm(arm, base_flags, flags, questions, prompts, args, args.out_dir, draft_check_dirs)
        last_arm_s = runs[arm.name].total_s = time.perf_counter() - t0
        print(f"[{arm.name}] done: timed wave {runs[arm.name].wall_s:.1f} s, arm in all {last_arm_s:.1f} s", flush=True)
        if arm.name == ASD_B0:
            b0 = check_b0(runs[STRICT].records, runs[ASD_B0].records)
            print(("" if b0.passed else "!!! ") + b0.message(), flush=True)
        md, b0 = write_outputs(arms, runs, skipped, args, command, setup)  # so a run cut short leaves its results
    if skipped:  # the last write did not know of them all
        md, b0 = write_outputs(arms, runs, skipped, args, command, setup)
    print(md)
    if b0 is None or not b0.passed:
        print(f"FAILED: {b0.message() if b0 else 'no B = 0 check'}", file=sys.stderr)
        return 1
    draft_error = check_same_draft({name: run.draft_digest for name, run in runs.items()})
    if draft_error:
        print(f"FAILED: {draft_error}", file=sys.stderr)
        return 1
    return 0


def write_outputs(arms: Sequence[Arm], runs: Dict[str, "ArmRun"], skipped: Sequence[str], args,
                  command: str, setup: Dict[str, object]) -> Tuple[str, Optional[B0Check]]:
    """results.json, results.md and the plots for the arms run so far."""
    arms = [a for a in arms if a.name in runs]
    strict = runs[STRICT].records
    summaries = [summarize_arm(a, runs[a.name].records, runs[a.name].wall_s, strict, runs[a.name].accept_len_hist,
                               runs[a.name].engine_s) for a in arms]
    add_speedups_vs_strict_and_b0(summaries)
    for s in summaries:
        s.arm_total_s = runs[s.name].total_s
    b0 = check_b0(strict, runs[ASD_B0].records) if ASD_B0 in runs else None
    if skipped:
        setup = {**setup, "skipped (time budget)": ", ".join(skipped)}
    digests = {a.name: runs[a.name].draft_digest for a in arms}
    known = sorted({d for d in digests.values() if d})
    if known:
        draft_error = check_same_draft(digests)
        setup = {**setup, "draft files (sha256)": f"MISMATCH, {draft_error}" if draft_error else known[0]}
    results = {
        "command": command, "setup": setup, "b0_check": asdict(b0) if b0 else None, "skipped_arms": list(skipped),
        "arms": [{**asdict(s), "server_flags": a.server_flags(args.mtp_mode, args.mtp_step, args.mtp_draft_model_dir),
                  "draft_digest": runs[a.name].draft_digest} for s, a in zip(summaries, arms)],
    }
    write_json(os.path.join(args.out_dir, "results.json"), results)
    md = render_markdown(summaries, b0, command, setup)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(md)
    plot_results(summaries, args.out_dir)
    return md, b0


if __name__ == "__main__":
    run_tool(main)
