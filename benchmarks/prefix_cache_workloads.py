"""The workloads of ``bench_e2e_throughput.py --prefix_cache`` (the radix prompt cache, cache on
vs off): what is sent, the streamed OpenAI client that times it, and the rows made of it.

Pure except ``stream_openai``, ``run_conversations`` and ``run_requests`` (HTTP, streamed
``/v1/chat/completions`` or ``/v1/completions``); the servers are started by
``bench_e2e_throughput.run_prefix_cache``. Every time is the client's ``time.perf_counter``.
"""
import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from lightllm.tools.client import _bounded
from lightllm.tools.prompts import fit_text_to_tokens
from lightllm.tools.report import Column, ratio
from lightllm.utils.server_launcher import SSE_DATA_PREFIX, MetricsPage

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
ON, OFF = "on", "off"  # the arms: the default server (cache on) and --disable_dynamic_prompt_cache
ARM_FLAGS = {ON: [], OFF: ["--disable_dynamic_prompt_cache"]}
WORKLOADS = ("chat", "doc", "resend", "pressure")
PERCENTILES = (50, 99)
# the prompt cache's samples on /metrics (counters and gauges)
CACHE_HIT_TOKENS = "lightllm_prompt_cache_hit_tokens_total"
CACHE_COMPUTED_TOKENS = "lightllm_prompt_tokens_computed_total"
CACHE_EVICTED_TOKENS = "lightllm_prompt_cache_evicted_tokens_total"
CACHE_COUNTERS = (CACHE_HIT_TOKENS, CACHE_COMPUTED_TOKENS, CACHE_EVICTED_TOKENS)
CACHE_TOKENS = "lightllm_prompt_cache_tokens"
CACHE_HIT_RATE = "lightllm_prompt_cache_hit_rate"
KV_POOL_LOG_RE = re.compile(r"KV pool (\d+) tokens")  # api_start's "serving ..." line
# Done-means printed beside the numbers (the targets; checked, never asserted)
CHAT_TTFT_LATER_RATIO_MAX = 0.25  # cache-on TTFT p50 of turns 2.. <= 25% of cache-off's
CHAT_TOK_S_RATIO_MIN = 1.5  # cache-on output tok/s >= 1.5x cache-off's
RESEND_TTFT_MS_MAX = 15.0  # cache-on median TTFT of a resend


# --- the texts -------------------------------------------------------------------------------------------------
def exact_length_text(tokenizer, n_tokens: int, texts: Sequence[str], start: int = 0) -> Tuple[str, int]:
    """(text, its token count without special tokens) of ``n_tokens``: ``texts`` from ``start``
    (cycling, one blank line apart), its tokens cut to fit. The text is re-tokenized when it is
    sent, so the cut is moved until the count is ``n_tokens``, or the closest not above it (as
    ``exact_length_prompt_text`` does for a whole chat prompt)."""
    if n_tokens < 1:
        raise ValueError(f"need at least 1 token, got {n_tokens}")
    if not texts:
        raise ValueError("no texts to build a prompt from")

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return fit_text_to_tokens(tokenizer, n_tokens, texts, start, n_tokens, lambda t: t, count)


def conversation_turns(questions: Sequence[str], conversations: int, turns: int, start: int = 0) -> List[List[str]]:
    """The user messages: conversation c's turn t is question ``start + c * turns + t`` (cycling),
    so no two turns ask the same question while there are enough questions."""
    if not questions:
        raise ValueError("no questions")
    return [[questions[(start + c * turns + t) % len(questions)] for t in range(turns)] for c in range(conversations)]


def doc_question_message(doc: str, question: str) -> str:
    """The user message of a shared-document question: the document first (the shared prefix)."""
    return f"{doc}\n\nQuestion about the text above: {question}"


def chat_body(messages: Sequence[Dict[str, str]], max_tokens: int, ignore_eos: bool = True) -> Dict:
    """A greedy streamed chat request whose last event is the usage."""
    return {"messages": [dict(m) for m in messages], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}


