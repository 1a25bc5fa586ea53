"""Intra-op thread count for CPU inference.

torch's default (one thread per core) oversubscribes as soon as anything else runs
(the HTTP process, other ranks, a test runner): on a 2-core machine one decode step
was seen 6x slower with 2 threads than with 1. Use half the cores, at least one,
split over the ranks on this host; LIGHTLLM_CPU_THREADS overrides.
"""
import os

import torch

CPU_THREADS_ENV = "LIGHTLLM_CPU_THREADS"


def cpu_inference_threads(ranks_on_host: int = 1) -> int:
    if os.environ.get(CPU_THREADS_ENV):
        return max(1, int(os.environ[CPU_THREADS_ENV]))
    return max(1, (os.cpu_count() or 1) // 2 // max(1, ranks_on_host))


def configure_cpu_threads(ranks_on_host: int = 1) -> None:
    torch.set_num_threads(cpu_inference_threads(ranks_on_host))
