"""Compile a Triton kernel for Hopper (sm_90) without a GPU.

The interpreter accepts code the compiler rejects (``break``, some casts), so CI
compiles every kernel for the real target as well.
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90_TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, signature: dict, constexprs: dict):
    """``signature`` maps every argument name to a Triton type string ("*i64", "i32",
    "fp32", "constexpr"); ``constexprs`` maps constexpr names to values."""
    raw = kernel
    while hasattr(raw, "fn"):  # JITFunction / InterpretedFunction / Autotuner wrap the python function
        raw = raw.fn
    # Under TRITON_INTERPRET=1 @triton.jit gives an interpreter object: rebuild a real JITFunction.
    jit_fn = JITFunction(raw)
    src = ASTSource(fn=jit_fn, signature=signature, constexprs={(jit_fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=SM90_TARGET)
