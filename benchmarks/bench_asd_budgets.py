"""ASD throughput by budget on ONE server, in interleaved rounds: the noise-robust speed-up.

eval_gsm8k starts one server per arm, so each arm's tok/s also carries that server's luck
(start-up, the host's load at that minute); the B = 0 arm, which does strict's work, has
read 1.09-1.25x strict that way. Here one server runs every budget: ASD's budget is a
per-request parameter (`asd_regret_budget`), and B = 0 is token-identical to strict
verification, so it is the baseline. Each round sends the same GSM8K wave once per budget,
in an order rotated every round; the speed-up of budget B is the median over rounds of
tok/s(B) / tok/s(B = 0) within the same round. The same ratio is also taken on the
engine's own clock (the batch-step seconds of /metrics: time inside batch
steps), which leaves out the HTTP front end and the client. Last, output tokens per batch
step of B over those of B = 0 is the speed-up ASD would give if its steps cost what B = 0's
do: nearly free of timing noise (outputs are deterministic; only admission follows the
client's timing), while ms / batch step shows whether the steps do cost the same.

The arms admit differently, so their decode batches differ and a longer decode step may only
be a larger batch. /metrics also files decode steps by batch size, so ``step_ratio_equal_batch``
compares like with like (EQUAL_BATCH_DEFINITION). A wave's decode batch falls at its end, when fewer
requests are left than the concurrency: ``mean_decode_batch_steady`` counts the steps until the wave's
last request is sent (a /metrics snapshot at that send), beside the whole wave's ``mean_decode_batch``.
The drain runs about as many steps for every budget (the slowest of the last requests sets it), so it dilutes
ASD's gain; the speed-up is also taken before it (``speedup_vs_b0_steady``: the output tokens of the requests
that finished before the last send, over the time from the wave's start to that send; the requests in flight
then are left out of both arms alike).

Before the timed rounds each server runs ``--warm_waves`` untimed closed-loop waves per budget
(``WARM_REQUESTS_PER_SLOT`` requests per slot, the run's ``--max_new_tokens``): the short warm-up alone
left each server's first timed wave 3.4% slower on average (forty-first session, H100), which biased
round 0's ratio.

A server flag (a schedule, not a budget) needs a server per value: ``--arms NAME=FLAGS ...`` keeps one
server per arm up for the whole run and sends each its waves in every round (arms rotated like the
budgets), and the arms table pairs every arm's waves with the first arm's of the same round and budget.

g and m are server flags (one value per run: `--local_ratio`, `--max_mismatch`), as in
the usage setting (g = 0.25, m = 2). Compared with a server without ASD, B = 0 pays the
ASD verify kernel (about 2 us per step, docs/results.md section 6).

    python benchmarks/bench_asd_budgets.py --data .data/test.jsonl --mtp_step 3 \\
        --budgets 0,2.0625,8 --rounds 3 --concurrency 256 --max_new_tokens 256 --out asd_budgets.json
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from lightllm.tools.client import (  # noqa: E402 (after the path set-up)
    DECODE_CLOCK,
    DECODE_CLOCK_BY_BATCH,
    ENGINE_CLOCK,
    LATENCY_METRICS,
    MIXED_CLOCK,
    USAGE,
    AsdSetting,
    Timed,
    auto_max_req_total_len,
    generate_body,
    model_dir_or_embedded,
    send_all,
    send_timed,
    serve,
    server_flags,
    warm_up,
    wave_server_flags,
)
from lightllm.server.metrics import DECODE_BATCH_LABEL  # noqa: E402
from lightllm.tools.prompts import chat_prompt_texts, load_gsm8k, solve_turns  # noqa: E402
from lightllm.tools.report import MISSING, Column, ratio, render_table, write_json  # noqa: E402
from lightllm.utils.server_launcher import MetricsPage, scrape  # noqa: E402

BASELINE_BUDGET = 0.0
EQUAL_BATCH_DEFINITION = (
    "step_ratio_equal_batch: per round, for each decode batch size (CUDA graph ladder size; exact count on CPU) "
    "that both B and B = 0 decoded at, mean ms per decode step of B over that of B = 0, averaged with weights = "
    "B = 0's decode steps at that size; median over rounds. equal_batch_coverage: B = 0's decode steps at those "
    "sizes over all its decode steps, pooled over rounds.")


def decode_clock_by_batch(page: MetricsPage) -> List[List[float]]:
    """[batch, seconds, steps, decoded requests] per batch size with steps on ``page`` (a /metrics
    delta), by batch size."""
    seconds_name, steps_name, reqs_name = DECODE_CLOCK_BY_BATCH
    label = DECODE_BATCH_LABEL
    batches = sorted(int(dict(labels)[label]) for (name, labels), v in page.samples.items() if name == steps_name and v > 0)
    return [[b, page.value(seconds_name, **{label: str(b)}), int(page.value(steps_name, **{label: str(b)})),
             int(page.value(reqs_name, **{label: str(b)}))] for b in batches]


@dataclass
class Wave:
    round: int
    budget: float
    wall_s: float
    output_tokens: int
    steps: int  # sum(count_output_tokens - mtp_accepted_token_num)
    relaxed_tokens: int
    engine_s: float  # the router's time inside batch steps during the wave
    batch_steps: int
    batch_reqs: int  # running requests summed over the wave's batch steps
    token_ids: Optional[List[List[int]]] = None  # kept for the B = 0 determinism check only
    # the engine's clock over decode steps only (prefill steps of arriving prompts left out)
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_reqs: int = 0
    # the decode clock by batch size: [batch, seconds, steps, decoded requests] (decode_clock_by_batch)
    decode_by_batch: List[List[float]] = field(default_factory=list)
    # mixed steps (decode rows beside prompt chunks): their clock and decoded requests
    mixed_s: float = 0.0
    mixed_steps: int = 0
    mixed_reqs: int = 0
    # where a request's time went, summed over the wave's requests: the client's latency, and from
    # /metrics the server's (receipt to last output), the router queue's and the time to first token
    client_latency_s: float = 0.0
    server_e2e_s: float = 0.0
    server_queue_s: float = 0.0
    server_ttft_s: float = 0.0
    requests: int = 0
    arm: str = ""  # the server (--arms) that ran it; "" with one server
    # steps that decoded and their decoded requests until the wave's last request was sent: the batch
    # before the drain, when fewer requests are left than the concurrency (0: not measured)
    steady_decoding_steps: int = 0
    steady_decoding_reqs: int = 0
    # output tokens of the requests that finished before the last request was sent, and that window's seconds
    steady_output_tokens: int = 0
    steady_s: float = 0.0

    @property
    def decoding_steps(self) -> int:
        """Steps that decoded: decode steps and mixed steps."""
        return self.decode_steps + self.mixed_steps

    @property
    def decoding_reqs(self) -> int:
        return self.decode_reqs + self.mixed_reqs

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def engine_tokens_per_s(self) -> float:
        return self.output_tokens / self.engine_s

    @property
    def steady_tokens_per_s(self) -> Optional[float]:
        """tok/s before the drain (None: not measured)."""
        return self.steady_output_tokens / self.steady_s if self.steady_s > 0 else None


def steady_window(timed: Sequence[Timed], t0: float) -> Tuple[int, float]:
    """(output tokens of the requests done before the last request was sent, seconds from ``t0`` to that send):
    a closed loop keeps its concurrency until then."""
    last_sent = max(t.sent_s for t in timed)
    tokens = sum(t.response["count_output_tokens"] for t in timed if t.done_s <= last_sent)
    return tokens, last_sent - t0


@dataclass
class BudgetRow:
    budget: float
    waves: int
    tokens_per_step: float
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    speedup_vs_b0: float  # median over rounds of tok/s(B) / tok/s(B = 0) in the same round
    round_ratios: List[float]
    tokens_per_step_gain: float  # tokens/step(B) / tokens/step(B = 0) - 1
    engine_speedup_vs_b0: float  # the same median on the engine's clock
    engine_round_ratios: List[float]
    mean_batch: float  # running requests per batch step
    ms_per_batch_step: float
    step_cost_speedup_vs_b0: float  # output tokens per batch step, B over B = 0: the speed-up at equal step cost
    ms_per_decode_step: float  # decode steps only
    mean_decode_batch: float  # requests per step that decoded (decode steps and mixed steps)
    decode_step_vs_b0: float  # median over rounds of ms / decode step, B over B = 0 in the same round
    step_ratio_equal_batch: float  # median over rounds of equal_batch_step_ratio (EQUAL_BATCH_DEFINITION)
    step_ratio_equal_batch_rounds: List[float]
    equal_batch_coverage: float  # B = 0's decode steps at the batch sizes compared / all, pooled over rounds
    # per request, pooled (ms): the client's latency, the server's receipt to last output, the part
    # outside it (the client, the wire, the HTTP server around its receipt and reply), queue, TTFT
    client_latency_ms: float = float("nan")
    server_e2e_ms: float = float("nan")
    outside_server_ms: float = float("nan")
    server_queue_ms: float = float("nan")
    server_ttft_ms: float = float("nan")
    mean_decode_batch_steady: float = float("nan")  # mean_decode_batch until the last request was sent
    speedup_vs_b0_steady: float = float("nan")  # speedup_vs_b0 before the drain (Wave.steady_tokens_per_s)
    steady_round_ratios: List[float] = field(default_factory=list)


class _Snapshot:
    """/metrics of ``url`` taken on a thread of its own from ``start`` (the client thread that calls it goes on
    sending at once); ``page`` waits for it."""

    def __init__(self, url: str):
        self.url, self._page, self._thread = url, None, None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._take, name="drain_snapshot", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        self._page = scrape(self.url)

    def page(self) -> MetricsPage:
        if self._thread is None:
            raise RuntimeError("the wave sent no request")
        self._thread.join()
        return self._page


# requests per concurrency slot in each untimed warm wave (--warm_waves): finishes and arrivals at full
# concurrency, as in the timed waves
WARM_REQUESTS_PER_SLOT = 4


def warm_waves(prompts: Sequence[str], budgets: Sequence[float], waves: int, concurrency: int,
               max_new_tokens: int) -> List[List[Dict]]:
    """The untimed waves' bodies: ``waves`` rounds of one wave per budget, each of the first
    WARM_REQUESTS_PER_SLOT * concurrency prompts (all of them when fewer)."""
    n = min(len(prompts), WARM_REQUESTS_PER_SLOT * concurrency)
    return [[generate_body(p, max_new_tokens, b, return_details=True) for p in prompts[:n]]
            for _ in range(waves) for b in budgets]


def round_orders(budgets: Sequence, rounds: int) -> List[list]:
    """Round r sends the budgets (or the arms) rotated left by r, so none always runs first."""
    n = len(budgets)
    return [[budgets[(r + i) % n] for i in range(n)] for r in range(rounds)]


def _pooled(waves: Sequence[Wave], num: str, den: str, scale: float = 1.0) -> float:
    """scale * sum(num) / sum(den) over the waves (den a count: 0 when it is)."""
    return scale * sum(getattr(w, num) for w in waves) / max(1, sum(getattr(w, den) for w in waves))


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(waves: Sequence[Wave], budgets: Sequence[float]) -> List[BudgetRow]:
    base = {w.round: w for w in waves if w.budget == BASELINE_BUDGET}
    if not base:
        raise ValueError("no B = 0 wave: it is the baseline")
    b0s = list(base.values())
    rows = []
    for b in budgets:
        ws = [w for w in waves if w.budget == b]
        paired = [(w, base[w.round]) for w in ws if w.round in base]

        def per_round(value: Callable[[Wave], Optional[float]]) -> List[float]:
            """value(B's wave) / value(B = 0's wave) in each round where both are known."""
            return [r for r in (ratio(value(w), value(b0)) for w, b0 in paired) if r is not None]

        per_step = _pooled(ws, "output_tokens", "steps")
        rates = [w.tokens_per_s for w in ws]
        ratios = per_round(lambda w: w.tokens_per_s)
        engine_ratios = per_round(lambda w: w.engine_tokens_per_s)
        steady_ratios = per_round(lambda w: w.steady_tokens_per_s)
        step_ratios = per_round(lambda w: ratio(1000 * w.decode_s, w.decode_steps))
        equal = [equal_batch_step_ratio(w, b0) for w, b0 in paired]
        equal_ratios = [r for r, _ in equal if r is not None]
        b0_steps = sum(n for _, b0 in paired for _, _, n, _ in b0.decode_by_batch)

        def per_request_ms(name: str) -> float:
            """ms per request, pooled; NaN for waves saved before the latency split."""
            return _pooled(ws, name, "requests", 1000) if any(w.requests for w in ws) else float("nan")

        client_ms, e2e_ms = per_request_ms("client_latency_s"), per_request_ms("server_e2e_s")
        rows.append(BudgetRow(
            b, len(ws), per_step, statistics.median(rates), min(rates), max(rates), _median(ratios), ratios,
            per_step / _pooled(b0s, "output_tokens", "steps") - 1, _median(engine_ratios), engine_ratios,
            _pooled(ws, "batch_reqs", "batch_steps"), _pooled(ws, "engine_s", "batch_steps", 1000),
            _pooled(ws, "output_tokens", "batch_steps") / _pooled(b0s, "output_tokens", "batch_steps"),
            _pooled(ws, "decode_s", "decode_steps", 1000), _pooled(ws, "decoding_reqs", "decoding_steps"),
            _median(step_ratios), _median(equal_ratios), equal_ratios,
            sum(n for _, n in equal) / b0_steps if b0_steps else float("nan"),
            client_ms, e2e_ms, client_ms - e2e_ms, *(per_request_ms(n) for n in ("server_queue_s", "server_ttft_s")),
            mean_decode_batch_steady=(_pooled(ws, "steady_decoding_reqs", "steady_decoding_steps")
                                      if any(w.steady_decoding_steps for w in ws) else float("nan")),
            speedup_vs_b0_steady=_median(steady_ratios), steady_round_ratios=steady_ratios))
    return rows


def equal_batch_step_ratio(w: Wave, b0: Wave) -> Tuple[Optional[float], int]:
    """(one round's ratio of EQUAL_BATCH_DEFINITION, or None when the waves share no batch size;
    the B = 0 steps it weighs)."""
    # (mean ms per decode step, steps) by batch size
    mine, base = ({int(b): (1000 * s / n, int(n)) for b, s, n, _ in x.decode_by_batch if n} for x in (w, b0))
    shared = [b for b in base if b in mine]
    weight = sum(base[b][1] for b in shared)
    if not weight:
        return None, 0
    return sum(base[b][1] * mine[b][0] / base[b][0] for b in shared) / weight, weight


def by_batch_rows(waves: Sequence[Wave], budgets: Sequence[float]) -> List[Dict[str, object]]:
    """Per decode batch size, pooled over rounds: each budget's decode steps and ms per step."""
    steps: Dict[Tuple[int, float], int] = defaultdict(int)  # by (batch size, budget)
    seconds: Dict[Tuple[int, float], float] = defaultdict(float)
    for w in waves:
        for batch, s, n, _ in w.decode_by_batch:
            steps[int(batch), w.budget] += int(n)
            seconds[int(batch), w.budget] += s
    rows = []
    for batch in sorted({key[0] for key in steps}):
        row: Dict[str, object] = {"batch": batch}
        for b in budgets:
            n = steps[batch, b]
            row.update({f"steps_{b:g}": n, f"ms_{b:g}": 1000 * seconds[batch, b] / n if n else None})
        rows.append(row)
    return rows


