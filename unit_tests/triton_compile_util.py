"""Compile a Triton kernel for Hopper (sm_90) without a GPU.

The interpreter accepts code the compiler rejects (``break``, some casts), so CI
compiles every kernel for the real target as well.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Iterable, Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from unit_tests.data_paths import REPO_ROOT

SM90_TARGET = GPUTarget("cuda", 90, 32)


LAUNCH_DIVISIBILITY = 16  # a launch marks pointers and ints that are multiples of 16 (vector loads, cp.async)


def compile_for_sm90(kernel, signature: dict, constexprs: dict, options: Optional[dict] = None,
                     divisible: Iterable[str] = ()):
    """``signature`` maps every argument name to a Triton type string ("*i64", "i32",
    "fp32", "constexpr"); ``constexprs`` maps constexpr names to values; ``options``:
    compiler options, as a launch passes them (e.g. {"enable_fp_fusion": False});
    ``divisible``: arguments a launch would see as multiples of LAUNCH_DIVISIBILITY (aligned
    tensors, strides of 16 elements): without them the compiler emits scalar loads, another kernel."""
    raw = kernel
    while hasattr(raw, "fn"):  # JITFunction / InterpretedFunction / Autotuner wrap the python function
        raw = raw.fn
    # Under TRITON_INTERPRET=1 @triton.jit gives an interpreter object: rebuild a real JITFunction.
    jit_fn = JITFunction(raw)
    attrs = {(jit_fn.arg_names.index(k),): [["tt.divisibility", LAUNCH_DIVISIBILITY]] for k in divisible}
    constants = {(jit_fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=jit_fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=SM90_TARGET, options=options)


def sm90_resource_usage(compiled) -> dict:
    """Registers and stack bytes per thread of a compiled kernel, read from its cubin by the
    cuobjdump that ships with Triton: {"REG": n, "STACK": bytes} (a stack holds spilled registers)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", dump.stdout)
    assert found, dump.stdout
    return {"REG": int(found.group(1)), "STACK": int(found.group(2))}


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
