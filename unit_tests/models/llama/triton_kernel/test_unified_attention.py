"""The unified attention kernel against the readable reference (attention_reference.py).

CPU cases run Triton's interpreter on small shapes; the CUDA cases add long KV (up to 8k),
head_dim 128, bf16 / fp16 and a CUDA graph replay. Every batch mixes runs of one request:
prefill chunks (including ones after a cached prefix), single decode rows, MTP's K + 1 rows,
dspark-style block rows that all see the same keys, and slot tables that are not contiguous.
"""
import dataclasses

import pytest
import torch

from lightllm.models.llama.triton_kernel.unified_attention import (
    BLOCK_N,
    DECODE_SPLIT_KEYS,
    DYNAMIC_MAX_SPLITS,
    MAX_BLOCK_M,
    MAX_KV_SPLITS,
    MIN_BLOCK_M,
    SMALL_GRID_MAX_KV_SPLITS,
    block_shape,
    decode_max_splits,
    dynamic_split_programs,
    launch_config,
    length_split_work,
    plan_attention,
    plan_split_rows,
    unified_attention,
    with_block_rows,
)
from unit_tests.devices import KERNEL_DEVICES, needs_cuda, needs_triton_cpu
from unit_tests.models.llama.triton_kernel.attention_reference import make_batch, reference_attention

pytestmark = pytest.mark.spread  # kernel variants to compile, no shared fixtures: one test per worker

FP32_ATOL = 2e-5
HALF_ATOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
MTP_ROWS = 4  # K + 1 with K = 3
# (request, keys seen by the first row, rows): a first chunk crossing tile borders, a decode row,
# MTP rows, a later chunk over a cached prefix, a one-key row.
SMALL_RUNS = ((0, 1, BLOCK_N + 3), (1, 130, 1), (2, BLOCK_N - 2, MTP_ROWS), (3, 100, 20), (4, 1, 1))
# The same on long KV (CUDA): 8k decode rows, MTP rows at 1k and 8k, a 2k chunk after a 6k prefix.
LONG_RUNS = ((0, 1, 700), (1, 8192, 1), (2, 1021, MTP_ROWS), (3, 6000, 2048), (4, 8189, MTP_ROWS), (5, 1, 1))


def _run(batch, max_q_len, deterministic=False, max_runs=None):
    plan = plan_attention(batch.row_req_idx, batch.row_seq_len, batch.q.shape[1], batch.k_cache.shape[1], max_q_len,
                          batch.num_runs if max_runs is None else max_runs, deterministic)
    scale = batch.q.shape[2] ** -0.5
    return unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, plan, scale), plan, scale


# (q_heads, kv_heads, head_dim): MHA, GQA 3 with head_dim not a power of two, GQA 4, GQA 8
CPU_SHAPES = [(2, 2, 16), (6, 2, 20), (8, 1, 32)]


@needs_triton_cpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", CPU_SHAPES)
@pytest.mark.parametrize("hint", ["runs", "one_row", "deterministic"])
def test_matches_reference_fp32_cpu(q_heads, kv_heads, head_dim, hint):
    """Blocks sized for the longest run, one-row blocks over decode-sized runs (few programs: the KV
    is split), and the deterministic plan."""
    runs = SMALL_RUNS[1:] if hint == "one_row" else SMALL_RUNS
    batch = make_batch(runs, q_heads, kv_heads, head_dim, torch.float32, "cpu")
    max_q_len = {"runs": batch.max_q_len, "one_row": 1, "deterministic": batch.max_q_len}[hint]
    out, plan, scale = _run(batch, max_q_len, deterministic=hint == "deterministic")
    assert (plan.num_kv_splits > 1 and not plan.dynamic_splits) == (hint == "one_row")
    assert plan.dynamic_splits == (hint == "runs")
    torch.testing.assert_close(out.float(), batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)


