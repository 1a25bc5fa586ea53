"""Compile a Triton kernel for Hopper (sm_90) without a GPU.

The interpreter accepts code the compiler rejects (``break``, some casts), so CI
compiles every kernel for the real target as well.
"""
import json
import os
import subprocess
import sys
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from unit_tests.data_paths import REPO_ROOT

SM90_TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, signature: dict, constexprs: dict, options: Optional[dict] = None):
    """``signature`` maps every argument name to a Triton type string ("*i64", "i32",
    "fp32", "constexpr"); ``constexprs`` maps constexpr names to values; ``options``:
    compiler options, as a launch passes them (e.g. {"enable_fp_fusion": False})."""
    raw = kernel
    while hasattr(raw, "fn"):  # JITFunction / InterpretedFunction / Autotuner wrap the python function
        raw = raw.fn
    # Under TRITON_INTERPRET=1 @triton.jit gives an interpreter object: rebuild a real JITFunction.
    jit_fn = JITFunction(raw)
    src = ASTSource(fn=jit_fn, signature=signature, constexprs={(jit_fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=SM90_TARGET, options=options)


CHILD_TIMEOUT_S = 300


def run_compile_child(argv: list) -> str:
    """Run ``python argv...`` in the repo without TRITON_INTERPRET and return its stdout.

    In interpreter mode the @triton.jit helpers of triton.language (tl.sum, tl.max)
    are interpreter objects the real compiler cannot call, so sm_90 compiles run in a
    fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    child = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, child.stderr[-4000:]
    return child.stdout


def compile_in_child(module: str) -> dict:
    """``python -m module`` in a fresh process (run_compile_child); the module's ``__main__``
    prints its compile results as one JSON line last, which this returns."""
    return json.loads(run_compile_child(["-m", module]).strip().splitlines()[-1])
