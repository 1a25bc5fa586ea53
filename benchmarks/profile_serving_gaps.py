"""Where a serving run's long inter-token gaps come from. bench_e2e_throughput's serving mix (GSM8K chats and
a share of 2k-4k-token prompts) is driven closed-loop through the router in this process, with the server's
own flags and no HTTP. Every ``router.step()`` call is recorded: its wall time, what the backend did, the
requests it admitted and finished, the steps it took back, and Python's garbage collections inside it. Each
request's gap between two token updates is then split over the calls it spans. The script prints the gaps'
p50 / p99 and, for the gaps at or above the p99, what their calls were (by kind, in ms per gap), and writes
JSON. On CUDA each step is also timed on the GPU (CUDA events around its forward and decode flow), so the
tail's time splits into GPU steps and the GPU idle between them (host work on the critical path), by the kind
of the call that launched the next step. The tail's calls also split by host phase (admission, reaping, waiting
for the GPU, commit, staging, launch, undo: HOST_PHASES), which says what the host did while the GPU idled.
What it leaves out: the HTTP process and the queue to it (the serving benchmark's router ITL has them).

    python benchmarks/profile_serving_gaps.py --gsm8k .data/test.jsonl \
        --server_args "--model_dir M --load_format dummy" --out gaps.json
"""
import argparse
import dataclasses
import gc
import json
import os
import shlex
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_e2e_throughput as serving  # noqa: E402

from lightllm.server.api_cli import make_argument_parser  # noqa: E402
from lightllm.server.core.objs.sampling_params import SamplingParams  # noqa: E402
from lightllm.server.core.objs.start_args_type import StartArgs  # noqa: E402
from lightllm.server.offline_engine import OfflineEngine  # noqa: E402
from lightllm.server.router.manager import AddReq  # noqa: E402
from lightllm.tools.client import auto_max_req_total_len, model_dir_or_embedded, server_flags  # noqa: E402
from lightllm.tools.prompts import load_gsm8k  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

TAIL_PERCENTILE = 99  # the gaps whose anatomy is printed: at or above this percentile
WARMUP_NEW_TOKENS = 8
TOP_SEQUENCES = 5  # the tail gaps' most common call sequences reported
# the backend's counters a call's kind is read from (ChunkedPrefillBackend; absent ones count 0)
COUNTERS = ("discarded_steps", "mixed_dropped", "mixed_undone", "mixed_staged", "mixed_ahead", "mixed_left",
            "decode_after_mixed")
# the schedule's counters the JSON reports for the measured wave: which steps ran ahead of a commit and which
# were taken back (a mixed step run from idle to its commit is what is left of the rows steps)
SCHEDULE_COUNTERS = COUNTERS + ("steps_ahead", "mixed_early", "mixed_kept_past_finish", "decode_early",
                                "decode_kept_past_finish", "successors_without_last", "left_idle")
CALL_KINDS = ("decode", "commit only", "commit, mixed launch", "mixed", "mixed launch", "prefill", "idle")
# A call's host time by phase: (owner, method) pairs timed by HostClock. "wait" is the host blocked on the GPU;
# the rest of a call is "other" (the router's and the schedule's own bookkeeping).
HOST_PHASES = {
    "admit": (("router", "_admit"),),
    "reap": (("router", "_reap_finished"),),
    "wait": (("decode_step", "wait"),),
    "commit": (("backend", "commit_decode"), ("backend", "commit_mixed")),
    "stage": (("backend", "stage_mixed"), ("decode_step", "prepare"), ("decode_step", "prepare_successor"),
              ("decode_step", "snapshot"), ("decode_step", "snapshot_reqs")),
    "launch": (("backend", "decode_forward"), ("backend", "launch_verify_draft"), ("backend", "launch_mixed")),
    "undo": (("backend", "_undo"), ("backend", "_undo_mixed"), ("backend", "drop_mixed")),
}
# Inside those phases, what each of these methods took (inclusive; phases are unchanged by them): where an
# admission, a finish or a staging spends its time. Keyed "owner.method".
HOST_DETAILS = (
    ("queue", "pop_admissible"), ("queue", "release"), ("prompt_cache", "match"), ("prompt_cache", "take_back"),
    ("backend", "add_reqs"), ("backend", "free_reqs"), ("backend", "_point_at_prefixes"),
    ("req_manager", "alloc"), ("params_manager", "init_reqs_sampling_params"),
    ("mem_manager", "alloc"), ("mem_manager", "free"), ("step_rows", "stage"), ("decode_step", "_stage"),
    ("decode_step", "launch_finish"), ("decode_step", "finish"),
)