def test_length_split_work_by_hand():
    """Blocks of 100, 4000, none (-1) and 50 keys over 10 programs: 4150 keys over the 7 programs left after
    one per block -> 593 keys a split; the 4000-key block takes 7 consecutive programs, the others one (a
    block of no keys too: it writes zeros)."""
    work = length_split_work(torch.tensor([100, 4000, -1, 50], dtype=torch.int32), 10, max_splits=8, min_keys=64)
    assert work.tolist() == [[0, 0, 1]] + [[1, s, 7] for s in range(7)] + [[3, 0, 1], [-1, 0, 0]]
    assert length_split_work(torch.tensor([0, -1], dtype=torch.int32), 3).tolist() == [[0, 0, 1]] + [[-1, 0, 0]] * 2
    # at least min_keys a split, at most max_splits, and a batch of short blocks does not split
    assert length_split_work(torch.tensor([4000], dtype=torch.int32), 40, max_splits=8, min_keys=64)[:, 2].max() == 8
    short = length_split_work(torch.full((64,), DECODE_SPLIT_KEYS, dtype=torch.int32), 128)
    assert short[:64, 2].tolist() == [1] * 64 and short[:64, 0].tolist() == list(range(64))


def test_with_block_rows_by_hand():
    """Items of blocks 0, 0, 2 and none: each gets its block's first row, that row's request and the block's
    keys; an item past the list gets (-1, 0, 0)."""
    work = torch.tensor([[0, 0, 2], [0, 1, 2], [2, 0, 1], [-1, 0, 0]], dtype=torch.int32)
    first = torch.tensor([0, -1, 5], dtype=torch.int32)
    row_req_idx = torch.tensor([7, 7, 7, 7, 3, 9, 9], dtype=torch.int64)
    block_len = torch.tensor([900, -1, 41], dtype=torch.int32)
    assert with_block_rows(work, first, row_req_idx, block_len).tolist() == [
        [0, 0, 2, 0, 7, 900], [0, 1, 2, 0, 7, 900], [2, 0, 1, 5, 9, 41], [-1, 0, 0, -1, 0, 0]]


def test_length_split_work_spare_share_by_hand():
    """The spare share is max(blocks used, fill_programs), at most the programs left after one per block.
    64 blocks of 1024 keys in a list of 128 (an MTP plan's room) over 256 programs, 33 fill the GPU: the
    share is 64, 1024 keys a split, no block splits; over all 192 programs left it would be 342 keys a
    split, 3 splits a block (a full grid split for nothing)."""
    lens = torch.tensor([1024] * 64 + [-1] * 64, dtype=torch.int32)
    assert length_split_work(lens, 256, 33)[:64, 2].tolist() == [1] * 64
    assert length_split_work(lens, 256)[:64, 2].tolist() == [3] * 64
    # batch 1: the share is the 33 that fill the GPU (all the programs left): 8192 / 33 -> 256 keys, 32 splits
    one = length_split_work(torch.tensor([8192, -1], dtype=torch.int32), 35, 33, max_splits=32)
    assert one[:32].tolist() == [[0, s, 32] for s in range(32)] and one[32:].tolist() == [[-1, 0, 0]] * 3
    # a fill past the programs left takes what is left: 4 x 600 keys over 2 spare programs -> 1200 keys a split
    few = length_split_work(torch.tensor([600] * 4, dtype=torch.int32), 6, 10, min_keys=64)
    assert few[:4, 2].tolist() == [1] * 4


