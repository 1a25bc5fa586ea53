"""SwiGLU's activation in one launch: silu(gate) * up from the gate_up projection's output.

The torch code it replaces (basic_ops.silu_and_mul_torch) runs two kernels and rounds silu's
result to the tensor dtype before the product; this kernel keeps those rounding steps, with
CUDA's exact expf (libdevice) and a correctly rounded division, as torch's silu computes
x / (1 + exp(-x)) in fp32. Launches pass enable_fp_fusion=False (no fma contraction).
"""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_COLS = 1024  # output columns per program
NUM_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr,
    stride_in_row, stride_out_row, inter,
    BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # One program per (row, block of BLOCK output columns); gate is the row's first half, up the second.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    in_row = gate_up_ptr + row * stride_in_row
    gate = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # CUDA's expf (torch's); the CPU interpreter has no libdevice, its tl.exp is numpy's
    if INTERPRETED:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(dtype)
    out = (silu.to(tl.float32) * up).to(dtype)
    tl.store(out_ptr + row * stride_out_row + cols, out, mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] with gate_up.stride(-1) == 1 -> [rows, inter] (new tensor)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK_COLS, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), inter,
        BLOCK=block, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return out
