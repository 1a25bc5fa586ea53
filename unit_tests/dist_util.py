"""Run a function on several CPU ranks (spawned processes, gloo over loopback) and collect results."""
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable, List

import torch.distributed as dist

from lightllm.utils.server_launcher import free_port

RANKS_TIMEOUT_S = 300


def _rank_entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, out: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank)
        out.put((rank, fn(rank, *args), None))
        dist.destroy_process_group()
    except BaseException:  # the test process re-raises it with the rank's traceback
        out.put((rank, None, traceback.format_exc()))
        out.close()
        out.join_thread()  # the traceback must reach the test before the hard exit
        os._exit(1)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = RANKS_TIMEOUT_S) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` gloo ranks (fn must be a module-level function);
    returns the results in rank order, or raises with the first failing rank's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world_size:
            try:
                rank, res, err = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks did not finish in {timeout}s (got {sorted(results)})") from None
            if err is not None:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