def test_length_split_work_fits_its_programs():
    """Random lengths: every block with keys gets its splits (consecutive, 0..n-1) inside the programs."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        blocks = int(torch.randint(1, 70, (1,), generator=gen))
        lens = torch.randint(0, 9000, (blocks,), generator=gen, dtype=torch.int32)
        lens[torch.rand(blocks, generator=gen) < 0.3] = -1
        programs = blocks + int(torch.randint(1, 200, (1,), generator=gen))
        fill = None if trial % 2 else int(torch.randint(1, 300, (1,), generator=gen))
        work = length_split_work(lens, programs, fill).tolist()
        got = {}
        for block, split, n in work:
            if block >= 0:
                got.setdefault(block, []).append((split, n))
        assert set(got) == {b for b in range(blocks) if lens[b] >= 0}, trial
        for block, items in got.items():
            n = items[0][1]
            assert items == [(s, n) for s in range(n)], (trial, block)


@needs_triton_cpu
def test_long_rows_among_short_ones_split_by_length_cpu():
    """Decode rows and MTP rows of very different lengths: the long blocks split (more than one work item),
    the short ones do not, and the merged result is the reference's."""
    runs = ((0, 900, 1), (1, 3, 1), (2, 40, MTP_ROWS), (3, 700, MTP_ROWS), (4, 1, 1), (5, 60, 1))
    batch = make_batch(runs, 6, 2, 20, torch.float32, "cpu")
    for max_q_len in (1, MTP_ROWS):
        if max_q_len == 1:
            batch.num_runs = len(batch.row_req_idx)  # one-row blocks: every row is its own run
        out, plan, scale = _run(batch, max_q_len)
        splits = {}
        req, lens, firsts = batch.row_req_idx.tolist(), batch.row_seq_len.tolist(), plan.block_first_row.tolist()
        for block, _, n, first, item_req, keys in plan.work.tolist():
            if block >= 0:
                splits[block] = n
                # the block's own rows (from its first, one request, at most block_q): first row, request, keys
                rows = [r for r in range(firsts[block], min(firsts[block] + plan.block_q, len(req)))
                        if req[r] == req[firsts[block]]]
                assert (first, item_req, keys) == (firsts[block], req[first], max(lens[r] for r in rows))
            else:
                assert first == -1
        assert max(splits.values()) > 1 and min(splits.values()) == 1, splits
        torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)
        assert not plan.split_counter.any()  # the merging split reset them for the next launch
        again = unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, plan, scale)
        assert torch.equal(again, out)


def test_small_grids_split_further():
    """Where MAX_KV_SPLITS splits per block leave SMs without a program (batch 1-2 on few KV heads), a block
    may split SMALL_GRID_MAX_KV_SPLITS ways; a grid that fills the SMs keeps MAX_KV_SPLITS."""
    sms = 132
    assert decode_max_splits(1, 3, sms) == decode_max_splits(2, 3, sms) == SMALL_GRID_MAX_KV_SPLITS  # 48, 96 < 132
    assert decode_max_splits(1, 8, sms) == SMALL_GRID_MAX_KV_SPLITS  # 128 < 132
    assert decode_max_splits(3, 3, sms) == decode_max_splits(16, 3, sms) == MAX_KV_SPLITS  # 144, 768
    assert decode_max_splits(2, 8, sms) == MAX_KV_SPLITS
    # small grids also take one more pipeline stage; a wide tile of a fuller grid (8B batch 16) does not
    small = launch_config(MIN_BLOCK_M, 128, wide=True, small=True)
    assert (small.num_stages, small.block_n) == (3, 2 * BLOCK_N)
    assert launch_config(MIN_BLOCK_M, 128, wide=True).num_stages == 2
    assert launch_config(MIN_BLOCK_M, 128, wide=True, elem_bytes=4, small=True).num_stages == 2  # fp32: same smem


@needs_triton_cpu
def test_one_long_row_splits_past_max_kv_splits_cpu():
    """One decode row over SMALL_GRID_MAX_KV_SPLITS * DECODE_SPLIT_KEYS keys: the plan splits it that many
    ways (more than MAX_KV_SPLITS), and the merged result is the reference's."""
    keys = SMALL_GRID_MAX_KV_SPLITS * DECODE_SPLIT_KEYS
    batch = make_batch(((0, keys, 1),), 2, 1, 16, torch.float32, "cpu")
    out, plan, scale = _run(batch, 1)
    assert plan.num_kv_splits == SMALL_GRID_MAX_KV_SPLITS > MAX_KV_SPLITS and plan.small_grid
    assert max(n for block, _, n, *_ in plan.work.tolist() if block >= 0) == SMALL_GRID_MAX_KV_SPLITS
    torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)
    assert not plan.split_counter.any()


