"""Fused RMSNorm / rotary Triton kernels vs readable PyTorch references written here.

CUDA: rotary is bit-exact in bf16/fp16/fp32; rmsnorm is bit-exact in fp32 and within one
ulp of the output dtype in bf16/fp16 (the fp32 sum of squares is reduced in another
order than torch's mean). CPU: the Triton interpreter (conftest.py) in fp32 only, since
it mis-rounds bf16. A child process compiles every kernel for sm_90 without a GPU.
"""
import json

import pytest
import torch

from unit_tests.devices import needs_cuda, needs_triton_cpu
from unit_tests.triton_compile_util import compile_in_child

from lightllm.common.basemodel.layer_infer import basic_ops
from lightllm.common.basemodel.triton_kernel.fused_norm_rotary import (
    add_rms_norm_triton,
    apply_rotary_triton,
    rms_norm_triton,
    rotary_cache_kv_triton,
)

EPS = 1e-6
LOW_PRECISION = [torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MAX_DIFF_FRACTION = 0.01  # elements allowed to differ by one ulp in bf16/fp16 rmsnorm
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


# ---------------------------------------------------------------- references


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, normalize in fp32, round to x's dtype, multiply by weight in fp32, round."""
    x32 = x.float()
    mean_square = (x32 * x32).sum(dim=-1, keepdim=True) / x.shape[-1]
    normed = (x32 / torch.sqrt(mean_square + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per half: lo' = lo*cos_lo - hi*sin_lo, hi' = hi*cos_hi + lo*sin_hi; every product
    and the sum rounded to x's dtype, like the separate torch ops."""
    dtype, half = x.dtype, x.shape[-1] // 2

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    lo, hi = x[..., :half].float(), x[..., half:].float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    new_lo = rnd(lo * c[..., :half]) + rnd(-hi * s[..., :half])
    new_hi = rnd(hi * c[..., half:]) + rnd(lo * s[..., half:])
    return torch.cat([new_lo, new_hi], dim=-1).to(dtype)


def ref_rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slots):
    """Rotated q; rotated k and v written to copies of the caches at ``slots``."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        k_cache[slot] = ref_rotary(k[t:t + 1], cos[t:t + 1], sin[t:t + 1])[0]
        v_cache[slot] = v[t]
    return ref_rotary(q, cos, sin), k_cache, v_cache


# ---------------------------------------------------------------- inputs


def make_qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, device, seed=0):
    """q, k: non-contiguous [tokens, heads, head_dim] views of one fused qkv tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)


def make_cache_inputs(tokens, q_heads, kv_heads, head_dim, dtype, device, num_slots=64, seed=3):
    """q, k, v: views of one fused qkv tensor; caches with random contents; distinct random slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    caches = [torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype).to(device) for _ in range(2)]
    slots = torch.randperm(num_slots, generator=g)[:tokens].to(device)
    views = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    return (*views, *caches, slots)


def check_rotary_cache(q, k, v, k_cache, v_cache, slots, cos, sin):
    """The kernel against the reference: rotated q, both caches bit for bit (other slots untouched)."""
    want_q, want_k, want_v = ref_rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    got_q = rotary_cache_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def check_kv_only(k, v, k_cache, v_cache, slots, cos, sin):
    """Without q (a draft's context K/V): the same caches as with q, and nothing returned."""
    _, want_k, want_v = ref_rotary_cache(k, k, v, cos, sin, k_cache, v_cache, slots)
    assert rotary_cache_kv_triton(None, k, v, cos, sin, k_cache, v_cache, slots) is None
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def make_cos_sin(tokens, head_dim, dtype, device, seed=1):
    """Rotary tables as the engine builds them: random positions, halves duplicated."""
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.randint(0, 4096, (tokens,), generator=g).float()
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def make_norm_inputs(shape, dtype, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    return x, weight


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value of a bf16/fp16 tensor, as fp32."""
    _, exponent = torch.frexp(t.float())  # |t| in [2^(e-1), 2^e)
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), exponent - 1 - MANTISSA_BITS[t.dtype])


def assert_within_one_ulp(out: torch.Tensor, ref: torch.Tensor):
    diff = (out.float() - ref.float()).abs()
    fraction = (diff > 0).float().mean().item()
    print(f"{out.dtype} {tuple(out.shape)}: {fraction:.4%} of elements differ")
    assert fraction < MAX_DIFF_FRACTION
    bound = torch.maximum(ulp(out), ulp(ref))
    assert bool((diff <= bound).all()), (diff - bound).max().item()


# ---------------------------------------------------------------- CUDA

ROTARY_SHAPES = [  # (tokens, q_heads, kv_heads, head_dim)
    (1, 9, 3, 64),  # SmolLM2-135M decode
    (37, 9, 3, 64),
    (5, 16, 8, 128),  # Qwen3-0.6B
    (6, 5, 1, 80),  # head_dim / 2 not a power of two
]
NORM_SHAPES = [(1, 576), (13, 576), (4, 4096), (3, 64), (7, 1000)]


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_bit_exact_cuda(shape, dtype):
    tokens, q_heads, kv_heads, head_dim = shape
    q, k = make_qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, "cuda")
    cos, sin = make_cos_sin(tokens, head_dim, dtype, "cuda")
    for x in (q, k):
        assert x.is_contiguous() == (tokens == 1)  # one token's split view is contiguous
        before = x.clone()
        out = apply_rotary_triton(x, cos, sin)
        assert torch.equal(out, ref_rotary(x, cos, sin))
        assert torch.equal(x, before)  # x is not modified
        # The dispatcher takes the Triton path on CUDA and equals the torch code bit for bit.
        assert torch.equal(basic_ops.apply_rotary(x, cos, sin), basic_ops.apply_rotary_torch(x, cos, sin))


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_cache_bit_exact_cuda(shape, dtype):
    tokens, q_heads, kv_heads, head_dim = shape
    q, k, v, k_cache, v_cache, slots = make_cache_inputs(tokens, q_heads, kv_heads, head_dim, dtype, "cuda")
    cos, sin = make_cos_sin(tokens, head_dim, dtype, "cuda")
    # the dispatcher (fused on CUDA) against the torch code it replaces, bit for bit
    kc, vc = k_cache.clone(), v_cache.clone()
    fused_q = basic_ops.rotary_and_cache_kv(q, k, v, cos, sin, kc, vc, slots)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    kc_ref[slots] = basic_ops.apply_rotary_torch(k, cos, sin)
    vc_ref[slots] = v
    assert torch.equal(fused_q, basic_ops.apply_rotary_torch(q, cos, sin))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    kv_only_k, kv_only_v = k_cache.clone(), v_cache.clone()
    assert basic_ops.rotary_and_cache_kv(None, k, v, cos, sin, kv_only_k, kv_only_v, slots) is None
    assert torch.equal(kv_only_k, kc_ref) and torch.equal(kv_only_v, vc_ref)
    check_kv_only(k, v, k_cache.clone(), v_cache.clone(), slots, cos, sin)
    check_rotary_cache(q, k, v, k_cache, v_cache, slots, cos, sin)


@needs_cuda
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_fp32_cuda(shape):
    x, weight = make_norm_inputs(shape, torch.float32, "cuda")
    out = rms_norm_triton(x, weight, EPS)
    # torch's own mean/rsqrt round differently from the sqrt/div reference: a few fp32 ulps.
    torch.testing.assert_close(out, ref_rms_norm(x, weight, EPS), rtol=4e-7, atol=0)
    torch.testing.assert_close(out, basic_ops.rms_norm_torch(x, weight, EPS), rtol=4e-7, atol=0)
    exact = torch.equal(out, basic_ops.rms_norm_torch(x, weight, EPS))
    print(f"fp32 {shape}: bit-exact vs rms_norm_torch: {exact}")


@needs_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_low_precision_cuda(shape, dtype):
    x, weight = make_norm_inputs(shape, dtype, "cuda")
    out = rms_norm_triton(x, weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within_one_ulp(out, ref_rms_norm(x, weight, EPS))
    assert_within_one_ulp(out, basic_ops.rms_norm_torch(x, weight, EPS))


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rms_norm_3d_qk_views_cuda(dtype):
    """Qwen3 q/k norms: [tokens, heads, head_dim] views of a split qkv tensor."""
    q, k = make_qkv_views(11, 16, 8, 128, dtype, "cuda")
    weight = make_norm_inputs((128,), dtype, "cuda")[1]
    for x in (q, k):
        before = x.clone()
        out = basic_ops.rms_norm(x, weight, EPS)
        assert out.shape == x.shape and torch.equal(x, before)
        ref = ref_rms_norm(x, weight, EPS)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=4e-7, atol=0)
        else:
            assert_within_one_ulp(out, ref)


def check_add_rms_norm(shape, dtype, device):
    """The residual's sum bit for bit as torch's add; its norm as rms_norm_triton of that sum (bit for bit)
    and within the reference's tolerance; inputs untouched. y is a column slice (a row stride of its own)."""
    x, weight = make_norm_inputs(shape, dtype, device)
    y = make_norm_inputs((shape[0], shape[1] + 3), dtype, device, seed=4)[0][:, 3:]
    x_before, y_before = x.clone(), y.clone()
    total, out = add_rms_norm_triton(x, y, weight, EPS)
    assert torch.equal(total, x + y)
    assert torch.equal(out, rms_norm_triton(x + y, weight, EPS))
    assert torch.equal(x, x_before) and torch.equal(y, y_before)
    ref = ref_rms_norm(x + y, weight, EPS)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-7, atol=0)
    else:
        assert_within_one_ulp(out, ref)


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm_cuda(shape, dtype):
    check_add_rms_norm(shape, dtype, "cuda")
    # the dispatcher takes the kernel on CUDA; on CPU tensors the torch code (x + y, then rms_norm)
    x, weight = make_norm_inputs(shape, dtype, "cuda")
    y = make_norm_inputs(shape, dtype, "cuda", seed=5)[0]
    total, out = basic_ops.add_rms_norm(x, y, weight, EPS)
    assert torch.equal(total, x + y) and torch.equal(out, basic_ops.rms_norm(x + y, weight, EPS))


@needs_cuda
def test_fallbacks_keep_torch_semantics_cuda():
    """Mixed dtypes take the torch path (type promotion), so results equal the torch code."""
    x, weight = make_norm_inputs((4, 576), torch.bfloat16, "cuda")
    assert torch.equal(basic_ops.rms_norm(x, weight.float(), EPS), basic_ops.rms_norm_torch(x, weight.float(), EPS))
    q, _ = make_qkv_views(3, 9, 3, 64, torch.bfloat16, "cuda")
    cos, sin = make_cos_sin(3, 64, torch.float32, "cuda")
    assert torch.equal(basic_ops.apply_rotary(q, cos, sin), basic_ops.apply_rotary_torch(q, cos, sin))


@needs_cuda
def test_cuda_graph_capture():
    """Both ops capture into a CUDA graph and replay on new inputs written in place."""
    dtype, tokens = torch.bfloat16, 4
    q, _ = make_qkv_views(tokens, 9, 3, 64, dtype, "cuda")
    cos, sin = make_cos_sin(tokens, 64, dtype, "cuda")
    x, weight = make_norm_inputs((tokens, 576), dtype, "cuda")
    basic_ops.rms_norm(x, weight, EPS), basic_ops.apply_rotary(q, cos, sin)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed = basic_ops.rms_norm(x, weight, EPS)
        rotated = basic_ops.apply_rotary(q, cos, sin)
    new_q, _ = make_qkv_views(tokens, 9, 3, 64, dtype, "cuda", seed=5)
    new_x, _ = make_norm_inputs((tokens, 576), dtype, "cuda", seed=6)
    q.copy_(new_q)
    x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rotated, ref_rotary(q, cos, sin))
    assert_within_one_ulp(normed, ref_rms_norm(x, weight, EPS))


@needs_cuda
def test_rotary_cache_cuda_graph_capture():
    """The fused op captures into a CUDA graph and replays on new inputs written in place."""
    dtype, tokens = torch.bfloat16, 4
    q, k, v, k_cache, v_cache, slots = make_cache_inputs(tokens, 9, 3, 64, dtype, "cuda")
    cos, sin = make_cos_sin(tokens, 64, dtype, "cuda")
    basic_ops.rotary_and_cache_kv(q, k, v, cos, sin, k_cache, v_cache, slots)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotated = basic_ops.rotary_and_cache_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    nq, nk, nv, _, _, _ = make_cache_inputs(tokens, 9, 3, 64, dtype, "cuda", seed=7)
    q.copy_(nq), k.copy_(nk), v.copy_(nv)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_k, want_v = ref_rotary_cache(q, k, v, cos, sin, before_k, before_v, slots)
    assert torch.equal(rotated, want_q) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# ---------------------------------------------------------------- CPU interpreter (fp32)


@needs_triton_cpu
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_cache_interpreter_fp32(shape):
    tokens, q_heads, kv_heads, head_dim = shape
    q, k, v, k_cache, v_cache, slots = make_cache_inputs(tokens, q_heads, kv_heads, head_dim, torch.float32, "cpu")
    cos, sin = make_cos_sin(tokens, head_dim, torch.float32, "cpu")
    check_kv_only(k, v, k_cache.clone(), v_cache.clone(), slots, cos, sin)
    check_rotary_cache(q, k, v, k_cache, v_cache, slots, cos, sin)


@needs_triton_cpu
def test_rotary_cache_interpreter_contiguous_qk_fp32():
    """Qwen3: q and k come out of the q/k norms contiguous, v stays a view of qkv."""
    q, k, v, k_cache, v_cache, slots = make_cache_inputs(5, 16, 8, 128, torch.float32, "cpu")
    cos, sin = make_cos_sin(5, 128, torch.float32, "cpu")
    check_rotary_cache(q.contiguous(), k.contiguous(), v, k_cache, v_cache, slots, cos, sin)


@needs_triton_cpu
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_interpreter_fp32(shape):
    tokens, q_heads, kv_heads, head_dim = shape
    q, k = make_qkv_views(tokens, q_heads, kv_heads, head_dim, torch.float32, "cpu")
    cos, sin = make_cos_sin(tokens, head_dim, torch.float32, "cpu")
    for x in (q, k):
        assert torch.equal(apply_rotary_triton(x, cos, sin), ref_rotary(x, cos, sin))


@needs_triton_cpu
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_interpreter_fp32(shape):
    x, weight = make_norm_inputs(shape, torch.float32, "cpu")
    torch.testing.assert_close(rms_norm_triton(x, weight, EPS), ref_rms_norm(x, weight, EPS), rtol=4e-7, atol=0)


@needs_triton_cpu
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm_interpreter_fp32(shape):
    check_add_rms_norm(shape, torch.float32, "cpu")


@needs_triton_cpu
def test_rms_norm_interpreter_3d_view_fp32():
    q, _ = make_qkv_views(5, 16, 8, 128, torch.float32, "cpu")
    weight = make_norm_inputs((128,), torch.float32, "cpu")[1]
    torch.testing.assert_close(rms_norm_triton(q, weight, EPS), ref_rms_norm(q, weight, EPS), rtol=4e-7, atol=0)


def test_cpu_dispatch_uses_torch_code():
    """CPU tensors never take the Triton path: results equal the torch code exactly."""
    q, k, v, k_cache, v_cache, slots = make_cache_inputs(3, 9, 3, 64, torch.bfloat16, "cpu")
    cos, sin = make_cos_sin(3, 64, torch.bfloat16, "cpu")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[slots] = basic_ops.apply_rotary_torch(k, cos, sin)
    want_v[slots] = v
    got_q = basic_ops.rotary_and_cache_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, basic_ops.apply_rotary_torch(q, cos, sin))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert basic_ops.rotary_and_cache_kv(None, k, v, cos, sin, k_cache, v_cache, slots) is None
    q, _ = make_qkv_views(3, 9, 3, 64, torch.bfloat16, "cpu")
    cos, sin = make_cos_sin(3, 64, torch.bfloat16, "cpu")
    assert torch.equal(basic_ops.apply_rotary(q, cos, sin), basic_ops.apply_rotary_torch(q, cos, sin))
    x, weight = make_norm_inputs((4, 576), torch.bfloat16, "cpu")
    assert torch.equal(basic_ops.rms_norm(x, weight, EPS), basic_ops.rms_norm_torch(x, weight, EPS))
    y = make_norm_inputs((4, 576), torch.bfloat16, "cpu", seed=5)[0]
    total, out = basic_ops.add_rms_norm(x, y, weight, EPS)
    assert torch.equal(total, x + y) and torch.equal(out, basic_ops.rms_norm_torch(x + y, weight, EPS))