def completion_body(prompt: str, max_tokens: int, ignore_eos: bool = True) -> Dict:
    """A greedy streamed completion request whose last event is the usage."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}


# --- the client ------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    """One streamed OpenAI request on the client's clock: what came back and when."""

    sent_s: float
    first_s: Optional[float] = None  # the first read that brought text or a finish reason
    done_s: float = 0.0
    text: str = ""  # the deltas, joined
    prompt_tokens: int = 0  # the usage's
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    status: int = 200  # the HTTP status
    error: Optional[str] = None  # an error event, an HTTP error body, a client exception

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason not in (None, "error")

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_s is None else self.first_s - self.sent_s


def parse_event(reply: Reply, obj: Dict, now: float) -> None:
    """Fold one SSE event's JSON (chat or completion chunk, or the usage) into ``reply``."""
    if "error" in obj:
        reply.error = str(obj["error"].get("message", obj["error"]) if isinstance(obj["error"], dict)
                          else obj["error"])
        return
    usage = obj.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", 0)
        reply.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            reply.cached_tokens = int(details["cached_tokens"])
    for choice in obj.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if piece:
            reply.text += piece
        if (piece or choice.get("finish_reason")) and reply.first_s is None:
            reply.first_s = now
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]


async def stream_openai(client, path: str, body: Dict) -> Reply:
    """POST ``body`` to ``path`` streamed; never raises for the request's own failure (the reply says it)."""
    reply = Reply(time.perf_counter())
    buf = b""
    try:
        async with client.stream("POST", path, json=body) as r:
            reply.status = r.status_code
            if r.status_code != 200:
                reply.error = (await r.aread()).decode(errors="replace")[:500]
            else:
                async for data in r.aiter_bytes():
                    now = time.perf_counter()  # before parsing: the parse's time is not the server's
                    *events, buf = (buf + data).split(b"\n\n")
                    for event in events:
                        payload = event.strip()
                        if payload.startswith(SSE_DATA_PREFIX.encode()) and not payload.endswith(b"[DONE]"):
                            parse_event(reply, json.loads(payload[len(SSE_DATA_PREFIX):]), now)
    except Exception as e:  # a dropped connection: the reply is a failure, the run goes on
        reply.error = f"{type(e).__name__}: {e}"
    reply.done_s = time.perf_counter()
    if reply.finish_reason is None and reply.error is None:
        reply.error = "the stream ended without a finish reason"
    return reply


async def _conversation(client, system: str, user_turns: Sequence[str], max_tokens: int) -> List[Reply]:
    """One conversation, turn after turn: each reply joins the history of the next turn; a
    failed turn ends it (its later turns are not sent)."""
    messages = [{"role": "system", "content": system}]
    replies = []
    for question in user_turns:
        messages.append({"role": "user", "content": question})
        reply = await stream_openai(client, CHAT_PATH, chat_body(messages, max_tokens))
        replies.append(reply)
        if not reply.ok:
            break
        messages.append({"role": "assistant", "content": reply.text})
    return replies


def run_conversations(url: str, system: str, turns: Sequence[Sequence[str]], max_tokens: int,
                      desc: Optional[str] = None) -> Tuple[List[List[Reply]], float]:
    """Every conversation at once (each sequential in its turns): the replies per conversation and the wall time."""
    t0 = time.perf_counter()
    out = asyncio.run(_bounded(url, list(turns), max(1, len(turns)), desc,
                               lambda c, t: _conversation(c, system, t, max_tokens)))
    return out, time.perf_counter() - t0


def run_requests(url: str, path: str, bodies: Sequence[Dict], concurrency: int,
                 desc: Optional[str] = None) -> Tuple[List[Reply], float]:
    """Closed-loop, at most ``concurrency`` in flight: the replies in order and the wall time."""
    t0 = time.perf_counter()
    out = asyncio.run(_bounded(url, list(bodies), concurrency, desc, lambda c, b: stream_openai(c, path, b)))
    return out, time.perf_counter() - t0


