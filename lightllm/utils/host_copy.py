"""Small host values to the device without a host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and CUDA syncs the stream
before such a copy: the host then waits for every kernel queued before it (a step's forward),
and the GPU idles while the host prepares what follows. From pinned memory the copy is queued
like a kernel (PyTorch's pinned-memory cache keeps the buffer until the copy is done).
"""
from typing import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (a sequence or a host tensor) as a ``dtype`` tensor on ``device``, queued on the current
    stream (CUDA: via pinned memory)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