@dataclass
class Call:
    """One router.step() call."""

    start: float
    end: float
    kind: str  # CALL_KINDS
    admitted: int = 0  # requests it moved into the running batch
    waiting: int = 0  # requests still queued when it ran its step, after its admission (the backend then
    # launches nothing ahead of a commit, unless --router_admit_behind_step)
    finished: int = 0  # requests whose last update it returned
    undone: int = 0  # steps launched ahead and taken back (a finish changed the batch)
    gc_ms: float = 0.0  # Python's garbage collections inside it
    gc_full: int = 0  # of those, full (generation 2) collections
    host_ms: Dict[str, float] = field(default_factory=dict)  # its wall time by HOST_PHASES (exclusive)
    host_detail_ms: Dict[str, float] = field(default_factory=dict)  # HOST_DETAILS' time in it (inclusive)

    @property
    def ms(self) -> float:
        return 1e3 * (self.end - self.start)


def call_kind(prefilled: bool, decode_reqs: int, steps: int, updates: int, launched_decode_reqs: int = 0,
              staged_mixed: bool = False) -> str:
    """What a call ran, from its StepResult: a mixed step committed (``mixed``) or only launched and left in
    flight (``mixed launch``), a prefill-only step, a decode step (run, or its successor launched), a decode
    step committed and the mixed step staged under it launched (``commit, mixed launch``), a call that only
    committed a step in flight (``commit only``), or nothing (``idle``)."""
    if prefilled:
        if decode_reqs:
            return "mixed"
        return "mixed launch" if steps == 0 and not updates else "prefill"
    if staged_mixed:
        return "commit, mixed launch"
    if steps == 0 and launched_decode_reqs:
        return "decode"
    if steps == 0 or not decode_reqs:
        return "commit only" if updates else "idle"
    return "decode"


Gap = Tuple[float, int, int]  # (ms, first call, last call)


def request_gaps(calls: Sequence[Call], token_calls: Dict[int, List[int]]) -> List[Gap]:
    """(ms, first call, last call) of each request's gap between consecutive calls that returned it tokens."""
    gaps: List[Gap] = []
    for idx in token_calls.values():
        gaps += [(1e3 * (calls[j].end - calls[i].end), i, j) for i, j in zip(idx, idx[1:])]
    return gaps


def tail_gaps(gaps: Sequence[Gap], percentile: float = TAIL_PERCENTILE) -> List[Gap]:
    """The gaps at or above ``percentile``."""
    if not gaps:
        return []
    cut = float(np.percentile([g[0] for g in gaps], percentile))
    return [g for g in gaps if g[0] >= cut]


