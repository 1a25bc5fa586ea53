import json

from unit_tests.triton_compile_util import run_compile_child

CHILD = """
import json
import triton
import triton.language as tl
from unit_tests.triton_compile_util import compile_for_sm90


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.sum(offs, 0), mask=mask)


c = compile_for_sm90(_add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 16})
print(json.dumps({"ptx": "ptx" in c.asm, "sm90": ".target sm_90" in c.asm["ptx"]}))
"""


def test_compile_for_sm90_produces_sm90_ptx(tmp_path):
    script = tmp_path / "child.py"  # triton reads a kernel's source from its file
    script.write_text(CHILD)
    out = json.loads(run_compile_child([str(script)]).strip().splitlines()[-1])
    assert out == {"ptx": True, "sm90": True}
