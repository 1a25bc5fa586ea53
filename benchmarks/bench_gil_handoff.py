"""How long a reader thread waits for the GIL while an event loop's thread keeps it busy, at Python's
default switch interval (5 ms) and at the HTTP process's (``serving.HTTP_SWITCH_INTERVAL_S``).

This is the HTTP process's shape: a worker process puts a message on a multiprocessing queue every
``--step_ms``; a reader thread blocks in ``get()`` (the syscall releases the GIL) and, once the bytes
are there, needs the GIL back to unpickle them and hand them over, while the main thread runs pure
Python (the streams' work) and gives the GIL up only when the switch interval says so. The latency is
the put's timestamp to the reader's return, on one clock (``time.time()``). The arms are interleaved.

    python benchmarks/bench_gil_handoff.py --out gil_handoff.json
"""
import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from lightllm.server.httpserver.serving import HTTP_SWITCH_INTERVAL_S  # noqa: E402
from lightllm.tools.report import Column, render_table, write_json  # noqa: E402

PYTHON_DEFAULT_SWITCH_INTERVAL_S = 0.005
# Pure-Python additions the busy thread makes between looks at the reader (a few hundred microseconds)
BUSY_CHUNK = 20000
COLUMNS = [Column("switch_interval_ms", "switch ms", ".1f"), Column("round", "round"),
           Column("latency_ms_p50", "latency p50 ms", ".2f"), Column("latency_ms_p99", "p99 ms", ".2f"),
           Column("latency_ms_max", "max ms", ".2f"), Column("ratio_p99_vs_default", "p99 vs default", ".2f", "x")]


def _put_every(q, n: int, step_s: float) -> None:
    for _ in range(n):
        time.sleep(step_s)
        q.put(time.time())


def percentile(sorted_values: List[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure(switch_interval_s: float, messages: int, step_s: float) -> Dict[str, float]:
    """Hand-off latencies (ms) with the main thread busy in Python for the whole run."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        latencies: List[float] = []

        def read() -> None:
            for _ in range(messages):
                put_at = q.get()
                latencies.append(time.time() - put_at)

        proc = ctx.Process(target=_put_every, args=(q, messages, step_s), daemon=True)
        proc.start()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while reader.is_alive():  # the busy event loop
            x = 0
            for i in range(BUSY_CHUNK):
                x += i
        proc.join()
    finally:
        sys.setswitchinterval(previous)
    ms = sorted(1e3 * x for x in latencies)
    return {"latency_ms_p50": percentile(ms, 0.5), "latency_ms_p99": percentile(ms, 0.99), "latency_ms_max": ms[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=400, help="messages per arm and round")
    p.add_argument("--step_ms", type=float, default=2.0, help="time between the worker's puts")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    arms = (PYTHON_DEFAULT_SWITCH_INTERVAL_S, HTTP_SWITCH_INTERVAL_S)
    rows = []
    for r in range(1, args.rounds + 1):
        for interval in arms:
            rows.append({"switch_interval_ms": 1e3 * interval, "round": r,
                         **measure(interval, args.messages, args.step_ms / 1e3)})
    for row in rows:
        base = next(b for b in rows if b["round"] == row["round"]
                    and b["switch_interval_ms"] == 1e3 * PYTHON_DEFAULT_SWITCH_INTERVAL_S)
        row["ratio_p99_vs_default"] = row["latency_ms_p99"] / base["latency_ms_p99"]
    print(render_table(rows, COLUMNS))
    if args.out:
        write_json(args.out, {"args": vars(args), "cpu_count": os.cpu_count(), "rows": rows})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