@needs_triton_cpu
@pytest.mark.parametrize("spare", ["empty_blocks", "helpers"])
def test_dynamic_splits_match_reference_cpu(spare):
    """Prefill-shaped blocks that split their KV on the device (a split per BLOCK_N keys here, so
    small shapes split) with the programs of blocks that hold no rows (``empty_blocks``: as many blocks
    as rows, a rows graph's plan) or, in a plan with room for its runs only (an eager chunk), the helper
    programs past its blocks (``helpers``): chunks after a cached prefix, blocks past the partial-sum
    room (they do not split), and rows of one block that see different key counts."""
    q_heads, kv_heads, head_dim = CPU_SHAPES[1]  # GQA 3, head_dim not a power of two (the CUDA tests take more)
    batch = make_batch(SMALL_RUNS, q_heads, kv_heads, head_dim, torch.float32, "cpu")
    rows = batch.q.shape[0]
    max_seqs = rows if spare == "empty_blocks" else len(SMALL_RUNS)
    plan = plan_attention(batch.row_req_idx, batch.row_seq_len, q_heads, kv_heads, batch.max_q_len, max_seqs)
    assert plan.dynamic_splits
    blocks = plan.block_first_row.shape[0]
    if spare == "helpers":  # a few empty blocks (the runs' slack), most spare programs are helpers
        assert plan.dynamic_programs == dynamic_split_programs(blocks, kv_heads, head_dim) > blocks
    scale = head_dim ** -0.5
    for part_blocks in (plan.num_part_blocks, 1):
        forced = dataclasses.replace(plan, split_keys=BLOCK_N, num_part_blocks=part_blocks)
        out = unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, forced, scale)
        torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)


def _rows_of(plan, rows: int):
    """Every row each block of ``plan`` computes (the kernel's rule: the block's first BLOCK_Q rows that
    share its first row's sequence)."""
    start, out = plan.row_seq_start.tolist(), []
    for first in plan.block_first_row.tolist():
        if first >= 0:
            out += [r for r in range(first, min(first + plan.block_q, rows)) if start[r] == start[first]]
    return out


def _split_rows_case(decode, chunks, q_len, q_heads, kv_heads, head_dim, dtype, device):
    """A mixed step's rows (decode runs of ``q_len`` rows first, then prompt chunks) through the two plans
    of ``plan_split_rows`` into one output; returns (out, plans, batch, scale)."""
    batch = make_batch(decode + chunks, q_heads, kv_heads, head_dim, dtype, device)
    rows = batch.q.shape[0]
    head_rows = torch.tensor([len(decode) * q_len], dtype=torch.int32, device=device)
    plans = plan_split_rows(batch.row_req_idx, batch.row_seq_len, q_heads, kv_heads, head_rows, q_len,
                            max(len(decode), 1), rows, rows, head_dim)
    scale = head_dim ** -0.5
    out = None
    for plan in plans:
        out = unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, plan, scale, out)
    return out, plans, batch, scale


@needs_triton_cpu
@pytest.mark.parametrize("q_len", [1, MTP_ROWS])
def test_split_rows_plans_match_reference_cpu(q_len):
    """A mixed step: decode runs (one long enough to split by length) then prompt chunks (one after a
    cached prefix), planned apart into one output: the reference's; the decode rows in small tiles, the
    chunks in tall ones, every row in exactly one plan; a step with no decode rows too."""
    decode = ((0, 900, q_len), (1, 3, q_len), (2, 70, q_len))
    chunks = ((3, 1, BLOCK_N + 3), (4, 100, 20), (5, 1, 1))
    q_heads, kv_heads, head_dim = CPU_SHAPES[1]
    for dec in (decode, ()):
        out, (head, rest), batch, scale = _split_rows_case(dec, chunks, q_len, q_heads, kv_heads, head_dim,
                                                           torch.float32, "cpu")
        rows = batch.q.shape[0]
        d = len(dec) * q_len
        assert head.block_q == q_len and head.work is not None and rest.block_q > q_len
        assert sorted(_rows_of(head, rows)) == list(range(d))
        assert sorted(_rows_of(rest, rows)) == list(range(d, rows))
        if dec:
            assert int(head.work[:, 2].max()) > 1  # the 900-key run splits
        torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)


