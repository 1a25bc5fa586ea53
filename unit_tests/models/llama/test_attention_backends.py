"""attention_backends: one backend name picks the attention of every row, and the triton backend
(the unified kernel; Triton's interpreter on CPU) matches the torch attention on a chunked prefill
with a ready cache, GQA, and on MTP decode rows; the plan is built once per forward."""
import pytest
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.batch_objs import DecodeHead, ModelInput
from lightllm.common.basemodel.infer_struct import InferStateInfo
from lightllm.common.basemodel.layer_infer.torch_attention import paged_attention_torch
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.models.llama.layer_infer import attention_backends as ab
from lightllm.models.llama.triton_kernel.unified_attention import BLOCK_N as TOKEN_BLOCK
from unit_tests.devices import KERNEL_DEVICES

NUM_SLOTS = 400
MAX_SEQ_LEN = 192
Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 20  # GQA 3, head_dim not a power of two
FP32_ATOL = 1e-5
# (tokens already in the cache, new tokens) per item: a first chunk, later chunks whose
# positions cross the kernel's block size, a one-token chunk, and a HOLD padding item
# (DP prefill pads with these).
ITEMS = ((0, 9), (TOKEN_BLOCK - 3, 7), (2 * TOKEN_BLOCK + 5, 1), (40, 30))
HOLD_ITEM_TOKENS = 4


def _random_cache(device, gen) -> MemoryManager:
    """A one-layer KV pool with random K/V in every slot."""
    mem = MemoryManager(NUM_SLOTS, torch.float32, KV_HEADS, HEAD_DIM, 1, device)
    mem.k_buffer.copy_(torch.randn(mem.k_buffer.shape, generator=gen))
    mem.v_buffer.copy_(torch.randn(mem.v_buffer.shape, generator=gen))
    return mem


def _chunked_prefill_case(device="cpu", seed=0):
    """A prefill InferStateInfo over ITEMS plus a HOLD item, random K/V in every slot and random q."""
    gen = torch.Generator().manual_seed(seed)
    mem = _random_cache(device, gen)
    reqs = ReqManager(len(ITEMS), MAX_SEQ_LEN, mem, device)
    slots, req_idx, seq_len, ready = [], [], [], []
    for ready_len, new in ITEMS:
        r = reqs.alloc()
        table = mem.alloc(ready_len + new)[torch.randperm(ready_len + new, generator=gen)]  # scattered slots
        reqs.req_to_token_indexs[r, : ready_len + new] = table.to(device)
        slots.append(table[ready_len:])
        req_idx.append(r)
        seq_len.append(ready_len + new)
        ready.append(ready_len)
    slots.append(torch.full((HOLD_ITEM_TOKENS,), mem.HOLD_SLOT, dtype=torch.int64))
    req_idx.append(reqs.HOLD_REQUEST_ID)
    seq_len.append(HOLD_ITEM_TOKENS)
    ready.append(0)
    seq_cpu, ready_cpu = torch.tensor(seq_len, dtype=torch.int32), torch.tensor(ready, dtype=torch.int32)
    num_new = int((seq_cpu - ready_cpu).sum())
    model_input = ModelInput(
        batch_size=len(req_idx), total_token_num=int(seq_cpu.sum()), max_len_in_batch=int(seq_cpu.max()),
        input_ids=torch.zeros(num_new, dtype=torch.int64), mem_indexes=torch.cat(slots),
        b_req_idx=torch.tensor(req_idx, dtype=torch.int32), b_seq_len=seq_cpu, is_prefill=True,
        b_ready_cache_len=ready_cpu, b_seq_len_cpu=seq_cpu, b_ready_cache_len_cpu=ready_cpu,
    )
    state = InferStateInfo.from_model_input(model_input, mem, reqs, torch.device(device))
    q = torch.randn(num_new, Q_HEADS, HEAD_DIM, generator=gen).to(device)
    return q, mem.k_buffer[0], mem.v_buffer[0], state