# ---------------------------------------------------------------- sm_90 compile

TRITON_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
NORM_DIMS = [64, 128, 576, 4096]
ROTARY_CASES = [(9, 64), (3, 64), (16, 128), (8, 128)]  # (heads, head_dim)
ROTARY_CACHE_CASES = [(9, 3, 64), (16, 8, 128), (32, 8, 128)]  # (q_heads, kv_heads, head_dim)
ROTARY_CACHE_STRIDES = ["stride_q_token", "stride_q_head", "stride_k_token", "stride_k_head", "stride_v_token",
                        "stride_v_head", "stride_cs_token", "stride_qo_token", "stride_qo_head", "stride_kc_slot",
                        "stride_kc_head", "stride_vc_slot", "stride_vc_head"]


def compile_cases() -> dict:
    cases = {}
    for name, ptr in TRITON_TYPES.items():
        for dim in NORM_DIMS:
            cases[f"rms_norm-{name}-{dim}"] = ("rms_norm", ptr, dim, None)
            cases[f"add_rms_norm-{name}-{dim}"] = ("add_rms_norm", ptr, dim, None)
        for heads, head_dim in ROTARY_CASES:
            cases[f"rotary-{name}-{heads}x{head_dim}"] = ("rotary", ptr, head_dim, heads)
        for q_heads, kv_heads, head_dim in ROTARY_CACHE_CASES:
            cases[f"rotary_cache-{name}-{q_heads}/{kv_heads}x{head_dim}"] = ("rotary_cache", ptr, head_dim, (q_heads, kv_heads))
    return cases