@needs_triton_cpu
def test_block_rows_that_see_the_same_keys_cpu():
    """dspark's block pass: every row of a run sees the whole block (equal lengths)."""
    batch = make_batch(((0, 70, 4), (1, 3, 4), (2, 130, 4)), 6, 2, 16, torch.float32, "cpu", same_len=True)
    out, _, scale = _run(batch, 4)
    torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)


@needs_triton_cpu
def test_fp16_cpu():
    batch = make_batch(SMALL_RUNS[:3], 4, 2, 16, torch.float16, "cpu")
    out, _, scale = _run(batch, batch.max_q_len)
    torch.testing.assert_close(out.float(), batch.reference(scale), atol=HALF_ATOL[torch.float16], rtol=0)


@needs_triton_cpu
def test_empty_rows_give_zeros_and_stride0_rows_read_as_values_cpu():
    """Rows that see no key (length 0) write zeros; one request's rows given as stride-0 views."""
    batch = make_batch(((0, 5, 3),), 4, 2, 16, torch.float32, "cpu")
    batch.row_seq_len = torch.tensor([0], dtype=torch.int32).expand(3)
    out, _, _ = _run(batch, 3)
    assert torch.equal(out, torch.zeros_like(out))
    batch.row_req_idx = torch.tensor([0]).expand(3)
    batch.row_seq_len = torch.tensor([7], dtype=torch.int32).expand(3)
    out, _, scale = _run(batch, 3)
    torch.testing.assert_close(out, batch.reference(scale), atol=FP32_ATOL, rtol=FP32_ATOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_plan_cuts_runs_into_blocks(device):
    """Hand-computed: runs of requests 7, 7, 7 | 2, 2 | 7 (a new run: not adjacent to the first) | 5
    with 2 rows per block; every row is in exactly one block, and an unused entry is -1."""
    req = torch.tensor([7, 7, 7, 2, 2, 7, 5], device=device)
    lens = torch.tensor([3, 4, 5, 9, 9, 1, 2], dtype=torch.int32, device=device)
    plan = plan_attention(req, lens, q_heads=8, kv_heads=1, max_q_len=2, max_seqs=4)
    assert (plan.block_q, plan.block_m) == (2, 16)
    assert plan.row_seq_start.tolist() == [0, 0, 0, 3, 3, 5, 6]
    first = plan.block_first_row.tolist()
    assert first[:5] == [0, 2, 3, 5, 6] and set(first[5:]) <= {-1}
    det = plan_attention(req, lens, q_heads=8, kv_heads=1, max_q_len=2, max_seqs=4, deterministic=True)
    assert det.block_q == 1 and det.block_first_row.tolist() == list(range(7)) and det.num_kv_splits == 1


def test_block_shape():
    assert block_shape(group=3, max_q_len=1, deterministic=False) == (1, 16)
    assert block_shape(group=3, max_q_len=MTP_ROWS, deterministic=False) == (4, 16)
    assert block_shape(group=4, max_q_len=8192, deterministic=False) == (32, MAX_BLOCK_M)
    assert block_shape(group=3, max_q_len=8192, deterministic=False) == (42, MAX_BLOCK_M)  # 126 of 128 tile rows
    assert block_shape(group=4, max_q_len=8192, deterministic=True) == (1, 16)


def test_rejects_bad_inputs():
    batch = make_batch(((0, 5, 3),), 4, 2, 16, torch.float32, "cpu")
    plan = plan_attention(batch.row_req_idx, batch.row_seq_len, 4, 2, 3, 1)
    args = (batch.k_cache, batch.v_cache, batch.req_to_token, plan, 0.25)
    with pytest.raises(ValueError, match="heads"):
        unified_attention(batch.q[:, :2], *args)
    with pytest.raises(ValueError, match="dtype"):
        unified_attention(batch.q.double(), *args)
    with pytest.raises(ValueError, match="rows"):
        unified_attention(batch.q[:2], *args)
    with pytest.raises(ValueError, match="int64"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token.int(), plan, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        unified_attention(batch.q.transpose(1, 2).contiguous().transpose(1, 2), *args)
    with pytest.raises(ValueError, match="multiple"):
        plan_attention(batch.row_req_idx, batch.row_seq_len, 5, 2, 3, 1)


# (q_heads, kv_heads, head_dim): SmolLM2-135M, Qwen3-0.6B, Llama-3-8B, MHA, GQA 8
CUDA_SHAPES = [(9, 3, 64), (16, 8, 128), (32, 8, 128), (4, 4, 64), (16, 2, 128)]


@needs_cuda
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hint", ["runs", "one_row", "mtp", "deterministic"])
def test_matches_reference_long_kv_cuda(q_heads, kv_heads, head_dim, dtype, hint):
    batch = make_batch(LONG_RUNS, q_heads, kv_heads, head_dim, dtype, "cuda", seed=q_heads)
    max_q_len = {"runs": batch.max_q_len, "one_row": 1, "mtp": MTP_ROWS, "deterministic": 1}[hint]
    out, _, scale = _run(batch, max_q_len, deterministic=hint == "deterministic")
    atol = FP32_ATOL * 10 if dtype == torch.float32 else HALF_ATOL[dtype]
    torch.testing.assert_close(out.float(), batch.reference(scale), atol=atol, rtol=0)


@needs_cuda
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", CUDA_SHAPES[:3])
@pytest.mark.parametrize("q_len", [1, MTP_ROWS])
def test_split_rows_plans_long_kv_cuda(q_heads, kv_heads, head_dim, q_len):
    """A serving-like mixed step in bf16: decode rows at 8k and 3k keys among short ones, a 2k chunk after a
    6k prefix and a short prompt; the two plans' output is the reference's,."""
    decode = ((0, 8189, q_len), (1, 40, q_len), (2, 3000, q_len), (3, 300, q_len))
    chunks = ((4, 6000, 2048), (5, 1, 150))
    out, plans, batch, scale = _split_rows_case(decode, chunks, q_len, q_heads, kv_heads, head_dim, torch.bfloat16,
                                                "cuda")
    torch.testing.assert_close(out.float(), batch.reference(scale), atol=HALF_ATOL[torch.bfloat16], rtol=0)
    assert all(not p.split_counter.any() for p in plans if p.split_counter is not None)


@needs_cuda
def test_deterministic_rows_do_not_depend_on_their_batch_cuda():
    """A row's output is bitwise the same alone, in a big batch, or as one of MTP's rows."""
    batch = make_batch(LONG_RUNS, 32, 8, 128, torch.bfloat16, "cuda")
    out, _, _ = _run(batch, 1, deterministic=True)
    for row in (0, 700, 701, 703, 2000):
        alone = make_batch(LONG_RUNS, 32, 8, 128, torch.bfloat16, "cuda")
        alone.q, alone.row_req_idx, alone.row_seq_len = (t[row:row + 1] for t in (batch.q, batch.row_req_idx,
                                                                                  batch.row_seq_len))
        alone.num_runs = 1
        got, _, _ = _run(alone, 1, deterministic=True)
        assert torch.equal(got[0], out[row])


def _graph_replay_equals_eager(batch, q_heads: int, kv_heads: int, max_q_len: int, max_seqs: int, shifts) -> None:
    """The plan and the kernel captured in a graph, replayed on the lengths shifted by each of
    ``shifts``: bit-exact with eager, and the reference's values."""
    lens = batch.row_seq_len.clone()
    scale = batch.q.shape[2] ** -0.5

    def step():
        plan = plan_attention(batch.row_req_idx, lens, q_heads, kv_heads, max_q_len, max_seqs)
        return unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, plan, scale)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for shift in shifts:
        lens.copy_((batch.row_seq_len + shift).clamp(min=1))
        graph.replay()
        assert torch.equal(out, step())
        torch.testing.assert_close(
            out.float(),
            reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.row_req_idx, lens,
                                scale),
            atol=HALF_ATOL[torch.bfloat16], rtol=0)


