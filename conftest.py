"""Test session set-up: Triton kernels run in the CPU interpreter when no GPU exists.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it must be set
before any kernel module is imported.
"""
import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_takes_loaded_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a ``range`` bound with
    ``int(array)``, which numpy >= 2.4 refuses; the compiler takes such bounds. Read the element."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_takes_loaded_loop_bounds()

# In-process CPU engines (also on GPU machines: the gloo tests) share the cores with the
# server processes and ranks the tests start, and with other pytest workers.
from lightllm.utils.cpu_threads import configure_cpu_threads  # noqa: E402

configure_cpu_threads()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped on CPU)")
    config.addinivalue_line("markers", "slow: slow real-model test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "spread: the file's tests may run on several xdist workers at once (no module "
                                       "fixtures worth sharing; --dist loadgroup, unit_tests/run_gpu_ci.sh)")
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker (pytest-xdist)")



@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under --dist loadgroup every file's tests share a worker (its module fixtures: models, engines),
    as with --dist loadfile, except in files marked ``spread``: many kernel variants to compile, each test
    on its own (the GPU suite's longest file ran alone on one worker for minutes)."""
    for item in items:
        if item.get_closest_marker("spread") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))  # xdist adds "@<stem>" to the test's id


FAILED_LIVE_ENV = "LIGHTLLM_FAILED_LIVE"  # a file: each failing test's id, written as it fails


def pytest_runtest_logreport(report):
    """A run cut by a time limit (the GPU machine's calls) still names its failures: with xdist
    this runs in the controller for every worker's report."""
    path = os.environ.get(FAILED_LIVE_ENV)
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"{report.when} {report.nodeid}\n")
