"""Issue 13, item 5: worker processes end when the process that started them dies.

SIGKILL of the API server under load used to leave the worker decoding, then hanging for
ever in its queue feeder's exit join. Each test starts a parent process (a stand-in for the
API server) that starts a child, SIGKILLs the parent, and expects the child gone within
CHILD_EXIT_TIMEOUT_S.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from lightllm.server.router.manager import PARENT_CHECK_INTERVAL_S, start_parent_watchdog
from unit_tests.data_paths import REPO_ROOT
from unit_tests.models.tiny_checkpoints import tiny_model
from unit_tests.server.process_util import process_gone

CHILD_EXIT_TIMEOUT_S = 5.0
PARENT_READY_TIMEOUT_S = 120.0  # the parent imports torch and starts its child

# The API server's part: start_worker on a tiny model, keep it decoding (8 long requests),
# never read its updates (the queue's pipe fills up, as under a slow reader), report the
# worker's pid, and wait to be killed.
SERVER_UNDER_LOAD = """
import sys, time
from lightllm.server.api_start import start_worker, validate_start_args
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq

args = validate_start_args(StartArgs(model_dir=sys.argv[1], max_req_total_len=250, running_max_req_size=8,
                                     max_total_token_num=2100))
workers, in_q, out_q, ready = start_worker(args, "cpu", "float32")
params = SamplingParams.from_request({"max_new_tokens": 240, "ignore_eos": True})
for i in range(8):
    in_q.put(AddReq(i, [1 + i, 2, 3], params, [], 0.0))
out_q.get()  # the worker is stepping
print(workers.procs[0].pid, flush=True)
time.sleep(600)
"""

# The API server's exit after its worker died: requests it sent fill the dead worker's pipe;
# exiting must not wait for them to be flushed.
SERVER_EXIT_AFTER_WORKER_DIED = """
import os, signal, sys
from lightllm.server.api_start import start_worker, validate_start_args
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.manager import AddReq

args = validate_start_args(StartArgs(model_dir=sys.argv[1], max_req_total_len=250, max_total_token_num=500))
workers, in_q, out_q, ready = start_worker(args, "cpu", "float32")
os.kill(workers.procs[0].pid, signal.SIGKILL)
workers.join(timeout=10)
params = SamplingParams.from_request({"max_new_tokens": 1})
for i in range(64):  # about 3 MB: far more than a pipe holds
    in_q.put(AddReq(i, list(range(12000)), params, [], 0.0))
print("exiting", flush=True)
"""
SERVER_EXIT_TIMEOUT_S = 60.0  # start-up included

# A child that only runs the watchdog (no parent-death signal), busy in Python like a step.
WATCHDOG_CHILD = """
import os, time
from lightllm.server.router.manager import exit_orphan, start_parent_watchdog

ppid = os.getppid()
start_parent_watchdog(lambda: os.getppid() == ppid, exit_orphan)
print(os.getpid(), flush=True)
while True:
    sum(range(10000))
"""
WATCHDOG_PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(600)
"""


def _kill_parent_and_wait_for(parent: subprocess.Popen, child_pid: int) -> Optional[float]:
    """SIGKILL ``parent``; seconds until ``child_pid`` is gone (None: still there after the timeout)."""
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    t0 = time.monotonic()
    while time.monotonic() - t0 < CHILD_EXIT_TIMEOUT_S:
        if process_gone(child_pid):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _read_pid(proc: subprocess.Popen) -> int:
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(PARENT_READY_TIMEOUT_S)
    assert line and line[0].strip(), f"parent did not start its child (exit code {proc.poll()})"
    return int(line[0])


def _run_and_kill(argv) -> Optional[float]:
    parent = subprocess.Popen([sys.executable, "-c", *argv], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = _read_pid(parent)
        time.sleep(2 * PARENT_CHECK_INTERVAL_S)  # the child is busy
        return _kill_parent_and_wait_for(parent, child_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None and not process_gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_worker_exits_when_the_api_server_is_killed_under_load(tmp_path):
    model_dir = tiny_model("llama", root=tmp_path, seed=1).model_dir
    waited = _run_and_kill([SERVER_UNDER_LOAD, model_dir])
    assert waited is not None, f"the worker outlived its server by more than {CHILD_EXIT_TIMEOUT_S} s"


def test_server_exit_does_not_hang_on_a_dead_worker_pipe(tmp_path):
    model_dir = tiny_model("llama", root=tmp_path, seed=1).model_dir
    proc = subprocess.Popen([sys.executable, "-c", SERVER_EXIT_AFTER_WORKER_DIED, model_dir], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=SERVER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert "exiting" in out and proc.returncode == 0, f"exit code {proc.returncode}"


def test_watchdog_ends_a_busy_child_whose_parent_died():
    """Where no parent-death signal exists (not Linux), the watchdog alone must do it."""
    waited = _run_and_kill([WATCHDOG_PARENT, WATCHDOG_CHILD])
    assert waited is not None and waited < CHILD_EXIT_TIMEOUT_S


def test_watchdog_reports_a_dead_parent_promptly():
    alive = threading.Event()
    alive.set()
    died = threading.Event()
    start_parent_watchdog(alive.is_set, died.set, interval_s=0.01)
    assert not died.wait(0.1)
    alive.clear()
    assert died.wait(1.0)
