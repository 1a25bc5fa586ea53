"""benchmarks/profile_serving_gaps.py: the gap anatomy by hand, and a CPU run of the script on a tiny
model of the embedded model's vocabulary (its tokenizer, random weights)."""
import json
import os
import shutil
import sys
import time
import types

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import profile_serving_gaps as gaps  # noqa: E402
from profile_serving_gaps import Call  # noqa: E402


def test_call_kind_reads_the_step_result():
    assert gaps.call_kind(prefilled=True, decode_reqs=5, steps=1, updates=6) == "mixed"
    assert gaps.call_kind(prefilled=True, decode_reqs=0, steps=0, updates=0) == "mixed launch"
    assert gaps.call_kind(prefilled=True, decode_reqs=0, steps=1, updates=2) == "prefill"
    assert gaps.call_kind(prefilled=False, decode_reqs=4, steps=1, updates=4) == "decode"
    assert gaps.call_kind(prefilled=False, decode_reqs=4, steps=0, updates=4) == "commit only"
    assert gaps.call_kind(prefilled=False, decode_reqs=0, steps=1, updates=0) == "idle"
    # a decode step committed and the next launched without the requests it finished
    assert gaps.call_kind(prefilled=False, decode_reqs=4, steps=0, updates=4, launched_decode_reqs=3) == "decode"
    assert gaps.call_kind(prefilled=False, decode_reqs=4, steps=0, updates=4, staged_mixed=True) == \
        "commit, mixed launch"


def test_gap_anatomy_by_hand():
    # calls end at 10, 12, 14, 30, 32 ms; each starts 0.5 ms after the one before ended (the first at 9)
    ends = [10, 12, 14, 30, 32]
    kinds = ["decode", "decode", "mixed launch", "mixed", "decode"]
    calls = [Call(start=(e - (e - p - 0.5)) / 1e3 if i else 0.009, end=e / 1e3, kind=k)
             for i, (p, e, k) in enumerate(zip([0] + ends, ends, kinds))]
    calls[3].gc_ms, calls[3].gc_full, calls[3].admitted, calls[2].undone = 4.0, 1, 2, 1
    calls[3].waiting = calls[0].waiting = 2  # one call of the tail gap and one outside it stepped with a queue
    # request 0 gets tokens at calls 0, 1, 3, 4: gaps 2, 18, 2 ms; request 1 at 1 and 4: 20 ms
    token_calls = {0: [0, 1, 3, 4], 1: [1, 4]}
    a = gaps.gap_anatomy(calls, token_calls, percentile=75)
    assert a["gaps"] == 4 and a["gap_ms_p50"] == pytest.approx(10.0)  # 2, 2, 18, 20
    assert a["gap_ms_p75"] == pytest.approx(18.5)
    # the tail is request 1's 20 ms gap: calls 2, 3, 4
    assert a["tail_gaps"] == 1 and a["tail_gap_ms_mean"] == pytest.approx(20.0) and a["tail_calls_per_gap"] == 3
    # call c spans (ends[c-1] + 0.5, ends[c]): mixed launch 1.5 ms, mixed 15.5, decode 1.5; 0.5 between each
    assert a["tail_ms_by_kind"] == pytest.approx({"mixed launch": 1.5, "mixed": 15.5, "decode": 1.5})
    assert a["tail_ms_between_calls"] == pytest.approx(1.5)
    assert (a["tail_gc_ms"], a["tail_gc_full"], a["tail_admitted"], a["tail_undone"]) == (4.0, 1, 2, 1)
    assert a["tail_call_sequences"] == {"mixed launch > mixed > decode": 1}
    assert a["tail_calls_waiting"] == 1 and a["calls_waiting_share"] == pytest.approx(2 / 5)
    assert gaps.gap_anatomy(calls, {0: [2]}) == {"gaps": 0}


def test_gpu_timeline_by_hand():
    kinds = ["decode", "decode", "mixed launch", "mixed"]
    calls = [Call(start=0.0, end=0.0, kind=k) for k in kinds]
    spans = [gaps.StepSpan(0, "decode", 0.000, 0.002), gaps.StepSpan(1, "decode", 0.002, 0.004),
             gaps.StepSpan(2, "rows", 0.007, 0.012), gaps.StepSpan(3, "decode", 0.0125, 0.0145)]
    t = gaps.gpu_timeline(spans[::-1], calls, windows=[(0.003, 0.013)])  # any order: sorted by start
    assert t["steps"] == 4 and t["busy_ms"] == pytest.approx(11.0)
    # idle 4 -> 7 ms before the step call 2 launched, 12 -> 12.5 before call 3's
    assert t["idle_ms"] == pytest.approx(3.5)
    assert t["idle_ms_by_launching_call"] == pytest.approx({"mixed launch": 3.0, "mixed": 0.5})
    assert t["step_ms"]["decode"]["steps"] == 3 and t["step_ms"]["decode"]["p50"] == pytest.approx(2.0)
    assert t["step_ms"]["rows"]["p99"] == pytest.approx(5.0)
    # the window 3 -> 13 ms: decode 3-4 and 12.5-13, rows 7-12, idle 4-7 and 12-12.5
    assert t["tail_idle_ms"] == pytest.approx(3.5)
    assert t["tail_step_ms"] == pytest.approx({"decode": 1.5, "rows": 5.0})