def by_batch_table(budgets: Sequence[float]) -> List[Column]:
    return [Column("batch", "decode batch size")] + [
        c for b in budgets for c in (Column(f"steps_{b:g}", f"B = {b:g} steps"), Column(f"ms_{b:g}", "ms / step", ".2f"))]


def b0_rounds_identical(waves: Sequence[Wave]) -> bool:
    """Every B = 0 wave produced the same token ids (the server's schedule is deterministic)."""
    ids = [w.token_ids for w in waves if w.budget == BASELINE_BUDGET]
    return all(x == ids[0] for x in ids[1:])


@dataclass
class ArmRow:
    """One server of ``--arms`` at one budget, against the first arm at that budget in the same rounds."""

    arm: str
    budget: float
    median_tok_s: float
    vs_first_arm: float  # median over rounds of tok/s over the first arm's at this budget in the same round
    round_ratios: List[float]
    engine_vs_first_arm: float  # the same on the engine's clock
    speedup_vs_b0: float  # this arm's own ASD speed-up (BudgetRow.speedup_vs_b0)
    tokens_per_step_gain: float
    gain_ratio: float  # (speedup_vs_b0 - 1) / tokens_per_step_gain: how much of ASD's tokens/step gain is tok/s
    mixed_steps_per_wave: float
    mean_decode_batch: float
    server_ttft_ms: float
    mean_decode_batch_steady: float
    gain_ratio_steady: float  # gain_ratio before the drain (BudgetRow.speedup_vs_b0_steady)


