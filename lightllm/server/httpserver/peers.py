"""The other HTTP server processes of ``--httpserver_workers N`` (LightLLM's flag).

Process 0 (the API server, which started the model worker) starts processes 1..N-1 once the worker
is ready. Each listens on the port with a socket of its own (SO_REUSEPORT: the kernel spreads new
connections evenly over them); they share the
worker's request queue, and each reads its own update queue (``messages.first_request_id``,
``updates_by_http_worker``). Each parses, tokenizes, detokenizes and streams its own requests, so a
busy server's streams are spread over N event loops.

Lifetime:
- start-up: processes 1..N-1 build their apps while process 0 builds its own, and serve once it does
  (``release``), so a shutdown signal never reaches process 0 before it handles one;
- shutdown: process 0 passes each SIGTERM / SIGINT it receives on as PEER_SHUTDOWN_SIGNAL (the
  others ignore SIGTERM and SIGINT, so a signal sent to the whole process group counts once); each
  process shuts down as a one-process server does (``serving.py``), and process 0 stops the worker
  only once the others have exited (``join``);
- the worker dies: process 0 tells the others (``WorkerExited``); they fail their requests with 503
  and exit, as process 0 does;
- another HTTP process dies: process 0 logs it and shuts the server down (exit status
  PEER_DIED_EXIT_CODE);
- process 0 dies: the others end with it (``process_lifetime.exit_with_parent``).
"""
import atexit
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Callable, List, Optional

from lightllm.server.core.objs.messages import WorkerExited
from lightllm.server.httpserver.serving import SHUTDOWN_FAIL_GRACE_S
from lightllm.utils.signals import signal_handlers

logger = logging.getLogger(__name__)

# What processes 1..N-1 take as their shutdown signal (process 0 passes its SIGTERM / SIGINT on as this)
PEER_SHUTDOWN_SIGNAL = signal.SIGUSR1
PEER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds process 0 waits for the others at shutdown beyond their own bound, before it kills them
PEER_EXIT_MARGIN_S = 5.0
# Exit status of process 0 after another HTTP process died under it
PEER_DIED_EXIT_CODE = 1
# Seconds the other processes get to start serving (load the tokenizer, start uvicorn), and how often
# process 0 checks that they are still alive meanwhile
PEER_START_TIMEOUT_S = 120.0
STARTED_POLL_S = 0.1


class WorkerState:
    """The model worker as processes 1..N-1 see it (the manager's ``worker``): alive until process 0
    reports that it exited. Process 0 owns the worker: ``kill`` leaves it alone."""

    def __init__(self):
        self.exitcode: Optional[int] = None
        self._alive = True

    def is_alive(self) -> bool:
        return self._alive

    def exited(self, exit_code: Optional[int]) -> None:
        self.exitcode = exit_code
        self._alive = False

    def kill(self) -> None:
        pass


