"""A bare read of one layer's K and V: what a single kernel per layer can reach, for bench_attention.py.

``read_kv`` streams every element of the K and V caches once (each program a contiguous share of both)
and writes one fp32 sum per program, so it moves the bytes a decode attention call must read and does
nothing else: no slot table, no softmax, no merge. Timed exactly as the attention (GRAPH_LAYERS layers,
each over its own caches, in one CUDA graph), its share of the copy bandwidth is the floor that issue 25's
batch-1 bar is compared with.
"""
import torch
import triton
import triton.language as tl

# Elements each program reads per tensor and loop step (8 KiB of bf16), and its warps.
READ_BLOCK = 4096
READ_WARPS = 8
# Programs per SM that bench_attention.py tries: the floor is the fastest of them.
READ_PROGRAMS_PER_SM = (2, 4, 8)


@triton.jit
def _read_kv_kernel(k_ptr, v_ptr, out_ptr, n_elems, chunk, BLOCK: tl.constexpr):
    """Program p sums elements [p * chunk, (p + 1) * chunk) of K and of V (chunk: a multiple of BLOCK)."""
    pid = tl.program_id(0)
    start = pid * chunk
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, start + chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        in_range = idx < n_elems
        acc += tl.load(k_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_kv(k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One program per entry of ``out`` (fp32) reads its share of ``k`` and ``v`` (same shape and dtype,
    contiguous); ``out.sum()`` is the sum of every element of both."""
    if k.shape != v.shape or k.dtype != v.dtype or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous tensors of one shape and dtype")
    if out.dtype != torch.float32 or out.ndim != 1 or out.numel() == 0:
        raise ValueError("out must be a non-empty 1-d fp32 tensor: one entry per program")
    programs, n = out.numel(), k.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs), READ_BLOCK) * READ_BLOCK
    _read_kv_kernel[(programs,)](k, v, out, n, chunk, BLOCK=READ_BLOCK, num_warps=READ_WARPS)
    return out
