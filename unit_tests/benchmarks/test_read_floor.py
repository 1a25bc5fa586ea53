"""benchmarks/read_floor.py: the bare K/V read sums every element once (interpreter, CPU tensors), whatever
the grid, against torch's sum; and it compiles for sm_90."""
import os
import sys

import pytest
import torch

from unit_tests.triton_compile_util import run_compile_child

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import read_floor  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_every_element_is_read_once(programs):
    gen = torch.Generator().manual_seed(programs)
    # a size that is not a multiple of READ_BLOCK, so the last program's share is partly masked
    k = torch.randint(-8, 8, (3, 5, read_floor.READ_BLOCK // 4 + 3), generator=gen).to(torch.bfloat16)
    v = torch.randint(-8, 8, k.shape, generator=gen).to(torch.bfloat16)
    out = torch.full((programs,), float("nan"), dtype=torch.float32)
    read_floor.read_kv(k, v, out)
    assert not out.isnan().any()  # every program wrote its sum
    assert out.sum().item() == k.float().sum().item() + v.float().sum().item()  # small ints: exact in fp32


def test_bad_arguments_are_refused():
    k = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one shape"):
        read_floor.read_kv(k, torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(ValueError, match="fp32"):
        read_floor.read_kv(k, k.clone(), torch.zeros(2, dtype=torch.float16))


COMPILE = """
from unit_tests.triton_compile_util import compile_for_sm90
from read_floor import READ_BLOCK, READ_WARPS, _read_kv_kernel
sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*fp32", "n_elems": "i32", "chunk": "i32", "BLOCK": "constexpr"}
c = compile_for_sm90(_read_kv_kernel, sig, {"BLOCK": READ_BLOCK}, {"num_warps": READ_WARPS},
                     ["k_ptr", "v_ptr", "out_ptr", "chunk"])
assert "ptx" in c.asm
print("compiled")
"""


def test_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", "import sys; sys.path.insert(0, 'benchmarks')\n" + COMPILE])
