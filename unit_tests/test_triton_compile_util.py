import triton
import triton.language as tl

from unit_tests.triton_compile_util import compile_for_sm90


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def test_compile_for_sm90_produces_ptx():
    compiled = compile_for_sm90(_add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 16})
    assert "ptx" in compiled.asm
