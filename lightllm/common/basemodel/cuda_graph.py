"""CUDA graphs of the decode step: a ladder of captured batch sizes, one memory pool.

A batch of ``n`` requests runs the graph of the smallest captured size ``>= n``; the
rows past the real ones are HOLD padding. The eager CUDA path pads to the same size
(``bucket_size``), so ``--disable_cudagraph`` runs the very same kernels on the very
same shapes and stays a bit-exact reference.
"""
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

# Replays run before capture so that Triton compiles and cuBLAS picks its kernels.
CAPTURE_WARMUP_RUNS = 2


@dataclass(frozen=True)
class GraphLadder:
    """Captured batch sizes in requests, ascending (LightLLM's flags build it)."""

    sizes: Tuple[int, ...]

    @classmethod
    def from_flags(cls, max_batch_size: int, split_batch_size: int, grow_step_size: int) -> "GraphLadder":
        """Powers of two below ``split_batch_size``, then ``split_batch_size`` and every
        ``grow_step_size`` after it, up to and including ``max_batch_size``."""
        if min(max_batch_size, split_batch_size, grow_step_size) < 1:
            raise ValueError("graph batch sizes must be >= 1")
        sizes = set()
        n = 1
        while n < min(split_batch_size, max_batch_size):
            sizes.add(n)
            n *= 2
        n = split_batch_size
        while n < max_batch_size:
            sizes.add(n)
            n += grow_step_size
        sizes.add(max_batch_size)
        return cls(tuple(sorted(sizes)))

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket_size(self, n: int) -> Optional[int]:
        """The smallest size >= ``n``; None above the largest (the step then runs eagerly)."""
        for size in self.sizes:
            if size >= n:
                return size
        return None


def capture_error_mode() -> str:
    """``torch.cuda.graph``'s capture mode: ``global`` with one rank; with several (NCCL collectives captured,
    --enable_tp_cudagraph) ``thread_local``, so that the process group's watchdog thread, which queries the
    events of collectives run before the capture, does not invalidate it."""
    import torch.distributed as dist

    return "thread_local" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else "global"


class CudaGraphSet:
    """Graphs keyed by anything hashable, captured into one shared memory pool.

    ``capture(key, fn)`` runs ``fn()`` a few times eagerly, then records it; ``fn`` must read
    and write only tensors that outlive the graph (static buffers) and return its outputs,
    which stay allocated and are rewritten by every ``replay(key)``. Replays of different
    keys must not overlap (one stream, one step at a time)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: Dict[Hashable, Tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_seconds = 0.0
        self.capture_mib = 0.0  # device memory the captures took (pool and outputs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, key: Hashable, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=capture_error_mode()):
            out = fn()
        torch.cuda.synchronize(self.device)
        self._graphs[key] = (graph, out)
        self.capture_seconds += time.perf_counter() - t0
        return out

    def replay(self, key: Hashable) -> object:
        graph, out = self._graphs[key]
        graph.replay()
        return out


def capture_ladder(graphs: CudaGraphSet, sizes: Sequence[int], capture_one: Callable[[int], None],
                   what: str = "batch sizes") -> None:
    """Capture the largest size first, so smaller graphs reuse its pool memory; log the cost."""
    free_before, _ = torch.cuda.mem_get_info(graphs.device)
    for size in sorted(sizes, reverse=True):
        capture_one(size)
    free_after, _ = torch.cuda.mem_get_info(graphs.device)
    graphs.capture_mib = (free_before - free_after) / 2**20
    logger.info(
        "captured CUDA graphs for %d %s (%d..%d) in %.1f s, holding %.1f MiB",
        len(sizes), what, min(sizes), max(sizes), graphs.capture_seconds, graphs.capture_mib,
    )
