"""What a start-up allocation may take, checked before it is made: a KV pool or request table too large
for the device is then one clear line (``StartupError``), not an allocator's traceback (or, on a host
that overcommits, the kernel's OOM killer once the zeros are written)."""
from typing import Optional

import torch

GIB = 1 << 30
MEMINFO = "/proc/meminfo"


class StartupError(RuntimeError):
    """A start-up failure whose message says all there is to say (reported without a traceback)."""


def host_available_bytes() -> Optional[int]:
    """The host's MemAvailable (Linux), else None."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_bytes(device: torch.device) -> Optional[int]:
    """Bytes a new allocation on ``device`` can take now (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return host_available_bytes()
    return None


def check_fits(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """StartupError when ``nbytes`` (``what``) exceed the free memory of ``device``; ``fix`` says which flag to
    lower."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise StartupError(f"{what} needs {nbytes / GIB:.1f} GiB, and {free / GIB:.1f} GiB of {device} memory "
                           f"is free: {fix}")