def _rows_case(device, seed, runs, hold_rows, max_q_len, max_q_runs=None, decode_rows=None):
    """Rows (one new token each): ``runs`` of (keys seen by the first row, rows) per request, row j seeing one
    key more than row j - 1, then ``hold_rows`` HOLD padding rows; ``decode_rows``: the first rows are the
    forward's decode head (runs of ``max_q_len`` rows), the rest planned as ``max_q_runs`` runs."""
    gen = torch.Generator().manual_seed(seed)
    mem = _random_cache(device, gen)
    reqs = ReqManager(len(runs), MAX_SEQ_LEN, mem, device)
    req_idx, seq_len = [], []
    for first, n in runs:
        r = reqs.alloc()
        end = first + n - 1
        reqs.req_to_token_indexs[r, :end] = mem.alloc(end)[torch.randperm(end, generator=gen)].to(device)
        req_idx += [r] * n
        seq_len += list(range(first, first + n))
    req_idx += [reqs.HOLD_REQUEST_ID] * hold_rows
    seq_len += [1] * hold_rows
    rows = len(req_idx)
    seq_cpu = torch.tensor(seq_len, dtype=torch.int32)
    head = None
    if decode_rows is not None:
        head = DecodeHead(torch.tensor([decode_rows], dtype=torch.int32, device=device), max_q_len, len(runs))
    model_input = ModelInput(
        batch_size=rows, total_token_num=0, max_len_in_batch=int(seq_cpu.max()),
        input_ids=torch.zeros(rows, dtype=torch.int64), mem_indexes=torch.zeros(rows, dtype=torch.int64),
        b_req_idx=torch.tensor(req_idx, dtype=torch.int32), b_seq_len=seq_cpu, is_prefill=False,
        b_seq_len_cpu=seq_cpu, max_q_len=rows if head is not None else max_q_len,
        max_q_runs=max_q_runs if max_q_runs is not None else rows, decode_head=head,
    )
    state = InferStateInfo.from_model_input(model_input, mem, reqs, torch.device(device))
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=gen).to(device)
    return q, mem.k_buffer[0], mem.v_buffer[0], state


def _mtp_decode_case(device="cpu", seed=1, k1=4):
    """Decode rows: K + 1 rows per request (lengths L .. L + K), then two HOLD padding rows."""
    runs = [(length, k1) for length in (5, TOKEN_BLOCK + 7, 2 * TOKEN_BLOCK - 1)]
    return _rows_case(device, seed, runs, 2, k1, max_q_runs=len(runs) + 1)


def _mixed_rows_case(device="cpu", seed=2, k1=4):
    """A mixed step as rows: K + 1 decode rows per request, a prompt chunk after a cached prefix (one row per
    token), then HOLD padding rows; the decode rows are the forward's decode head."""
    runs = ((5, k1), (TOKEN_BLOCK + 7, k1), (TOKEN_BLOCK - 3, 2 * TOKEN_BLOCK))  # decode, decode, chunk
    return _rows_case(device, seed, runs, 3, k1, decode_rows=2 * k1)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", [_chunked_prefill_case, _mtp_decode_case, _mixed_rows_case])
def test_triton_attention_matches_torch(device, case):
    q, k_cache, v_cache, state = case(device)
    scale = HEAD_DIM**-0.5
    got = ab.triton_attention(q, k_cache, v_cache, state, scale)
    plans = state.attention_plan
    assert ab.triton_attention(q, k_cache, v_cache, state, scale) is not None and state.attention_plan is plans
    want = paged_attention_torch(q, k_cache, v_cache, state, scale)
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_ATOL)
    if case is _mixed_rows_case:  # the decode rows in K + 1-row blocks, the chunk and padding in tall ones
        assert [p.block_q for p in plans] == [4, 128 // 3] and plans[0].work is not None  # tile rows // GQA 3
    elif not state.is_prefill:
        assert len(plans) == 1 and plans[0].block_q == 4  # one block per request's K + 1 rows


def test_one_name_picks_the_attention():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object, no GPU needed
    assert ab.get_layer_ops("auto", cpu).attention is paged_attention_torch
    assert ab.get_layer_ops("auto", cuda).attention is ab.triton_attention  # the CUDA default
    assert ab.get_layer_ops("torch", cuda).attention is paged_attention_torch
    assert ab.get_layer_ops("triton", cpu).attention is ab.triton_attention
    for name, device in (("auto", cpu), ("auto", cuda), ("torch", cuda)):
        assert ab.get_layer_ops(name, device).linear is F.linear
    # deterministic inference: the deterministic triton plan whatever the name, batch-invariant linear layers
    det = ab.get_layer_ops("torch", cuda, deterministic=True)
    assert det.attention is ab.deterministic_triton_attention and det.linear is ab.batch_invariant_linear
    with pytest.raises(ValueError, match="valid names: auto, torch, triton"):
        ab.get_layer_ops("flash", cuda)
