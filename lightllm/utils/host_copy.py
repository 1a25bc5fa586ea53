"""Small host values to the device without a host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and CUDA syncs the stream
before such a copy: the host then waits for every kernel queued before it (a step's forward),
and the GPU idles while the host prepares what follows. From pinned memory the copy is queued
like a kernel. A mixed step makes several such copies (sampled rows, draft positions, first
tokens): building a tensor and pinning it took ~60 us of each such copy's ~115 on the H200's host
(``torch.tensor`` then ``pin_memory``; cProfile of ``profile_mixed_step.py``,
docs/data/perf/session23/profile_mixed_gsm8k_fe4fb82.log), so the values go through one pinned ring
(``PinnedRing``) written through numpy instead; other streams, graph capture and large copies pin
their own buffer as before.
"""
import functools
import threading
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

# Bytes of the pinned ring per device (two halves); a mixed step moves a few KB, a prompt up to
# 8 bytes per token, so a half holds hundreds of steps.
PINNED_RING_BYTES = 1 << 22
# Each copy starts at a multiple of this many bytes (any dtype's alignment).
RING_ALIGN = 64


class PinnedRing:
    """Pinned host memory that small host->device copies reuse, on one stream. A copy takes the next
    bytes of the current half; when a half is full the ring records an event (after every copy from
    it) and moves to the other half, first waiting for the event recorded when that half was left
    (a half-lap ago: its copies are long done, so nothing stalls)."""

    def __init__(self, device: torch.device, nbytes: int = PINNED_RING_BYTES,
                 make_event: Optional[Callable[[], object]] = None, pin: bool = True):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.stream = torch.cuda.default_stream(device) if self.on_cuda else None  # where the steps run
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.half_bytes = nbytes // 2
        self.half = 0  # the half copies take bytes from
        self.head = 0  # the next free byte
        self.left = [None, None]  # the event recorded when each half was last left
        self.make_event = make_event or torch.cuda.Event
        self.lock = threading.Lock()

    def usable(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` can go through the ring now (else the caller pins its own)."""
        if nbytes == 0 or nbytes > self.half_bytes:
            return False
        if not self.on_cuda:
            return True
        return torch.cuda.current_stream(self.device) == self.stream and not torch.cuda.is_current_stream_capturing()

    def _take(self, nbytes: int) -> int:
        end = (self.half + 1) * self.half_bytes
        if self.head + nbytes > end:
            event = self.make_event()
            event.record(self.stream)  # None (no CUDA): the current stream
            self.left[self.half] = event
            self.half = 1 - self.half
            self.head = self.half * self.half_bytes
            if self.left[self.half] is not None:
                self.left[self.half].synchronize()
        start = self.head
        self.head = min(start + -(-nbytes // RING_ALIGN) * RING_ALIGN, (self.half + 1) * self.half_bytes)
        return start

    def copy(self, arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``arr`` (host, ``dtype``'s numpy type) as a tensor on the ring's device, queued on its stream."""
        with self.lock:
            start = self._take(arr.nbytes)
            host = self.buf[start:start + arr.nbytes].view(dtype)
            host.numpy()[:] = arr
            return host.to(self.device, non_blocking=True)


_rings: Dict[torch.device, PinnedRing] = {}


def pinned_ring(device: torch.device) -> PinnedRing:
    """The process's ring for ``device`` (CUDA), made on first use."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = PinnedRing(device)
    return ring


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (a sequence or a host tensor) as a ``dtype`` tensor on ``device``, queued on the current
    stream (CUDA: via pinned memory, the ring's where it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        return host.to(device)
    if isinstance(values, torch.Tensor):
        arr = values.to(dtype).numpy()
    else:
        arr = np.asarray(values, dtype=_numpy_dtype(dtype))
    ring = pinned_ring(device)
    if arr.ndim == 1 and ring.usable(arr.nbytes):
        return ring.copy(arr, dtype)
    return torch.from_numpy(np.ascontiguousarray(arr)).pin_memory().to(device, non_blocking=True)