def summarize_arms(waves: Sequence[Wave], budgets: Sequence[float], arms: Sequence[str]) -> List[ArmRow]:
    """Each arm's budgets against the first arm's, paired by round (the arms' waves interleave)."""
    first = {(w.round, w.budget): w for w in waves if w.arm == arms[0]}
    rows = []
    for arm in arms:
        mine = [w for w in waves if w.arm == arm]
        by_budget = {r.budget: r for r in summarize(mine, budgets)}
        for b in budgets:
            ws = [w for w in mine if w.budget == b]
            pairs = [(w, first[w.round, b]) for w in ws if (w.round, b) in first]
            tok = [r for r in (ratio(w.tokens_per_s, f.tokens_per_s) for w, f in pairs) if r is not None]
            eng = [r for r in (ratio(w.engine_tokens_per_s, f.engine_tokens_per_s) for w, f in pairs) if r is not None]
            row = by_budget[b]
            gain = row.tokens_per_step_gain
            rows.append(ArmRow(arm, b, row.median_tok_s, _median(tok), tok, _median(eng), row.speedup_vs_b0, gain,
                               _gain_ratio(row.speedup_vs_b0, gain),
                               statistics.mean(w.mixed_steps for w in ws) if ws else float("nan"),
                               row.mean_decode_batch, row.server_ttft_ms, row.mean_decode_batch_steady,
                               _gain_ratio(row.speedup_vs_b0_steady, gain)))
    return rows


