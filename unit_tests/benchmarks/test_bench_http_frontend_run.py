"""benchmarks/bench_http_frontend.py end to end on CPU (its HTTP process, the fake worker and the client), with
--httpserver_workers 2: every request comes back whole whichever process served it, and process 0's probe
still joins its own messages. No timing is checked."""
import importlib.util
import json
import os
import queue
import threading

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.manager import AddReq, WorkerReady

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_http_frontend",
                                               os.path.join(REPO, "benchmarks", "bench_http_frontend.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

REQUESTS = 24
NEW_TOKENS = 12


def test_fake_worker_sends_each_http_process_its_requests(tmp_path):
    cfg = bench.WorkerConfig(step_ms=1.0, tokens_per_step=1, token_ids=[3, 4, 5], running_max_req_size=64,
                             record_path=str(tmp_path / "worker.json"))
    in_q, qs = queue.Queue(), [queue.Queue(), queue.Queue()]
    th = threading.Thread(target=bench.fake_worker_main, args=(cfg, in_q, qs, False), daemon=True)
    th.start()
    assert isinstance(qs[0].get(timeout=10), WorkerReady) and qs[1].empty()
    for req_id in (2, 3, 4, 5):  # ids name their process: id % 2
        in_q.put(AddReq(req_id, [1, 2], SamplingParams(max_new_tokens=3), [0], 0.0))
    got = {0: set(), 1: set()}
    finished = set()
    while len(finished) < 4:
        for dest, q in enumerate(qs):
            try:
                updates, _ = q.get(timeout=0.1)
            except queue.Empty:
                continue
            for u in updates:
                got[dest].add(u.req_id)
                if u.finish_reason:
                    finished.add(u.req_id)
    in_q.put(None)
    th.join(10)
    assert got == {0: {2, 4}, 1: {3, 5}}
    with open(cfg.record_path) as f:
        assert {m[2] for m in json.load(f)["messages"]} == {0, 1}


def test_bench_runs_with_two_http_processes(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": f"Question {i}: how many apples are {i} plus {i}?",
                                        "answer": f"{2 * i}\n#### {2 * i}"}) + "\n" for i in range(40)))
    out = tmp_path / "front.json"
    bench.main(["--arms", "stream", "--httpserver_workers", "2", "--num_requests", str(REQUESTS), "--concurrency", "16",
                "--max_new_tokens", str(NEW_TOKENS), "--step_ms", "5", "--client_procs", "1", "--gsm8k", str(data),
                "--out", str(out), "--keep_tmp", str(tmp_path / "kept")])
    row = json.loads(out.read_text())["rows"][0]
    assert row["httpserver_workers"] == 2 and row["requests"] == REQUESTS
    assert row["output_tokens"] == REQUESTS * NEW_TOKENS and row["itl_ms_p50"] is not None
    (kept,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "kept") for f in files
               if f == "stream.worker.json"]
    with open(kept) as f:
        dests = [m[2] for m in json.load(f)["messages"] if m[1]]
    assert set(dests) == {0, 1}  # both processes had requests: the worker sent each its updates