# --- the rows --------------------------------------------------------------------------------------------------
@dataclass
class ArmRun:
    """One arm's run of one workload on one server: replies per conversation (a workload of
    single requests: one-turn conversations), its wall time and its /metrics growth."""

    arm: str
    round: int
    replies: List[List[Reply]]
    wall_s: float
    counters: Dict[str, Optional[float]] = field(default_factory=dict)  # cache_counters()
    gauges: Dict[str, Optional[float]] = field(default_factory=dict)  # cache_gauges() after the run


def cache_counters(grown: Optional[MetricsPage]) -> Dict[str, Optional[float]]:
    """The prompt cache's counters' growth over a run (None: not on the page, e.g. a server without the cache)."""
    return {name: (grown.samples.get((name, ())) if grown is not None else None) for name in CACHE_COUNTERS}


def cache_gauges(page: Optional[MetricsPage]) -> Dict[str, Optional[float]]:
    return {name: (page.samples.get((name, ())) if page is not None else None)
            for name in (CACHE_TOKENS, CACHE_HIT_RATE)}


def kv_pool_from_log(log_text: str) -> Optional[int]:
    """The KV pool size the server's start line reports (None: no such line)."""
    m = KV_POOL_LOG_RE.search(log_text)
    return int(m.group(1)) if m else None


def percentile_fields(name: str, xs: Sequence[float]) -> Dict[str, Optional[float]]:
    values = np.percentile(xs, PERCENTILES) if len(xs) else [None] * len(PERCENTILES)
    return {f"{name}_p{q}": None if v is None else float(v) for q, v in zip(PERCENTILES, values)}