def _gain_ratio(speedup: float, tokens_per_step_gain: float) -> float:
    """How much of the tokens/step gain a speed-up turns into tok/s (NaN without a gain)."""
    return (speedup - 1) / tokens_per_step_gain if tokens_per_step_gain else float("nan")


def parse_arms(specs: Optional[Sequence[str]]) -> List[Tuple[str, List[str]]]:
    """``NAME=FLAGS`` each (FLAGS shell-quoted server flags); None: one server, no name."""
    if not specs:
        return [("", [])]
    arms = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"--arms: NAME=FLAGS each, got {spec!r}")
        arms.append((name.strip(), shlex.split(flags)))
    names = [n for n, _ in arms]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--arms: names must differ, got {names}")
    return arms


def _ratios(xs: Sequence[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs) or MISSING


TABLE = (
    Column("budget", "B", "g"), Column("waves", "waves"), Column("tokens_per_step", "tokens/step", ".3f"),
    Column("tokens_per_step_gain", "vs B = 0", "+.1%"), Column("median_tok_s", "median tok/s", ".1f"),
    Column("min_tok_s", "min", ".1f"), Column("max_tok_s", "max", ".1f"),
    Column("speedup_vs_b0", "speed-up vs B = 0 (median of rounds)", ".3f", "x"),
    Column("round_ratios", "per round", _ratios), Column("engine_speedup_vs_b0", "engine speed-up vs B = 0", ".3f", "x"),
    Column("engine_round_ratios", "per round", _ratios), Column("mean_batch", "mean batch", ".1f"),
    Column("ms_per_batch_step", "ms / batch step", ".2f"),
    Column("ms_per_decode_step", "ms / decode step", ".2f"), Column("mean_decode_batch", "decode batch", ".1f"),
    Column("mean_decode_batch_steady", "decode batch before the drain", ".1f"),
    Column("speedup_vs_b0_steady", "speed-up before the drain (median of rounds)", ".3f", "x"),
    Column("steady_round_ratios", "per round", _ratios),
    Column("decode_step_vs_b0", "decode step vs B = 0 (median of rounds)", ".3f", "x"),
    Column("step_cost_speedup_vs_b0", "speed-up at B = 0's step cost", ".3f", "x"),
    Column("step_ratio_equal_batch",
           "decode step vs B = 0 at equal batch (per batch size both hit, weights: B = 0's steps; median of rounds)",
           ".3f", "x"),
    Column("step_ratio_equal_batch_rounds", "per round", _ratios),
    Column("equal_batch_coverage", "B = 0 steps covered", ".1%"),
    Column("client_latency_ms", "client latency ms", ".1f"), Column("server_e2e_ms", "server e2e ms", ".1f"),
    Column("outside_server_ms", "outside ms", ".1f"), Column("server_queue_ms", "queue ms", ".2f"),
    Column("server_ttft_ms", "TTFT ms", ".1f"),
)


ARMS_TABLE = (
    Column("arm", "arm"), Column("budget", "B", "g"), Column("median_tok_s", "median tok/s", ".1f"),
    Column("vs_first_arm", "vs first arm (median of rounds)", ".3f", "x"), Column("round_ratios", "per round", _ratios),
    Column("engine_vs_first_arm", "engine vs first arm", ".3f", "x"),
    Column("speedup_vs_b0", "ASD speed-up vs B = 0", ".3f", "x"), Column("tokens_per_step_gain", "tokens/step", "+.1%"),
    Column("gain_ratio", "tok/s gain / tokens/step gain", ".2f"),
    Column("mixed_steps_per_wave", "mixed steps / wave", ".0f"), Column("mean_decode_batch", "decode batch", ".1f"),
    Column("mean_decode_batch_steady", "before the drain", ".1f"),
    Column("gain_ratio_steady", "gain ratio before the drain", ".2f"), Column("server_ttft_ms", "TTFT ms", ".1f"),
)


def parse_budgets(s: str) -> List[float]:
    try:
        budgets = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budgets: comma-separated numbers, got {s!r}")
    if BASELINE_BUDGET not in budgets:
        raise argparse.ArgumentTypeError("--budgets must include 0 (the baseline)")
    if any(b < 0 for b in budgets) or len(set(budgets)) != len(budgets):
        raise argparse.ArgumentTypeError(f"--budgets: distinct values >= 0, got {s!r}")
    return budgets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="GSM8K jsonl (the test split)")
    p.add_argument("--from_json", default=None, help="print the table of an earlier run's --out JSON and exit")
    p.add_argument("--num_questions", type=int, default=None, help="first N questions (default: all)")
    p.add_argument("--model_dir", default=None, help="default: the embedded model")
    p.add_argument("--mtp_mode", default="eagle_with_att")
    p.add_argument("--mtp_step", type=int, default=3)
    p.add_argument("--budgets", type=parse_budgets, default=parse_budgets(f"0,{USAGE.budget:g},8"))
    p.add_argument("--local_ratio", type=float, default=USAGE.local_ratio, help="--mtp_asd_local_regret_ratio (g)")
    p.add_argument("--max_mismatch", type=int, default=USAGE.max_mismatch, help="--mtp_asd_block_max_mismatch (m)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--warm_waves", type=int, default=1,
                   help="untimed closed-loop waves per budget on each server before the rounds (0: none)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--prompt_cache", action="store_true",
                   help="keep the server's prompt cache on (off by default: the interleaved arms resend the same "
                        "questions, so later arms would skip their prefills)")
    p.add_argument("--server_args", default="", help="more server flags (one string, shell-quoted), e.g. "
                   "--disable_mixed_steps for the alternating schedule")
    p.add_argument("--arms", nargs="+", default=None, metavar="NAME=FLAGS",
                   help="servers to compare in one run, each NAME=more server flags (shell-quoted, after "
                        "--server_args), e.g. 'w0=--router_max_wait_tokens 0' 'w4=--router_max_wait_tokens 4': "
                        "they start one after another and stay up, every round sends each its waves (arms and "
                        "budgets in rotated orders), and the arms table pairs each with the first by round")
    a = p.parse_args(argv)
    try:
        a.arms = parse_arms(a.arms)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if not a.data and not a.from_json:
        p.error("--data is required (or --from_json)")
    if a.rounds < 1 or a.concurrency < 1 or a.max_new_tokens < 1:
        p.error("--rounds, --concurrency and --max_new_tokens must be >= 1")
    if a.warm_waves < 0:
        p.error("--warm_waves must be >= 0")
    return a


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    if args.from_json:
        return print_saved(args.from_json)
    model_dir = model_dir_or_embedded(args.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_texts(tok, solve_turns(load_gsm8k(args.data, args.num_questions)))
    max_len = auto_max_req_total_len([len(tok.encode(p)) for p in prompts], args.max_new_tokens)
    # the server's own budget is B = 0, each request sets its own
    asd = AsdSetting(BASELINE_BUDGET, args.local_ratio, args.max_mismatch)
    flags = (wave_server_flags(model_dir, args.concurrency, max_len)
             + server_flags(mtp_mode=args.mtp_mode, mtp_step=args.mtp_step, **asd.start_args())
             # the arms resend the same questions: without this, later arms would prefill from the cache
             + ([] if args.prompt_cache else ["--disable_dynamic_prompt_cache"])
             + shlex.split(args.server_args))
    logs = tempfile.mkdtemp(prefix="bench_asd_budgets_")
    names = [name for name, _ in args.arms]
    print(f"{len(prompts)} questions, budgets {args.budgets}, {args.rounds} rounds, arms {names}; server logs {logs}",
          flush=True)
    waves: List[Wave] = []
    with ExitStack() as stack:
        servers = {}
        for name, extra in args.arms:  # one after another: each sizes its KV pool from the memory left
            servers[name] = stack.enter_context(serve(flags + extra, os.path.join(logs, f"server{name}.log")))
            warm_up(servers[name].url, prompts, args.max_new_tokens, args.concurrency)
            for bodies in warm_waves(prompts, args.budgets, args.warm_waves, args.concurrency, args.max_new_tokens):
                send_all(servers[name].url, bodies, args.concurrency)
        arm_orders = round_orders(names, args.rounds)
        for r, order in enumerate(round_orders(args.budgets, args.rounds)):
            for arm, b in ((arm, b) for arm in arm_orders[r] for b in order):
                server = servers[arm]
                bodies = [generate_body(p, args.max_new_tokens, b, return_details=True) for p in prompts]
                before = scrape(server.url)
                t0 = time.perf_counter()
                desc = f"round {r}{' ' + arm if arm else ''} B={b:g}"
                drain = _Snapshot(server.url)
                timed, _ = send_timed(server.url, bodies, args.concurrency, desc=desc, on_last_start=drain.start)
                wall = time.perf_counter() - t0
                res = [t.response for t in timed]
                grown = scrape(server.url) - before
                steady = drain.page() - before
                engine_s, batch_steps, batch_reqs = (grown.value(n) for n in ENGINE_CLOCK)
                decode_s, decode_steps, decode_reqs = (grown.value(n) for n in DECODE_CLOCK)
                mixed_s, mixed_steps, mixed_reqs = (grown.value(n) for n in MIXED_CLOCK)
                count = sum(x["count_output_tokens"] for x in res)
                waves.append(Wave(
                    r, b, wall, count, count - sum(x["mtp_accepted_token_num"] for x in res),
                    sum(x["asd_relaxed_token_num"] for x in res), engine_s, int(batch_steps), int(batch_reqs),
                    [[t["id"] for t in x["tokens"]] for x in res] if b == BASELINE_BUDGET else None,
                    decode_s, int(decode_steps), int(decode_reqs), decode_clock_by_batch(grown),
                    mixed_s, int(mixed_steps), int(mixed_reqs), sum(t.latency_s for t in timed),
                    *(grown.value(f"{n}_sum") for n in LATENCY_METRICS), len(timed), arm,
                    *(int(steady.value(steps) + steady.value(mixed))
                      for steps, mixed in zip(DECODE_CLOCK[1:], MIXED_CLOCK[1:])), *steady_window(timed, t0)))
            if args.out:  # after every round: a run cut short keeps its finished rounds
                write_results(args.out, args, flags, waves)
    print_tables(waves, args.budgets, names)
    return 0


def print_tables(waves: Sequence[Wave], budgets: Sequence[float], arms: Sequence[str] = ("",),
                 identical: Optional[Dict[str, bool]] = None) -> None:
    """Each arm's tables; ``identical``: each arm's B = 0 determinism (default: from the waves' token ids)."""
    for arm in arms:
        mine = [w for w in waves if w.arm == arm]
        if arm:
            print(f"\n== arm {arm}")
        print(render_table(summarize(mine, budgets), TABLE, markdown=True))
        by_batch = by_batch_rows(mine, budgets)
        if by_batch:
            print("\nDecode steps by batch size (pooled over rounds):")
            print(render_table(by_batch, by_batch_table(budgets), markdown=True))
        same = identical[arm] if identical is not None else b0_rounds_identical(mine)
        print(f"B = 0 waves token-identical across rounds: {same}")
    if len(arms) > 1:
        print(f"\nArms against {arms[0]!r}, paired by round:")
        print(render_table(summarize_arms(waves, budgets, arms), ARMS_TABLE, markdown=True))


def print_saved(path: str) -> int:
    with open(path) as f:
        saved = json.load(f)
    fields = set(Wave.__dataclass_fields__)
    missing = fields - {"token_ids", "decode_by_batch", "arm"} - set(saved["waves"][0])  # older runs: no batch sizes
    if missing:
        raise SystemExit(f"{path}: its waves lack {sorted(missing)} (written before the engine clock)")
    waves = [Wave(**{k: v for k, v in w.items() if k in fields}) for w in saved["waves"]]
    arms = [name for name, _ in saved["args"].get("arms") or [("", [])]]
    per_arm = saved.get("arms") or {}  # the token ids are not saved: the run's verdicts
    identical = {a: per_arm[a]["b0_rounds_identical"] if a in per_arm else saved["b0_rounds_identical"] for a in arms}
    print_tables(waves, [float(b) for b in saved["args"]["budgets"]], arms, identical)
    return 0


def write_results(path: str, args, flags: List[str], waves: Sequence[Wave]) -> None:
    """One server: its rows; with --arms also ``arms``: each arm's rows, decode clock by batch and the arms table."""
    names = [name for name, _ in args.arms]
    first = [w for w in waves if w.arm == names[0]]
    arms = {}
    if len(names) > 1:
        for name in names:
            mine = [w for w in waves if w.arm == name]
            arms[name] = {"rows": [asdict(r) for r in summarize(mine, args.budgets)] if mine else [],
                          "decode_by_batch": by_batch_rows(mine, args.budgets),
                          "b0_rounds_identical": b0_rounds_identical(mine)}
        arms["table"] = [asdict(r) for r in summarize_arms(waves, args.budgets, names)]
    write_json(path, {"args": vars(args), "server_flags": flags, "rounds_done": 1 + max(w.round for w in waves),
                      "definitions": {"step_ratio_equal_batch": EQUAL_BATCH_DEFINITION},
                      "b0_rounds_identical": b0_rounds_identical(first),
                      "rows": [asdict(r) for r in summarize(first, args.budgets)], "arms": arms,
                      "decode_by_batch": by_batch_rows(first, args.budgets),
                      "waves": [{**asdict(w), "token_ids": None, "tokens_per_s": w.tokens_per_s,
                                 "engine_tokens_per_s": w.engine_tokens_per_s} for w in waves]}, indent=1)


if __name__ == "__main__":
    sys.exit(main())