class HttpPeers:
    """Process 0's handle on processes 1..N-1: their start, signals, exit, and a thread that tells
    them when the worker dies and shuts the server down when one of them dies."""

    def __init__(self, procs: List[mp.Process], go, started: list, update_queues: list, workers, metrics_dir: str,
                 exit_timeout_s: float):
        self.procs = procs
        self.metrics_dir = metrics_dir  # where every process writes its /metrics page (``close`` removes it)
        self.go = go  # set once process 0 serves: the others then start serving too
        self.started = started  # an event per process, set once it accepts connections
        self._lock = threading.Lock()
        self._serving = False  # process 0 serves (its shutdown signals are handled)
        self.update_queues = update_queues
        self.workers = workers  # api_start.WorkerProcesses
        self.exit_timeout_s = exit_timeout_s
        self.stopping = False  # shutdown began: a process that exits now is expected to
        self.failed = False  # one of them exited before shutdown
        self._signaled = set()  # pids sent PEER_SHUTDOWN_SIGNAL at least once
        self._watch = threading.Thread(target=self._watch_processes, name="http-peers", daemon=True)

    @classmethod
    def start(cls, target: Callable, args, in_q, update_queues: list, ready, workers) -> "HttpPeers":
        """Start ``target(args, index, in_q, update_queue, ready, metrics_dir, go, started)`` for
        index 1..N-1 (``update_queues``: theirs, in order): it builds its app, waits for ``go``
        (``release``), serves, and sets ``started``."""
        metrics_dir = tempfile.mkdtemp(prefix="lightllm-metrics-")
        # their shutdown bound (serving.py), and a margin
        exit_timeout_s = args.timeout_graceful_shutdown + SHUTDOWN_FAIL_GRACE_S + PEER_EXIT_MARGIN_S
        ctx = mp.get_context("spawn")
        go = ctx.Event()
        procs, started = [], []
        with signal_handlers(PEER_IGNORED_SIGNALS, signal.SIG_IGN):  # inherited: only process 0's signal counts
            for index, q in enumerate(update_queues, start=1):
                started.append(ctx.Event())
                proc = ctx.Process(target=target, name=f"http-{index}", daemon=True,
                                   args=(args, index, in_q, q, ready, metrics_dir, go, started[-1]))
                proc.start()
                procs.append(proc)
        peers = cls(procs, go, started, update_queues, workers, metrics_dir, exit_timeout_s)
        atexit.register(peers.kill)  # before multiprocessing's own exit, which would wait for them
        peers._watch.start()
        return peers

    def release(self) -> None:
        """Process 0 serves (its server's ``on_started``): the others may start serving now (before, a
        shutdown signal could reach process 0 before it handles one). A process that died meanwhile, or
        does not start, shuts the server down."""
        self.go.set()
        with self._lock:
            self._serving = True
            failed = self.failed
        if failed:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        threading.Thread(target=self._await_started, name="http-peers-start", daemon=True).start()

    def wait_started(self, timeout_s: float = PEER_START_TIMEOUT_S) -> None:
        """Wait until every process serves; RuntimeError when one exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        for p, event in zip(self.procs, self.started):
            while not event.wait(STARTED_POLL_S):
                if not p.is_alive():
                    raise RuntimeError(f"HTTP process {p.name} exited during start-up (code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HTTP process {p.name} did not start in {timeout_s:g} s")

    def _await_started(self) -> None:
        try:
            self.wait_started()
        except RuntimeError as e:
            if not self.stopping:
                logger.error("%s: shutting the server down", e)
                self.failed = True
                os.kill(os.getpid(), signal.SIGTERM)

    def forward(self, sig: int) -> None:
        """Process 0 received shutdown signal ``sig``: pass it on (each signal once to each process)."""
        self.stopping = True
        for p in self.procs:
            if p.is_alive():
                self._signaled.add(p.pid)
                try:
                    os.kill(p.pid, PEER_SHUTDOWN_SIGNAL)
                except ProcessLookupError:
                    pass

    def join(self, timeout: Optional[float] = None) -> None:
        """Shut them down (if no signal did yet) and wait up to ``timeout`` s (default: their shutdown
        bound) for them to exit; kill what is left."""
        self.stopping = True
        if any(p.is_alive() and p.pid not in self._signaled for p in self.procs):
            self.forward(PEER_SHUTDOWN_SIGNAL)
        deadline = time.monotonic() + (self.exit_timeout_s if timeout is None else timeout)
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        left = [p.name for p in self.procs if p.is_alive()]
        if left:
            logger.warning("HTTP processes %s did not exit in time: killing them", ", ".join(left))
            self.kill()

    def close(self) -> None:
        """After every process exited (process 0's last page written): remove the pages' directory."""
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)

    def _watch_processes(self) -> None:
        peers = {p.sentinel: p for p in self.procs}
        workers = {p.sentinel: p for p in self.workers.procs}
        pending = set(peers) | set(workers)
        worker_reported = False
        while pending:
            for s in wait(list(pending)):
                pending.discard(s)
                if s in workers and not worker_reported:
                    worker_reported = True
                    code = workers[s].exitcode
                    for q in self.update_queues:
                        q.put(WorkerExited(code))
                elif s in peers and not self.stopping:
                    p = peers[s]
                    logger.error("HTTP process %s exited (code %s): shutting the server down", p.name, p.exitcode)
                    with self._lock:
                        self.failed = True
                        serving = self._serving
                    if serving:  # else release() does it
                        os.kill(os.getpid(), signal.SIGTERM)