class _HostEvent:
    """A CUDA event's stand-in: the host's clock when recorded."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return 1e3 * (other.t - self.t)


def test_gpu_clock_opens_a_step_at_its_forward_and_closes_it_after_the_decode_flow():
    class Stub:
        def forward(self, *a):
            return "out"

        def launch_finish(self, *a):
            return "pending"

        def forward_rows(self, *a):
            return "rows out"

    rows = Stub()
    backend = types.SimpleNamespace(decode_step=Stub(), step_rows=rows, mixed_rows=rows)
    clock = gaps.GpuClock(backend, event=_HostEvent, synchronize=lambda: None)
    ds = backend.decode_step
    clock.call = 0
    assert ds.forward() == "out" and ds.launch_finish() == "pending"  # a decode step
    clock.close()
    clock.call = 1
    rows.forward_rows(), rows.forward_rows()  # a prefill as rows: one step, ended by its call
    clock.close()
    clock.call = 2
    rows.forward_rows(), ds.launch_finish()  # a mixed step (the rows wrapped once: mixed_rows is step_rows)
    clock.close()
    spans = clock.spans()
    assert [(s.call, s.kind) for s in spans] == [(0, "decode"), (1, "rows"), (2, "rows")]
    assert all(a.start <= a.end <= b.start for a, b in zip(spans, spans[1:]))


def test_gc_clock_times_collections():
    import gc

    clock = gaps.GcClock()
    gc.callbacks.append(clock)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
    ms, full = clock.take()
    assert full == 1 and ms > 0 and clock.take() == (0.0, 0)


def test_cpu_run_writes_the_anatomy(tmp_path):
    from lightllm.utils.embedded_model import get_default_model_dir

    src = get_default_model_dir()
    model = tmp_path / "tiny"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), model / name)
    config = json.load(open(os.path.join(src, "config.json")))
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    (model / "config.json").write_text(json.dumps(config))
    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} plus {i + 1}?", "answer": "#### 1"}) + "\n"
                             for i in range(20)))
    out = tmp_path / "gaps.json"
    assert gaps.main(["--gsm8k", str(gsm8k), "--num_prompts", "12", "--concurrency", "4", "--max_new_tokens", "6",
                      "--long_lens", "120", "200", "--long_new_tokens", "4", "--out", str(out),
                      "--server_args", f"--model_dir {model} --load_format dummy --batch_max_tokens 64"]) == 0
    result = json.loads(out.read_text())
    # 12 requests, round(0.2 * 12) = 2 long: 10 of 6 tokens and 2 of 4, one gap between two of a request's
    # consecutive token updates (plain decoding: a token each)
    assert result["gaps"]["gaps"] == 10 * 5 + 2 * 3
    kinds = {row["kind"] for row in result["calls"]}
    assert {"decode", "mixed"} <= kinds and result["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # the tail's calls by host phase: the engine's own methods were timed (a renamed one would drop out)
    assert {"wait", "commit", "launch", "other"} <= set(result["gaps"]["tail_host_ms"])
    # the admission's, reaping's and staging's methods were timed inside those phases
    detail = result["host_per_request"]["detail_ms"]
    assert {"backend.add_reqs", "backend.free_reqs", "mem_manager.alloc", "queue.pop_admissible"} <= set(detail)
    # the schedule's counters over the measured wave (a renamed backend attribute would read 0 everywhere)
    assert set(result["schedule"]) == set(gaps.SCHEDULE_COUNTERS) and result["schedule"]["steps_ahead"] > 0


def test_host_details_name_methods_the_engine_has():
    # a renamed method would silently time nothing: each HOST_DETAILS entry exists on its owner's class
    from lightllm.common.kv_cache_mem_manager import MemoryManager
    from lightllm.common.req_manager import ReqManager, ReqSamplingParamsManager
    from lightllm.server.router.manager import RouterManager
    from lightllm.server.router.model_infer.decode_step import DecodeStep
    from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend
    from lightllm.server.router.model_infer.prompt_cache import PromptCache
    from lightllm.server.router.model_infer.step_rows import StepRows
    from lightllm.server.router.req_queue import ReqQueue

    classes = {"router": RouterManager, "backend": ChunkedPrefillBackend, "decode_step": DecodeStep,
               "queue": ReqQueue, "prompt_cache": PromptCache, "mem_manager": MemoryManager,
               "req_manager": ReqManager, "params_manager": ReqSamplingParamsManager, "step_rows": StepRows}
    named = list(gaps.HOST_DETAILS) + [m for methods in gaps.HOST_PHASES.values() for m in methods]
    assert [f"{o}.{m}" for o, m in named if not callable(getattr(classes[o], m, None))] == []


def _manual_clock():
    """A clock for HostClock (seconds) and the tick that advances it by ms."""
    now = [0.0]

    def tick(ms: float) -> None:
        now[0] += ms / 1e3

    return (lambda: now[0]), tick


def test_host_clock_splits_a_call_by_phase_exclusive_of_nested_phases():
    now, tick = _manual_clock()

    class DecodeStep:
        def wait(self, pending):
            tick(3.0)
            return "host"

    class Backend:
        def __init__(self, ds):
            self.decode_step = ds

        def commit_mixed(self, step):  # 1 ms of its own around a 3 ms wait
            tick(0.5)
            host = self.decode_step.wait(step)
            tick(0.5)
            return host

    class Router:
        def _admit(self):
            tick(2.0)
            return []

    ds = DecodeStep()
    backend, router = Backend(ds), Router()
    clock = gaps.HostClock({"router": router, "backend": backend, "decode_step": ds}, clock=now)
    assert router._admit() == [] and backend.commit_mixed("step") == "host"
    assert clock.take() == pytest.approx({"admit": 2.0, "commit": 1.0, "wait": 3.0})
    assert clock.take() == {}
    # a phase's method that raises is still timed, and the stack stays balanced
    def boom(step):
        tick(4.0)
        raise RuntimeError("x")
    ds.wait = boom
    clock._wrap(ds, "wait", "wait")
    with pytest.raises(RuntimeError):
        backend.commit_mixed("step")
    assert clock.take() == pytest.approx({"commit": 0.5, "wait": 4.0}) and clock._stack == []


def test_gap_anatomy_splits_the_tail_by_host_phase():
    # request 0's tokens at calls 0 and 2 (a 10 ms gap, the tail), request 1's at 0 and 1 (2 ms)
    calls = [Call(0.000, 0.001, "decode"), Call(0.001, 0.003, "decode", host_ms={"wait": 1.5}),
             Call(0.003, 0.011, "mixed", host_ms={"admit": 2.0, "wait": 1.0, "commit": 3.0})]
    a = gaps.gap_anatomy(calls, {0: [0, 2], 1: [0, 1]}, percentile=75)
    assert a["tail_gaps"] == 1
    # calls 1 and 2: wait 2.5, admit 2, commit 3; the rest of their 2 + 8 ms is other: 10 - 7.5
    assert a["tail_host_ms"] == pytest.approx({"wait": 2.5, "admit": 2.0, "commit": 3.0, "other": 2.5})


def test_host_cost_per_request_by_hand():
    calls = [Call(0.0, 0.001, "decode", admitted=2, host_ms={"admit": 0.5}),
             Call(0.001, 0.002, "decode", admitted=1, finished=4, host_ms={"admit": 0.4, "reap": 1.0}),
             Call(0.002, 0.003, "decode", host_ms={"reap": 0.2})]
    calls[0].host_detail_ms = {"backend.add_reqs": 0.4}
    calls[1].host_detail_ms = {"backend.add_reqs": 0.3, "backend.free_reqs": 0.9}
    out = gaps.host_cost_per_request(calls)
    assert out.pop("detail_ms") == pytest.approx({"backend.add_reqs": 0.7, "backend.free_reqs": 0.9})
    assert out == pytest.approx({"admit_ms_per_request": 0.3, "reap_ms_per_request": 0.3, "admitted": 3,
                                 "finished": 4, "calls": 3})
    assert gaps.host_cost_per_request(calls[2:]) == {"admit_ms_per_request": None, "reap_ms_per_request": None,
                                                     "admitted": 0, "finished": 0, "calls": 1, "detail_ms": {}}


def test_host_details_are_inclusive_and_leave_the_phases_alone():
    now, tick = _manual_clock()

    class Mem:
        def alloc(self, n):
            tick(0.25)
            return n

    class Backend:
        def __init__(self, mem):
            self.mem_manager = mem

        def stage_mixed(self, n):  # a phase (stage) holding a detail (mem_manager.alloc)
            tick(1.0)
            return self.mem_manager.alloc(n)

        def free_reqs(self, reqs):  # a detail outside any phase
            tick(2.0)

    mem = Mem()
    backend = Backend(mem)
    clock = gaps.HostClock({"backend": backend, "mem_manager": mem}, clock=now)
    assert backend.stage_mixed(3) == 3
    backend.free_reqs([])
    mem.alloc(1)
    assert clock.take() == pytest.approx({"stage": 1.25})
    assert clock.take_details() == pytest.approx({"mem_manager.alloc": 0.5, "backend.free_reqs": 2.0})
    assert clock.take_details() == {}


def test_gap_anatomy_sums_the_tail_calls_details():
    calls = [Call(0.000, 0.001, "decode"), Call(0.001, 0.003, "decode", host_detail_ms={"mem_manager.alloc": 0.5}),
             Call(0.003, 0.011, "mixed", host_detail_ms={"mem_manager.alloc": 0.25, "backend.add_reqs": 2.0})]
    a = gaps.gap_anatomy(calls, {0: [0, 2], 1: [0, 1]}, percentile=75)
    assert a["tail_host_detail_ms"] == pytest.approx({"backend.add_reqs": 2.0, "mem_manager.alloc": 0.75})
    assert list(a["tail_host_detail_ms"]) == ["backend.add_reqs", "mem_manager.alloc"]  # largest first