def gap_anatomy(calls: Sequence[Call], token_calls: Dict[int, List[int]],
                percentile: float = TAIL_PERCENTILE) -> Dict[str, object]:
    """Each request's gaps between consecutive calls that returned it tokens (``token_calls``: request ->
    indexes into ``calls``), from one call's end to the other's; the gaps at or above ``percentile`` split
    over the calls after the first up to the second (time by kind, the loop's time between calls, and the
    most common sequences of call kinds)."""
    gaps = request_gaps(calls, token_calls)
    if not gaps:
        return {"gaps": 0}
    ms = np.array([g[0] for g in gaps])
    spans = np.array([j - i for _, i, j in gaps])
    cut = float(np.percentile(ms, percentile))
    tail = tail_gaps(gaps, percentile)
    by_kind = {k: 0.0 for k in CALL_KINDS}
    between = admitted = finished = undone = gc_ms = gc_full = waited = 0.0
    host: Dict[str, float] = {}
    detail: Dict[str, float] = {}
    for _, i, j in tail:
        for c in range(i + 1, j + 1):
            call = calls[c]
            by_kind[call.kind] += call.ms
            for phase, ms_ in call.host_ms.items():
                host[phase] = host.get(phase, 0.0) + ms_
            host["other"] = host.get("other", 0.0) + call.ms - sum(call.host_ms.values())
            for key, ms_ in call.host_detail_ms.items():
                detail[key] = detail.get(key, 0.0) + ms_
            between += 1e3 * (call.start - calls[c - 1].end)
            admitted += call.admitted
            waited += call.waiting > 0
            finished += call.finished
            undone += call.undone
            gc_ms += call.gc_ms
            gc_full += call.gc_full
    n = len(tail)
    sequences = Counter(" > ".join(calls[c].kind for c in range(i + 1, j + 1)) for _, i, j in tail)
    return {
        "gaps": len(gaps), "gap_ms_p50": float(np.percentile(ms, 50)), f"gap_ms_p{percentile}": cut,
        "calls_per_gap_p50": float(np.percentile(spans, 50)),
        f"calls_per_gap_p{percentile}": float(np.percentile(spans, percentile)),
        "tail_gaps": n, "tail_gap_ms_mean": float(np.mean([g[0] for g in tail])),
        "tail_calls_per_gap": float(np.mean([j - i for _, i, j in tail])),
        "tail_ms_by_kind": {k: v / n for k, v in by_kind.items() if v},
        # the same calls' wall time by host phase (HOST_PHASES; "other": the rest of each call)
        "tail_host_ms": {k: v / n for k, v in host.items() if v},
        # inside those phases, the listed methods' time (HOST_DETAILS, inclusive, so they may overlap)
        "tail_host_detail_ms": {k: v / n for k, v in sorted(detail.items(), key=lambda kv: -kv[1]) if v},
        "tail_ms_between_calls": between / n, "tail_gc_ms": gc_ms / n, "tail_gc_full": gc_full / n,
        "tail_admitted": admitted / n, "tail_finished": finished / n, "tail_undone": undone / n,
        # calls that ran their step with requests queued: per tail gap, and the share of all calls for comparison
        "tail_calls_waiting": waited / n,
        "calls_waiting_share": sum(c.waiting > 0 for c in calls) / len(calls),
        # the calls a tail gap spans, by kind in order: the most common sequences and their counts
        "tail_call_sequences": dict(sequences.most_common(TOP_SEQUENCES)),
    }


def host_cost_per_request(calls: Sequence[Call]) -> Dict[str, Optional[float]]:
    """Over the whole wave: the admission phase's ms per request admitted and the reaping phase's per request
    finished (what an A/B of those paths compares; None when the wave had none)."""
    def per(phase: str, count: float) -> Optional[float]:
        return sum(c.host_ms.get(phase, 0.0) for c in calls) / count if count else None

    admitted, finished = sum(c.admitted for c in calls), sum(c.finished for c in calls)
    detail: Dict[str, float] = {}
    for c in calls:
        for key, ms in c.host_detail_ms.items():
            detail[key] = detail.get(key, 0.0) + ms
    return {"admit_ms_per_request": per("admit", admitted), "reap_ms_per_request": per("reap", finished),
            "admitted": admitted, "finished": finished, "calls": len(calls),
            # the wave's HOST_DETAILS totals (ms): divide by the counts above for a cost per request or call
            "detail_ms": dict(sorted(detail.items(), key=lambda kv: -kv[1]))}


def call_table(calls: Sequence[Call]) -> List[Dict[str, object]]:
    """Count and wall ms (p50, p99, max) of the calls of each kind."""
    rows = []
    for kind in CALL_KINDS:
        ms = [c.ms for c in calls if c.kind == kind]
        if ms:
            rows.append({"kind": kind, "calls": len(ms), "ms_p50": float(np.percentile(ms, 50)),
                         "ms_p99": float(np.percentile(ms, 99)), "ms_max": max(ms)})
    return rows


CALL_TABLE = [Column("kind", "call", "s"), Column("calls", "calls", "d"), Column("ms_p50", "ms p50", ".2f"),
              Column("ms_p99", "ms p99", ".2f"), Column("ms_max", "max", ".2f")]


@dataclass
class GcClock:
    """Python's garbage collections, timed through gc.callbacks, summed until taken."""

    ms: float = 0.0
    full: int = 0
    all_ms: List[float] = field(default_factory=list)
    _t0: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        d = 1e3 * (time.perf_counter() - self._t0)
        self.ms += d
        self.all_ms.append(d)
        self.full += info.get("generation") == 2

    def take(self) -> Tuple[float, int]:
        out, self.ms, self.full = (self.ms, self.full), 0.0, 0
        return out


