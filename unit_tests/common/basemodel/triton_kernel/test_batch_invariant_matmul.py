"""The batch-invariant linear kernel: against a readable fp32 PyTorch reference, and each output
row bitwise the same whatever the number of rows in the call (CPU: Triton's interpreter; CUDA:
the real kernel; the sm_90 compile of the GPU build also runs on CPU, in a child process)."""
import json

import pytest
import torch

from lightllm.common.basemodel.triton_kernel.batch_invariant_matmul import (
    TILE_M,
    batch_invariant_linear,
)
from unit_tests.devices import KERNEL_DEVICES, needs_triton_cpu
from unit_tests.triton_compile_util import run_compile_child

# (rows, out features, in features): rows around the tile edge, narrow and wide weights,
# K not a multiple of the K tile.
SHAPES = [(1, 96, 64), (5, 40, 130), (TILE_M + 3, 1100, 72)]


def linear_reference(x, w, b=None):
    out = x.float() @ w.float().T
    return out if b is None else out + b.float()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(m, n, k, dtype, with_bias, device):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    ref = linear_reference(x, w, b)
    x, w, b = x.to(device), w.to(device), (b.to(device) if b is not None else None)
    out = batch_invariant_linear(x, w, b).cpu()
    assert out.shape == (m, n) and out.dtype == dtype
    # fp32: summation order only; bf16: one rounding of the output (8 bits of mantissa)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype, device):
    g = torch.Generator().manual_seed(7)
    m, n, k = TILE_M + 9, 80, 200
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    full = batch_invariant_linear(x, w)
    for lo, hi in [(0, 1), (3, 4), (0, 5), (5, 13), (TILE_M - 2, TILE_M + 2), (TILE_M, m)]:
        assert torch.equal(batch_invariant_linear(x[lo:hi], w), full[lo:hi]), (lo, hi)


@needs_triton_cpu
def test_leading_dims_and_errors():
    x = torch.randn(2, 3, 16).bfloat16()
    w = torch.randn(8, 16).bfloat16()
    assert torch.equal(batch_invariant_linear(x, w), batch_invariant_linear(x.reshape(6, 16), w).reshape(2, 3, 8))
    assert batch_invariant_linear(x[:0], w).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="features"):
        batch_invariant_linear(torch.randn(2, 15).bfloat16(), w)
    with pytest.raises(ValueError, match="dtype"):
        batch_invariant_linear(torch.randn(2, 16), w)


# ---------------------------------------------------------------- sm_90 compile

# (N, K) of the embedded model's layers and lm_head, and an 8B-shaped MLP
COMPILE_CASES = {f"{dt}-{n}x{k}": (dt, n, k) for dt in ("bf16", "fp32")
                 for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (28672, 4096)]}


def _compile_all() -> dict:
    from unit_tests.triton_compile_util import compile_for_sm90

    from lightllm.common.basemodel.triton_kernel import batch_invariant_matmul as mod

    results = {}
    for name, (dt, n, k) in COMPILE_CASES.items():
        ptr = "*" + dt
        signature = {"x_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "out_ptr": ptr, "M": "i32", "stride_xm": "i32",
                     "stride_wn": "i32", "stride_om": "i32", "N": "constexpr", "K": "constexpr",
                     "HAS_BIAS": "constexpr", "DOT_FP32": "constexpr", "INTERPRETED": "constexpr", "BLOCK_M": "constexpr",
                     "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
        constexprs = {"N": n, "K": k, "HAS_BIAS": False, "DOT_FP32": dt == "fp32", "INTERPRETED": False, "BLOCK_M": mod.TILE_M,
                      "BLOCK_N": mod.tile_n(n), "BLOCK_K": mod.TILE_K}
        try:
            compile_for_sm90(mod._bi_matmul_kernel, signature, constexprs)
            results[name] = "ok"
        except Exception as e:  # reported by the test of this case
            results[name] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def compile_results() -> dict:
    out = run_compile_child(["-m", "unit_tests.common.basemodel.triton_kernel.test_batch_invariant_matmul"])
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_kernel_compiles_for_sm90(compile_results, name):
    assert compile_results[name] == "ok"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