@needs_cuda
def test_cuda_graph_replay_equals_eager_cuda():
    """The plan and the kernel captured in a graph, replayed on new lengths: bit-exact with eager."""
    batch = make_batch(((0, 3000, MTP_ROWS), (1, 50, MTP_ROWS), (2, 8000, MTP_ROWS)), 32, 8, 128, torch.bfloat16,
                       "cuda")
    _graph_replay_equals_eager(batch, 32, 8, MTP_ROWS, batch.num_runs, (0, -1000, -7990))  # within the slot table

@needs_cuda
def test_length_splits_are_stable_cuda():
    """Decode rows at 8192 keys among short ones, and one row alone (32 splits): 200 launches of one plan
    give one result bit for bit, whichever split merges, and leave the counters at zero."""
    for runs in (((0, 8192, 1), (1, 40, 1), (2, 5000, 1), (3, 7, 1)), ((0, 8192, 1),)):
        batch = make_batch(runs, 32, 8, 128, torch.bfloat16, "cuda")
        plan = plan_attention(batch.row_req_idx, batch.row_seq_len, 32, 8, 1, len(runs))
        assert int(plan.work[:, 2].max()) > 1
        scale = batch.q.shape[2] ** -0.5
        args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, plan, scale)
        first = unified_attention(*args)
        assert all(torch.equal(first, unified_attention(*args)) for _ in range(200))
        assert not plan.split_counter.any()
        torch.testing.assert_close(first.float(), batch.reference(scale), atol=HALF_ATOL[torch.bfloat16], rtol=0)


