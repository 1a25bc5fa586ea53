"""Triton decode attention against a readable PyTorch reference (interpreter on CPU)."""
import pytest
import torch

from unit_tests.devices import needs_triton_cpu

from lightllm.models.llama.triton_kernel.token_attention import TOKEN_BLOCK, token_decode_attention

NUM_SLOTS = 512
MAX_SEQ_LEN = 160
MAX_REQS = 4
FP32_ATOL = 1e-5
BF16_ATOL = 2e-2
# Boundary lengths around the kernel's block size; 0 is an empty padding row.
SEQ_LENS = (0, 1, TOKEN_BLOCK - 1, TOKEN_BLOCK, TOKEN_BLOCK + 1, 2 * TOKEN_BLOCK + 2)


def reference_decode_attention(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, sm_scale):
    """Row by row softmax(q k^T) v over the row's slots; an empty row gives zeros."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for row in range(q.shape[0]):
        n = int(b_seq_len[row])
        if n == 0:
            continue
        slots = req_to_token[int(b_req_idx[row]), :n]
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, q_heads, head_dim]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * sm_scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def _make_case(q_heads, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = len(SEQ_LENS)
    k_cache = torch.randn(NUM_SLOTS + 1, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(NUM_SLOTS + 1, kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, q_heads, head_dim, generator=gen)
    # Every request's positions map to scattered slots; rows share requests like MTP rows do.
    req_to_token = torch.stack([torch.randperm(NUM_SLOTS, generator=gen)[:MAX_SEQ_LEN] for _ in range(MAX_REQS + 1)])
    b_req_idx = torch.tensor([i % MAX_REQS for i in range(batch)], dtype=torch.int32)
    b_req_idx[0] = MAX_REQS  # the empty row points at the HOLD row
    b_seq_len = torch.tensor(SEQ_LENS, dtype=torch.int32)
    tensors = [t.to(device) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), req_to_token)]
    return tensors + [b_req_idx.to(device), b_seq_len.to(device), head_dim**-0.5]


@needs_triton_cpu
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim",
    [(4, 4, 16), (4, 1, 32), (6, 2, 20)],  # MHA, GQA 4, GQA 3 with head_dim not a power of two
)
def test_matches_reference_fp32(q_heads, kv_heads, head_dim):
    args = _make_case(q_heads, kv_heads, head_dim, torch.float32, "cpu")
    out = token_decode_attention(*args)
    torch.testing.assert_close(out, reference_decode_attention(*args), atol=FP32_ATOL, rtol=FP32_ATOL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_rejects_bad_inputs():
    q, k_cache, v_cache, table, b_req_idx, b_seq_len, scale = _make_case(4, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple"):
        token_decode_attention(q[:, :3], k_cache, v_cache, table, b_req_idx, b_seq_len, scale)
    with pytest.raises(ValueError, match="dtype"):
        token_decode_attention(q.double(), k_cache, v_cache, table, b_req_idx, b_seq_len, scale)
    with pytest.raises(ValueError, match="int64"):
        token_decode_attention(q, k_cache, v_cache, table.int(), b_req_idx, b_seq_len, scale)
    with pytest.raises(ValueError, match="contiguous"):
        strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # head_dim no longer contiguous
        token_decode_attention(strided_q, k_cache, v_cache, table, b_req_idx, b_seq_len, scale)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (16, 8, 128)])  # SmolLM2-135M, Qwen3-0.6B
def test_matches_reference_bf16_cuda(q_heads, kv_heads, head_dim):
    args = _make_case(q_heads, kv_heads, head_dim, torch.bfloat16, "cuda")
    out = token_decode_attention(*args)
    expected = reference_decode_attention(*args)
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@needs_triton_cpu
def test_expanded_row_indexes_read_as_their_values():
    """Rows of one request given as a stride-0 view (``x[:, None].expand(...).reshape(-1)`` of one
    request): the kernel indexes them flat, so the wrapper must not pass the view as it is."""
    q, k_cache, v_cache, table, _, _, scale = _make_case(4, 2, 16, torch.float32, "cpu")
    rows = q.shape[0]
    b_req_idx = torch.tensor([1], dtype=torch.int64)[:, None].expand(1, rows).reshape(-1)
    b_seq_len = torch.tensor([TOKEN_BLOCK + 3], dtype=torch.int32)[:, None].expand(1, rows).reshape(-1)
    assert b_req_idx.stride() == (0,) and b_seq_len.stride() == (0,)
    out = token_decode_attention(q, k_cache, v_cache, table, b_req_idx, b_seq_len, scale)
    expected = reference_decode_attention(q, k_cache, v_cache, table, b_req_idx.clone(), b_seq_len.clone(), scale)
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=FP32_ATOL)
