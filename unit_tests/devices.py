"""Device parametrization shared by kernel tests.

Triton kernels run on CPU tensors only in the interpreter, which conftest.py turns
on when no GPU exists. On a GPU machine the CPU cases skip and the CUDA ones run.
"""
import os

import pytest
import torch

TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_cpu = pytest.mark.skipif(not TRITON_ON_CPU, reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (no GPU)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Devices a Triton kernel test runs on.
KERNEL_DEVICES = [pytest.param("cpu", marks=needs_triton_cpu), pytest.param("cuda", marks=needs_cuda)]