@needs_cuda
def test_decode_graph_replay_equals_eager_cuda():
    """Decode rows captured once, replayed on lengths that split differently: bit-exact with eager."""
    batch = make_batch(tuple((i, 8192 - 37 * i if i % 3 == 0 else 100 + i, 1) for i in range(9)), 32, 8, 128,
                       torch.bfloat16, "cuda")
    _graph_replay_equals_eager(batch, 32, 8, 1, 9, (0, -4000, -99))


# Few rows over long KV, planned as the rows graphs plan them (as many blocks as rows): the blocks that
# hold rows are few, so the others' programs read their KV splits (dynamic splits).
SHORT_CHUNKS_LONG_KV = ((0, 6001, 52), (1, 8192, 1), (2, 3000, 200), (3, 1021, MTP_ROWS))


@needs_cuda
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dynamic_splits_long_kv_cuda(q_heads, kv_heads, head_dim, dtype):
    batch = make_batch(SHORT_CHUNKS_LONG_KV, q_heads, kv_heads, head_dim, dtype, "cuda", seed=kv_heads)
    rows = batch.q.shape[0]
    out, plan, scale = _run(batch, rows, max_runs=rows)
    assert plan.dynamic_splits
    atol = FP32_ATOL * 10 if dtype == torch.float32 else HALF_ATOL[dtype]
    torch.testing.assert_close(out.float(), batch.reference(scale), atol=atol, rtol=0)


@needs_cuda
def test_dynamic_splits_graph_replay_equals_eager_cuda():
    """A rows-graph plan with dynamic splits captured once, replayed on other lengths (more and
    fewer splits): bit-exact with eager, and the reference's values."""
    batch = make_batch(SHORT_CHUNKS_LONG_KV, 9, 3, 64, torch.bfloat16, "cuda")
    rows = batch.q.shape[0]
    _graph_replay_equals_eager(batch, 9, 3, rows, rows, (0, -900, -2990))  # within the slot table


def test_dynamic_split_programs_by_hand():
    """One program per block, then helpers up to the split target (132 SMs x 2 at head_dim 128, x 4 at 64,
    over the KV heads), at most DYNAMIC_MAX_SPLITS per block; a plan with more blocks keeps them."""
    assert dynamic_split_programs(14, 3, 64, 132) == 14 * DYNAMIC_MAX_SPLITS  # an eager 512-row chunk, embedded heads
    assert dynamic_split_programs(30, 3, 64, 132) == 176  # 528 programs over 3 KV heads
    assert dynamic_split_programs(17, 8, 128, 132) == 33  # the 8B heads
    assert dynamic_split_programs(300, 8, 128, 132) == 300