class HostClock:
    """A call's wall time by phase (HOST_PHASES): each listed method is wrapped with a timer; a phase's time
    excludes the phases nested in it (commit_mixed's wait is "wait"), and is summed until taken."""

    def __init__(self, owners: Dict[str, object], clock: Callable[[], float] = time.perf_counter):
        """``owners``: the objects HOST_PHASES names ("router", "backend", "decode_step"); absent methods are
        skipped."""
        self._clock = clock
        self.ms: Dict[str, float] = {}
        self.detail_ms: Dict[str, float] = {}  # HOST_DETAILS, inclusive
        self._stack: List[List[float]] = []  # [start, nested time] of each open phase
        for owner, name in HOST_DETAILS:  # wrapped first: a method in both is timed as a phase around its detail
            obj = owners.get(owner)
            if obj is not None and callable(getattr(obj, name, None)):
                self._wrap_detail(obj, name, f"{owner}.{name}")
        for phase, methods in HOST_PHASES.items():
            for owner, name in methods:
                obj = owners.get(owner)
                if obj is not None and callable(getattr(obj, name, None)):
                    self._wrap(obj, name, phase)

    def _wrap_detail(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            start = self._clock()
            try:
                return fn(*a, **kw)
            finally:
                self.detail_ms[key] = self.detail_ms.get(key, 0.0) + 1e3 * (self._clock() - start)

        setattr(obj, name, timed)

    def _wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            self._stack.append([self._clock(), 0.0])
            try:
                return fn(*a, **kw)
            finally:
                start, nested = self._stack.pop()
                spent = self._clock() - start
                self.ms[phase] = self.ms.get(phase, 0.0) + 1e3 * (spent - nested)
                if self._stack:
                    self._stack[-1][1] += spent

        setattr(obj, name, timed)

    def take(self) -> Dict[str, float]:
        out, self.ms = self.ms, {}
        return out

    def take_details(self) -> Dict[str, float]:
        out, self.detail_ms = self.detail_ms, {}
        return out


@dataclass
class StepSpan:
    """One step on the GPU, on the host's clock (s): from its forward's first kernel to the end of its decode flow,
    and the call (index into the run's calls) that launched it."""

    call: int
    kind: str  # STEP_KINDS
    start: float
    end: float


STEP_KINDS = ("decode", "rows")  # a decode-only step; a step over the rows layout (mixed, or prefill as rows)


def gpu_timeline(spans: Sequence[StepSpan], calls: Sequence[Call],
                 windows: Sequence[Tuple[float, float]] = ()) -> Dict[str, object]:
    """The GPU's time by step kind and its idle time between steps (the next step not yet launched: host work
    on the critical path), the idle filed under the kind of the call that launched the next step. ``windows``:
    (start, end) host times (the tail gaps), each split into GPU step time and idle."""
    spans = sorted(spans, key=lambda s: s.start)
    idle = [(a.end, b.start, calls[b.call].kind) for a, b in zip(spans, spans[1:]) if b.start > a.end]
    step_ms = {k: [1e3 * (s.end - s.start) for s in spans if s.kind == k] for k in STEP_KINDS}
    by_kind: Dict[str, float] = {}
    for a, b, kind in idle:
        by_kind[kind] = by_kind.get(kind, 0.0) + 1e3 * (b - a)
    out: Dict[str, object] = {
        "steps": len(spans),
        "busy_ms": sum(1e3 * (s.end - s.start) for s in spans),
        "idle_ms": sum(by_kind.values()),
        "idle_ms_by_launching_call": by_kind,
        "step_ms": {k: {"steps": len(v), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
                    for k, v in step_ms.items() if v},
    }
    if windows:
        def overlap(a: float, b: float, lo: float, hi: float) -> float:
            return max(0.0, min(b, hi) - max(a, lo))

        n = len(windows)
        out["tail_idle_ms"] = sum(1e3 * overlap(a, b, lo, hi) for lo, hi in windows for a, b, _ in idle) / n
        out["tail_step_ms"] = {k: sum(1e3 * overlap(s.start, s.end, lo, hi) for lo, hi in windows
                                      for s in spans if s.kind == k) / n for k in STEP_KINDS}
    return out


class GpuClock:
    """CUDA events around every step the backend launches: one before its forward (``DecodeStep.forward``, or
    ``StepRows.forward_rows`` for the rows layout), one after its decode flow is queued
    (``DecodeStep.launch_finish``; a prefill step, which waits inside, at the end of its call). The events are
    placed on the host's clock by one event recorded at a synchronized start."""

    def __init__(self, backend, event: Optional[Callable[[], object]] = None,
                 synchronize: Optional[Callable[[], None]] = None):
        """``event``, ``synchronize``: CUDA's by default (``torch.cuda.Event(enable_timing=True)``)."""
        import torch

        self._new_event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._sync = synchronize or torch.cuda.synchronize
        self.call = 0  # the call under way (set by the driver)
        self._open: Optional[Tuple[int, str, object]] = None
        self._events: List[Tuple[int, str, object, object]] = []
        ds = backend.decode_step
        self._wrap(ds, "forward", before="decode")
        self._wrap(ds, "launch_finish", after=True)
        for rows in {id(r): r for r in (backend.step_rows, getattr(backend, "mixed_rows", None)) if r}.values():
            self._wrap(rows, "forward_rows", before="rows")
        self._sync()
        self._origin = self._event()
        self._sync()
        self._origin_s = time.perf_counter()

    def _event(self):
        ev = self._new_event()
        ev.record()
        return ev

    def _wrap(self, obj, name: str, before: Optional[str] = None, after: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            if before and self._open is None:
                self._open = (self.call, before, self._event())
            out = fn(*a, **kw)
            if after:
                self.close()
            return out

        setattr(obj, name, wrapped)

    def close(self) -> None:
        """The step opened last ends here (its decode flow queued, or its call over)."""
        if self._open is not None:
            self._events.append((*self._open, self._event()))
            self._open = None

    def spans(self) -> List[StepSpan]:
        self._sync()
        at = lambda ev: self._origin_s + 1e-3 * self._origin.elapsed_time(ev)  # noqa: E731
        return [StepSpan(call, kind, at(a), at(b)) for call, kind, a, b in self._events]


def start_args(flags: Sequence[str], concurrency: int, max_req_total_len: int) -> StartArgs:
    """The server's flags as StartArgs, with the serving benchmark's concurrency and length (flags win)."""
    base = server_flags(running_max_req_size=concurrency, max_req_total_len=max_req_total_len)
    ns = make_argument_parser().parse_args(base + list(flags))
    names = {f.name for f in dataclasses.fields(StartArgs)}
    return StartArgs(**{k: v for k, v in vars(ns).items() if k in names})


def host_owners(eng: OfflineEngine) -> Dict[str, object]:
    """The objects HOST_PHASES and HOST_DETAILS name, by owner (None where the engine has none)."""
    backend = eng.backend
    return {"router": eng.router, "backend": backend, "decode_step": backend.decode_step,
            "queue": eng.router.queue, "prompt_cache": backend.prompt_cache, "mem_manager": backend.mem_manager,
            "req_manager": backend.req_manager, "params_manager": backend.params_manager,
            "step_rows": getattr(backend, "mixed_rows", None) or backend.step_rows}


def drive(eng: OfflineEngine, prompts: List[List[int]], params: List[SamplingParams], concurrency: int,
          gpu: Optional[GpuClock] = None, host: Optional[HostClock] = None
          ) -> Tuple[List[Call], Dict[int, List[int]], GcClock]:
    """Closed loop: ``concurrency`` requests in the router at a time, the next one added when one finishes.
    ``gpu``: the steps' GPU clock, told each call's index; ``host``: the calls' host phases."""
    router, b = eng.router, eng.backend
    eos = eng.eos_token_ids()
    budget = eng.args.mtp_asd_regret_budget
    pending = deque(range(len(prompts)))
    open_reqs: set = set()
    calls: List[Call] = []
    token_calls: Dict[int, List[int]] = {}
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        while pending or router.has_work:
            while pending and len(open_reqs) < concurrency:
                i = pending.popleft()
                router.add_req(AddReq(i, prompts[i], params[i], eos, params[i].asd_budget(budget)))
                open_reqs.add(i)
            waiting = len(router.queue.waiting)
            before = [getattr(b, k, 0) for k in COUNTERS]
            clock.take()
            if host is not None:
                host.take()
                host.take_details()
            if gpu is not None:
                gpu.call = len(calls)
            t0 = time.perf_counter()
            updates = router.step()
            if gpu is not None:
                gpu.close()  # a step that did not queue its decode flow apart (prefill) ends with its call
            t1 = time.perf_counter()
            gc_ms, gc_full = clock.take()
            delta = dict(zip(COUNTERS, (getattr(b, k, 0) - v for k, v in zip(COUNTERS, before))))
            r = router.last_result
            kind = "idle" if r is None else call_kind(r.prefilled, r.decode_reqs, r.steps, len(updates),
                                                      r.launched_decode_reqs, delta["mixed_staged"] > 0)
            router.last_result = None
            finished = 0
            for u in updates:
                if u.token_ids:
                    token_calls.setdefault(u.req_id, []).append(len(calls))
                if u.finish_reason is not None:
                    finished += 1
                    open_reqs.discard(u.req_id)
            undone = delta["discarded_steps"] + delta["mixed_dropped"] + delta["mixed_undone"]
            calls.append(Call(t0, t1, kind, admitted=waiting - len(router.queue.waiting),
                              waiting=len(router.queue.waiting), finished=finished, undone=undone, gc_ms=gc_ms,
                              gc_full=gc_full, host_ms=host.take() if host is not None else {},
                              host_detail_ms=host.take_details() if host is not None else {}))
    finally:
        gc.callbacks.remove(clock)
    return calls, token_calls, clock


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm8k", required=True,
                   help="GSM8K test JSONL (the short prompts; the long ones are built from it)")
    p.add_argument("--num_prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--long_fraction", type=float, default=0.2)
    p.add_argument("--long_lens", type=int, nargs=2, default=[2000, 4000])
    p.add_argument("--long_new_tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server_args", default="", help="the server's flags (as bench_e2e_throughput's --server_args)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    flags = shlex.split(args.server_args)
    probe = start_args(flags, args.concurrency, 4096)
    model_dir = model_dir_or_embedded(probe.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = [q.question for q in load_gsm8k(args.gsm8k)]
    workload = serving.build_serving_workload(tok, questions, args.num_prompts, args.long_fraction, args.long_lens,
                                              args.max_new_tokens, args.long_new_tokens, args.seed)
    prompts = [tok.encode(r.text, add_special_tokens=True) for r in workload]  # as the server encodes them
    max_len = auto_max_req_total_len([len(x) + r.max_new_tokens for x, r in zip(prompts, workload)], 0)
    on_gpu = torch.cuda.is_available()
    eng = OfflineEngine(start_args(flags + ["--model_dir", model_dir], args.concurrency, max_len),
                        device="cuda" if on_gpu else "cpu", dtype="bfloat16" if on_gpu else "float32")
    warm = prompts[:args.concurrency]  # the mix's first requests: the long prompts' kernels too
    drive(eng, warm, [SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS)] * len(warm), args.concurrency)
    params = [SamplingParams(max_new_tokens=r.max_new_tokens) for r in workload]
    gpu = GpuClock(eng.backend) if on_gpu else None
    counters = {k: getattr(eng.backend, k, 0) for k in SCHEDULE_COUNTERS}
    host = HostClock(host_owners(eng))
    t0 = time.perf_counter()
    calls, token_calls, clock = drive(eng, prompts, params, args.concurrency, gpu, host)
    wall = time.perf_counter() - t0
    counters = {k: getattr(eng.backend, k, 0) - v for k, v in counters.items()}
    anatomy = gap_anatomy(calls, token_calls)
    timeline = None
    if gpu is not None:
        windows = [(calls[i].end, calls[j].end) for _, i, j in tail_gaps(request_gaps(calls, token_calls))]
        timeline = gpu_timeline(gpu.spans(), calls, windows)
    table = call_table(calls)
    print(render_table(table, CALL_TABLE))
    print(f"{len(prompts)} requests in {wall:.2f}s; gaps p50 {anatomy.get('gap_ms_p50', 0):.2f} ms, "
          f"p{TAIL_PERCENTILE} {anatomy.get(f'gap_ms_p{TAIL_PERCENTILE}', 0):.2f} ms; GC {sum(clock.all_ms):.1f} ms in "
          f"{len(clock.all_ms)} collections (max {max(clock.all_ms, default=0):.2f} ms)")
    print("gaps at or above the p99, per gap:", json.dumps({k: v for k, v in anatomy.items() if k.startswith("tail")},
                                                          indent=1))
    print("schedule counters of the wave:", json.dumps(counters))
    per_request = host_cost_per_request(calls)
    print("host ms per request of the wave:", json.dumps(per_request))
    if timeline is not None:
        print("GPU steps and idle (ms):", json.dumps(timeline, indent=1))
    result = {"commit": serving._git_commit(), "args": vars(args), "device": "cuda" if on_gpu else "cpu",
              "wall_s": wall, "calls": table, "gpu": timeline,
              "gaps": anatomy, "schedule": counters, "host_per_request": per_request,
              "gc": {"collections": len(clock.all_ms), "ms_total": sum(clock.all_ms),
                     "ms_max": max(clock.all_ms, default=0.0)}}
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