def _compile_all() -> dict:
    """Runs in the child: name -> {"status": "ok" or the error, "fma": PTX has an fp32 fma}."""
    import triton

    from lightllm.common.basemodel.triton_kernel import fused_norm_rotary as k
    from unit_tests.triton_compile_util import compile_for_sm90

    results = {}
    for name, (kind, ptr, dim, heads) in compile_cases().items():
        if kind == "rms_norm":
            kernel = k._rms_norm_kernel
            signature = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "stride_x_outer": "i64", "stride_x_inner": "i64",
                         "stride_out_outer": "i64", "stride_out_inner": "i64", "dim": "i32", "inv_dim": "fp32",
                         "eps": "fp32", "BLOCK": "constexpr"}
            constexprs = {"BLOCK": triton.next_power_of_2(dim)}
        elif kind == "add_rms_norm":
            kernel = k._add_rms_norm_kernel
            signature = {**{n: ptr for n in ("x_ptr", "y_ptr", "w_ptr", "sum_ptr", "out_ptr")},
                         **{n: "i64" for n in ("stride_x", "stride_y", "stride_sum", "stride_out")},
                         "dim": "i32", "inv_dim": "fp32", "eps": "fp32", "BLOCK": "constexpr"}
            constexprs = {"BLOCK": triton.next_power_of_2(dim)}
        elif kind == "rotary_cache":
            kernel = k._rotary_cache_kernel
            q_heads, kv_heads = heads
            signature = {**{n: ptr for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "q_out_ptr",
                                             "k_cache_ptr", "v_cache_ptr")}, "slot_ptr": "*i64",
                         **{n: "i32" for n in ROTARY_CACHE_STRIDES}, "q_heads": "i32", "kv_heads": "i32", "half": "i32",
                         "BLOCK_QH": "constexpr", "BLOCK_KH": "constexpr", "BLOCK_HALF": "constexpr"}
            constexprs = {"BLOCK_QH": triton.next_power_of_2(q_heads), "BLOCK_KH": triton.next_power_of_2(kv_heads),
                          "BLOCK_HALF": triton.next_power_of_2(dim // 2)}
        else:
            kernel = k._rotary_kernel
            signature = {"x_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr, "out_ptr": ptr, "stride_x_token": "i32",
                         "stride_x_head": "i32", "stride_cs_token": "i32", "stride_out_token": "i32",
                         "stride_out_head": "i32", "num_heads": "i32", "half": "i32",
                         "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr"}
            constexprs = {"BLOCK_H": triton.next_power_of_2(heads), "BLOCK_HALF": triton.next_power_of_2(dim // 2)}
        try:
            # with the launch option the wrappers use
            ptx = compile_for_sm90(kernel, signature, constexprs, {"enable_fp_fusion": False}).asm["ptx"]
            results[name] = {"status": "ok", "fma": "fma.rn.f32" in ptx}
        except Exception as e:  # reported by the test of this case
            results[name] = {"status": f"{type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def compile_results() -> dict:
    return compile_in_child("unit_tests.common.basemodel.triton_kernel.test_fused_norm_rotary")


@pytest.mark.parametrize("name", list(compile_cases()))
def test_kernel_compiles_for_sm90(compile_results, name):
    assert compile_results[name]["status"] == "ok"
    # Bit-exactness needs every product rounded before the add: no contraction into fma.
    assert not compile_results[name]["fma"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
