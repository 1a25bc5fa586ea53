"""The fused SwiGLU activation against a readable PyTorch reference written here.

CUDA: bit-exact in bf16/fp16/fp32 against the reference and against the torch code it replaces
(F.silu, then the product), eagerly and from a CUDA graph. CPU: the Triton interpreter in fp32 (it
mis-rounds bf16), whose exp is numpy's, within a few fp32 ulps. A child process compiles the kernel
for sm_90 without a GPU.
"""
import json

import pytest
import torch

from unit_tests.devices import needs_cuda, needs_triton_cpu
from unit_tests.triton_compile_util import compile_in_child

from lightllm.common.basemodel.layer_infer import basic_ops
from lightllm.common.basemodel.triton_kernel.silu_and_mul import silu_and_mul_triton

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # (rows, intermediate)
    (1, 1536),  # SmolLM2-135M decode
    (37, 1536),
    (3, 14336),  # 8B: several column blocks a row
    (5, 100),  # not a power of two
]
INTERPRETER_RTOL = 4e-7  # numpy's exp against torch's CPU exp: a few fp32 ulps


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(g) = g / (1 + exp(-g)) in fp32, rounded to the dtype; times up in fp32, rounded."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(gate_up.dtype)
    return (silu.float() * up).to(gate_up.dtype)


def make_gate_up(rows: int, inter: int, dtype, device, seed: int = 0, pad: int = 0) -> torch.Tensor:
    """[rows, 2 * inter], a column slice of a wider tensor when ``pad`` (a row stride of its own)."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, 2 * inter + pad, generator=g) * 4).to(dtype).to(device)
    return wide[:, pad:]


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul_bit_exact_cuda(shape, dtype):
    for pad in (0, 8):
        gate_up = make_gate_up(*shape, dtype, "cuda", pad=pad)
        before = gate_up.clone()
        out = silu_and_mul_triton(gate_up)
        assert out.shape == (shape[0], shape[1]) and out.dtype == dtype
        assert torch.equal(out, ref_silu_and_mul(gate_up))
        assert torch.equal(out, basic_ops.silu_and_mul_torch(gate_up))
        assert torch.equal(gate_up, before)
        assert torch.equal(basic_ops.silu_and_mul(gate_up), out)  # the dispatcher takes the kernel


@needs_cuda
def test_silu_and_mul_extremes_cuda():
    """Large |gate| (exp over- and underflows), zeros and signed zeros: as torch."""
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 89.0, -89.0, 1e4, -1e4, 3.0, -3.0])
    for dtype in ALL_DTYPES:
        gate_up = torch.cat([values, values.flip(0)]).to(dtype).cuda()[None, :]
        assert torch.equal(silu_and_mul_triton(gate_up), basic_ops.silu_and_mul_torch(gate_up))


@needs_cuda
def test_silu_and_mul_cuda_graph_capture():
    gate_up = make_gate_up(4, 1536, torch.bfloat16, "cuda")
    silu_and_mul_triton(gate_up)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul_triton(gate_up)
    gate_up.copy_(make_gate_up(4, 1536, torch.bfloat16, "cuda", seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_silu_and_mul(gate_up))


@needs_triton_cpu
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul_interpreter_fp32(shape):
    gate_up = make_gate_up(*shape, torch.float32, "cpu", pad=8)
    torch.testing.assert_close(silu_and_mul_triton(gate_up), ref_silu_and_mul(gate_up), rtol=INTERPRETER_RTOL,
                               atol=0)


def test_cpu_dispatch_uses_torch_code():
    gate_up = make_gate_up(3, 100, torch.bfloat16, "cpu")
    assert torch.equal(basic_ops.silu_and_mul(gate_up), basic_ops.silu_and_mul_torch(gate_up))


# ---------------------------------------------------------------- sm_90 compile

TRITON_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _compile_all() -> dict:
    """Runs in the child: dtype -> {"status": "ok" or the error, "div_rn": the division is IEEE's}."""
    from lightllm.common.basemodel.triton_kernel import silu_and_mul as k
    from unit_tests.triton_compile_util import compile_for_sm90

    results = {}
    for name, ptr in TRITON_TYPES.items():
        signature = {"gate_up_ptr": ptr, "out_ptr": ptr, "stride_in_row": "i64", "stride_out_row": "i64",
                     "inter": "i32", "BLOCK": "constexpr", "INTERPRETED": "constexpr"}
        try:
            ptx = compile_for_sm90(k._silu_and_mul_kernel, signature, {"BLOCK": k.BLOCK_COLS, "INTERPRETED": False},
                                   {"enable_fp_fusion": False}).asm["ptx"]
            results[name] = {"status": "ok", "div_rn": "div.rn.f32" in ptx and "div.full" not in ptx}
        except Exception as e:  # reported by the test of this case
            results[name] = {"status": f"{type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def compile_results() -> dict:
    return compile_in_child("unit_tests.common.basemodel.triton_kernel.test_silu_and_mul")


@pytest.mark.parametrize("name", list(TRITON_TYPES))
def test_kernel_compiles_for_sm90(compile_results, name):
    assert compile_results[name]["status"] == "ok"
    assert compile_results[name]["div_rn"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