def _sum_known(values: Sequence[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def arm_row(name: str, runs: Sequence[ArmRun]) -> Dict[str, object]:
    """One arm's row over its runs (rounds pooled: percentiles of all samples, tok/s = all output
    tokens / the runs' summed wall time). ``turn1``: each conversation's first request; ``later``:
    the rest (turns 2..; the resends); hit rates from the usage (cached / prompt tokens) and from
    /metrics (hit / (hit + computed) prompt tokens over the runs)."""
    if not runs:
        raise ValueError(f"{name}: no runs")
    flat = [(t, r) for run in runs for conv in run.replies for t, r in enumerate(conv)]
    ok = [(t, r) for t, r in flat if r.ok]
    wall = sum(run.wall_s for run in runs)
    out_tokens = sum(r.completion_tokens for _, r in ok)

    def ttfts(pred: Callable[[int], bool]) -> List[float]:
        return [1e3 * r.ttft_s for t, r in ok if pred(t) and r.ttft_s is not None]

    def hit_rate(pred: Callable[[int], bool]) -> Optional[float]:
        chosen = [r for t, r in ok if pred(t)]
        if not chosen or all(r.cached_tokens is None for r in chosen):
            return None
        return ratio(float(sum(r.cached_tokens or 0 for r in chosen)), float(sum(r.prompt_tokens for r in chosen)))

    hit, computed, evicted = (_sum_known([run.counters.get(n) for run in runs]) for n in CACHE_COUNTERS)
    first, later = ttfts(lambda t: t == 0), ttfts(lambda t: t >= 1)
    row: Dict[str, object] = {
        "arm": name, "rounds": len(runs), "requests": len(flat), "failed": len(flat) - len(ok),
        "finish_reasons": dict(sorted(Counter(str(r.finish_reason) for _, r in flat).items())),
        "http_statuses": dict(sorted(Counter(str(r.status) for _, r in flat).items())),
        "wall_s": wall, "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for _, r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for _, r in ok),
        **percentile_fields("ttft_ms", ttfts(lambda t: True)),
        **percentile_fields("ttft_turn1_ms", first), **percentile_fields("ttft_later_ms", later),
        "ttft_turn1_ms_median": float(np.median(first)) if first else None,
        "ttft_later_ms_median": float(np.median(later)) if later else None,
        "usage_hit_rate": hit_rate(lambda t: True), "usage_hit_rate_later": hit_rate(lambda t: t >= 1),
        "metrics_hit_tokens": hit, "metrics_computed_tokens": computed, "metrics_evicted_tokens": evicted,
        "metrics_hit_rate": ratio(hit, (hit or 0) + (computed or 0)) if hit is not None else None,
        "metrics_cache_tokens_after": runs[-1].gauges.get(CACHE_TOKENS),
        "metrics_hit_rate_gauge_after": runs[-1].gauges.get(CACHE_HIT_RATE),
        "errors": sorted({r.error for _, r in flat if r.error})[:5],
    }
    return row


RATIO_KEYS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "ttft_turn1_ms_p50", "ttft_later_ms_p50",
              "ttft_later_ms_p99", "ttft_later_ms_median")


def on_off_ratios(on: Optional[Dict[str, object]], off: Optional[Dict[str, object]],
                  keys: Sequence[str] = RATIO_KEYS) -> Dict[str, Optional[float]]:
    """``KEY_on_over_off``: the cache-on row's KEY / the cache-off row's (None without both)."""
    return {f"{k}_on_over_off": ratio(on.get(k), off.get(k)) if on and off else None for k in keys}


def output_differences(a: Sequence[Sequence[Reply]], b: Sequence[Sequence[Reply]]) -> Dict[str, int]:
    """Per conversation turn, whether the two arms generated the same text: ``compared`` turns both
    answered, ``different`` of those, ``missing`` turns one of them lacks or failed."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} vs {len(b)} conversations")
    compared = different = missing = 0
    for ca, cb in zip(a, b):
        for t in range(max(len(ca), len(cb))):
            ra = ca[t] if t < len(ca) else None
            rb = cb[t] if t < len(cb) else None
            if ra is None or rb is None or not ra.ok or not rb.ok:
                missing += 1
                continue
            compared += 1
            different += ra.text != rb.text
    return {"compared": compared, "different": different, "missing": missing}


def _at_most(value: Optional[float], limit: float) -> Optional[bool]:
    return None if value is None else value <= limit


def _at_least(value: Optional[float], limit: float) -> Optional[bool]:
    return None if value is None else value >= limit


def chat_done(ratios: Dict[str, Optional[float]]) -> Dict[str, Optional[bool]]:
    """The multi-turn targets: TTFT p50 of turns 2.. <= 25% of cache-off; output tok/s >= 1.5x."""
    return {"ttft_later_p50_le_25pct_of_off": _at_most(ratios.get("ttft_later_ms_p50_on_over_off"),
                                                       CHAT_TTFT_LATER_RATIO_MAX),
            "tok_s_ge_1_5x_off": _at_least(ratios.get("output_tok_s_on_over_off"), CHAT_TOK_S_RATIO_MIN)}


def resend_done(on: Optional[Dict[str, object]]) -> Dict[str, Optional[bool]]:
    return {"resend_ttft_median_le_15ms": _at_most(on.get("ttft_later_ms_median") if on else None,
                                                   RESEND_TTFT_MS_MAX)}


def pressure_done(rows: Dict[str, Dict[str, object]], diffs: Sequence[Dict[str, int]]) -> Dict[str, Optional[bool]]:
    """Memory pressure: every request of every arm succeeded, the arms' outputs are identical,
    the cache-on arm evicted."""
    on = rows.get(ON)
    evicted = on.get("metrics_evicted_tokens") if on else None
    return {"all_requests_ok": all(r["failed"] == 0 for r in rows.values()) if rows else None,
            "outputs_identical": (sum(d["different"] + d["missing"] for d in diffs) == 0) if diffs else None,
            "evictions_gt_0": None if evicted is None else evicted > 0}


def workload_entry(runs: Sequence[ArmRun], arms: Sequence[str]) -> Dict[str, object]:
    """One workload's JSON: a row per arm and round, a pooled row per arm, the on/off ratios
    (pooled, and per round so drift shows)."""
    rounds = sorted({r.round for r in runs})
    per_round = [dict(arm_row(f"{run.arm} r{run.round}", [run]), arm_name=run.arm, round=run.round) for run in runs]
    pooled = {arm: arm_row(arm, [r for r in runs if r.arm == arm]) for arm in arms if any(r.arm == arm for r in runs)}
    by_round = {}
    for k in rounds:
        on = next((row for row in per_round if row["arm_name"] == ON and row["round"] == k), None)
        off = next((row for row in per_round if row["arm_name"] == OFF and row["round"] == k), None)
        by_round[str(k)] = on_off_ratios(on, off)
    return {"rows": per_round, "arms": pooled, "ratios": on_off_ratios(pooled.get(ON), pooled.get(OFF)),
            "ratios_by_round": by_round}


PREFIX_TABLE = (
    Column("arm", "arm"), Column("requests", "req", "d"), Column("failed", "failed", "d"),
    Column("output_tok_s", "out tok/s", ".1f"), Column("ttft_turn1_ms_p50", "TTFT 1st p50 ms", ".1f"),
    Column("ttft_turn1_ms_p99", "1st p99", ".1f"), Column("ttft_later_ms_p50", "later p50", ".1f"),
    Column("ttft_later_ms_p99", "later p99", ".1f"), Column("usage_hit_rate", "hit (usage)", ".3f"),
    Column("metrics_hit_rate", "hit (/metrics)", ".3f"), Column("metrics_evicted_tokens", "evicted", ".0f"),
)
DOC_TABLE = (
    Column("arm", "arm"), Column("requests", "req", "d"), Column("failed", "failed", "d"),
    Column("output_tok_s", "out tok/s", ".1f"), Column("ttft_ms_p50", "TTFT p50 ms", ".1f"),
    Column("ttft_ms_p99", "TTFT p99 ms", ".1f"), Column("usage_hit_rate", "hit (usage)", ".3f"),
    Column("metrics_hit_rate", "hit (/metrics)", ".3f"),
)
RESEND_TABLE = (
    Column("arm", "arm"), Column("requests", "req", "d"), Column("failed", "failed", "d"),
    Column("ttft_turn1_ms_median", "first send TTFT ms", ".1f"),
    Column("ttft_later_ms_median", "resend TTFT median ms", ".1f"), Column("ttft_later_ms_p99", "resend p99", ".1f"),
    Column("usage_hit_rate_later", "resend hit (usage)", ".3f"), Column("metrics_hit_rate", "hit (/metrics)", ".3f"),
)
WORKLOAD_TABLES = {"chat": PREFIX_TABLE, "doc": DOC_TABLE, "resend": RESEND_TABLE, "pressure": PREFIX_TABLE}


# --- the workloads ---------------------------------------------------------------------------------------------
SYSTEM_START, DOC_START, RESEND_START, WARM_START = 0, 2000, 4000, 6000  # where each text starts in GSM8K train
RESEND_SUFFIX_STRIDE = 37  # resend i's appended text starts at GSM8K test question 37 i: no two alike
DOC_QUESTION_START = 1000  # the doc questions: GSM8K test questions from here (the chat turns start at 0)
TEMPLATE_MARGIN = 16  # chat template tokens around one message, an upper bound (SmolLM2's: 5)


def server_token_count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=True))  # as the server's encode_prompt


@dataclass
class PrefixWorkloads:
    """What every arm is sent (the same for both arms and every round)."""

    system: str  # the multi-turn chats' (and the pressure chats') system prompt
    system_tokens: int
    chat_turns: List[List[str]]  # user messages per conversation
    doc: str
    doc_tokens: int
    doc_messages: List[str]  # one user message per question, the document first
    resend_first: str  # /v1/completions prompt text (the chat template around a long user turn)
    resend_first_tokens: int
    resend_prompts: List[str]  # resend_first's user turn with a different ~50-token text appended each
    resend_prompt_tokens: List[int]
    pressure_turns: List[List[str]]

    def summary(self) -> Dict[str, object]:
        return {"system_tokens": self.system_tokens, "conversations": len(self.chat_turns),
                "turns": len(self.chat_turns[0]) if self.chat_turns else 0, "doc_tokens": self.doc_tokens,
                "doc_questions": len(self.doc_messages), "resend_first_tokens": self.resend_first_tokens,
                "resend_prompt_tokens": self.resend_prompt_tokens,
                "pressure_conversations": len(self.pressure_turns),
                "pressure_turns": len(self.pressure_turns[0]) if self.pressure_turns else 0}


def resend_texts(tokenizer, texts: Sequence[str], questions: Sequence[str], resend_tokens: int, resend_times: int,
                 resend_new_tokens: int) -> Tuple[str, List[str]]:
    """(first, resends): a ``resend_tokens`` /v1/completions prompt text (the chat template around
    a long user turn of GSM8K train ``texts``), then ``resend_times`` copies of it whose user turn
    has ``resend_new_tokens`` different tokens (GSM8K test ``questions``) appended."""
    from lightllm.tools.prompts import chat_prompt_texts

    overhead = server_token_count(tokenizer, chat_prompt_texts(tokenizer, [""])[0])
    if resend_tokens <= overhead:
        raise ValueError(f"{resend_tokens} resend tokens cannot hold the chat template ({overhead} tokens)")
    base, _ = exact_length_text(tokenizer, resend_tokens - overhead, texts, RESEND_START)
    suffixes = [exact_length_text(tokenizer, resend_new_tokens, questions, RESEND_SUFFIX_STRIDE * i)[0]
                for i in range(resend_times)]
    first = chat_prompt_texts(tokenizer, [base])[0]
    resends = chat_prompt_texts(tokenizer, [f"{base}\n\n{s}" for s in suffixes]) if suffixes else []
    return first, resends


def build_prefix_workloads(tokenizer, texts: Sequence[str], questions: Sequence[str], system_tokens: int,
                           conversations: int, turns: int, doc_tokens: int, doc_questions: int, resend_tokens: int,
                           resend_times: int, resend_new_tokens: int, pressure_conversations: int,
                           pressure_turns: int) -> PrefixWorkloads:
    """The long texts (system prompt, document, resend prompt) are ``texts`` (GSM8K train) cut to
    their token counts, each from its own start; the user turns and the appended texts are
    ``questions`` (GSM8K test)."""
    system, n_system = exact_length_text(tokenizer, system_tokens, texts, SYSTEM_START)
    doc, n_doc = exact_length_text(tokenizer, doc_tokens, texts, DOC_START)
    doc_qs = [questions[(DOC_QUESTION_START + i) % len(questions)] for i in range(doc_questions)]
    first, resends = resend_texts(tokenizer, texts, questions, resend_tokens, resend_times, resend_new_tokens)
    return PrefixWorkloads(
        system=system, system_tokens=n_system, chat_turns=conversation_turns(questions, conversations, turns),
        doc=doc, doc_tokens=n_doc, doc_messages=[doc_question_message(doc, q) for q in doc_qs],
        resend_first=first, resend_first_tokens=server_token_count(tokenizer, first), resend_prompts=resends,
        resend_prompt_tokens=[server_token_count(tokenizer, t) for t in resends],
        pressure_turns=conversation_turns(questions, pressure_conversations, pressure_turns))


def conversation_max_len(tokenizer, system_tokens: int, turns: Sequence[Sequence[str]], new_tokens: int) -> int:
    """An upper bound of the prompt + new tokens of any turn of these conversations (a reply
    re-tokenized in the history is counted at most ``new_tokens`` + the template margin)."""
    def one(conv: Sequence[str]) -> int:
        return (system_tokens + TEMPLATE_MARGIN
                + sum(len(tokenizer.encode(q, add_special_tokens=False)) + new_tokens + 2 * TEMPLATE_MARGIN
                      for q in conv))
    return max((one(c) for c in turns), default=system_tokens + TEMPLATE_MARGIN)


def pressure_pool_tokens(running_max_req_size: int, max_req_total_len: int, mtp_step: int,
                         cap: Optional[int] = None, fraction: float = 0.1) -> int:
    """``fraction`` of the KV pool the server sizes by default for these flags when memory does
    not bound it (``running_max_req_size * (max_req_total_len + mtp_step)``, at most ``cap``: the
    CPU default), never below one full request (the server's own lower bound)."""
    default = running_max_req_size * (max_req_total_len + mtp_step)
    if cap is not None:
        default = min(default, cap)
    return max(int(fraction * default), max_req_total_len + mtp_step)
