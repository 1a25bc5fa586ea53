"""One paged, variable-length attention kernel for every kind of row, in Triton.

A row is one query token: row r belongs to request ``row_req_idx[r]`` and attends to that
request's positions 0..``row_seq_len[r]`` - 1, read through the slot table
``req_to_token_indexs[req, pos]`` (page size 1). Consecutive rows of one request form a
sequence (a prefill chunk, MTP's K + 1 verify rows, a short prefill run as decode rows,
dspark's block rows); ``plan_attention`` cuts each sequence into query blocks of
``block_q`` rows, and one program reads a block's KV once for all its rows and for every
query head of one KV head (GQA packing: tile row m is query row m // group, head m % group).
Scores and the weighted sum are ``tl.dot`` tiles of [BLOCK_M rows, BLOCK_N positions]; the
softmax is online in fp32 (base 2).

Decode-shaped plans (small blocks: decode rows, MTP's verify rows, draft rows) split each
block's KV by its length (flash-decoding with a work list): ``plan_attention`` gives every block
about one share of the batch's keys per program of a fixed grid (more splits for a long row, one
for a short one, at most ``num_kv_splits``), so a few long requests in a batch of short ones no
longer hold the layer while one program walks their keys, and a batch of one fills the GPU. The
block's last split to finish merges them (a counter per block and KV head, which it resets), so no
second kernel launches. The work list is built on the device from the plan's tensors
(a fixed shape per row count), so a CUDA graph and the eager path run the same programs.

Prefill-shaped plans split on the device (``dynamic_splits``): when the blocks that hold rows
are too few to fill the GPU (a short chunk after a long cached prefix, a few long requests'
rows), the grid's programs past the blocks that hold rows (its empty blocks, and helpers up to
``dynamic_split_programs``) read splits of those that do (by their length, up to ``num_kv_splits``
ways) and write partial sums for the combine; a block that does not split writes its output at once. A grid whose blocks all hold rows runs as without splits.
The choice reads only the plan's tensors, so graphs and eager runs of one shape still agree.

Deterministic plans (``--enable_deterministic_inference``): every row is its own block and
the KV is never split, so a row's result depends only on its own position and the cache,
not on its batch, its chunk or whether it is a decode or an MTP verify row.
"""
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# KV positions per tile of the default launch configurations (larger tiles take multiples of it).
BLOCK_N = 64
# Smallest tile height tl.dot takes.
MIN_BLOCK_M = 16
# Largest tile height: query rows x heads of one KV head per program.
MAX_BLOCK_M = 128
# Plans whose tile height is at most this are decode-shaped and may split the KV.
SPLIT_MAX_BLOCK_M = 32
# Decode-shaped plans split each block's KV by its length: the work list aims for this many programs
# per SM at head_dim 128, proportionally more for smaller heads (fewer bytes per tile), and has room
# for at least one more split per block; a split reads at least DECODE_SPLIT_KEYS keys.
SPLIT_PROGRAMS_PER_SM = 2
TARGET_HEAD_DIM = 128
H200_SMS = 132  # without CUDA (the interpreter)
# The merge unrolls MAX_KV_SPLITS loads: at 32 the embedded model's wide decode tile took 151 registers
# against 120 at 16 (3 programs per SM, not 4; 34.9 against 27.5 us a layer at batch 16, 6000 keys).
MAX_KV_SPLITS = 16
# A grid that MAX_KV_SPLITS splits per block leave short of the SMs (batch 1-2 on few KV heads) may split
# further: it runs fewer programs than SMs, so the merge's registers cost nothing (embedded model, batch 1,
# 8192 keys: 11.8 us a layer at 32 against 14.5 at 16; DECODE_SPLIT_KEYS keeps splits at 256 keys or more).
SMALL_GRID_MAX_KV_SPLITS = 32
DECODE_SPLIT_KEYS = 256
SPLIT_FIELDS = tl.constexpr(3)  # a work item's split: block (-1: none), split, the block's splits
# and the block's first row (-1: none), request and keys, read with the item instead of through the block
WORK_FIELDS = tl.constexpr(SPLIT_FIELDS + 3)
# Prefill-shaped plans: most splits of one block's KV, and fewest keys per split.
DYNAMIC_MAX_SPLITS = 8
DYNAMIC_SPLIT_KEYS = 512
LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptrs, n_in, d_mask, MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """A [BLOCK_N, BLOCK_DMODEL] tile; masks only what may be out of range."""
    if MASK_N:
        return tl.load(ptrs, mask=n_in[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, table, n0, end, row_len, kv_d, kv_dv, d_mask, m_i, l_i, acc, qk_scale,
                 stride_k_slot, stride_v_slot, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, EVEN_D: tl.constexpr,
                 IEEE_DOT: tl.constexpr):
    """One tile of BLOCK_N positions from n0 into the online softmax (m_i, l_i, acc). MASK_N: some tile
    rows do not see every position (past ``end`` or their own length)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_in = offs_n < end
    if MASK_N:
        slots = tl.load(table + offs_n, mask=n_in, other=0)
    else:
        slots = tl.load(table + offs_n)
    k = _load_tile(k_ptr + slots[:, None] * stride_k_slot + kv_d, n_in, d_mask, MASK_N, EVEN_D)
    qk = _dot(q, tl.trans(k), IEEE_DOT)
    if MASK_N:
        qk = tl.where(offs_n[None, :] < row_len[:, None], qk * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no key yet
    else:
        qk = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_ptr + slots[:, None] * stride_v_slot + kv_dv, n_in, d_mask, MASK_N, EVEN_D)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def _store_out(out_ptr, row_c, head, offs_d, acc, l_i, store_mask, stride_out_row, stride_out_head):
    # An empty row (length 0) writes zeros instead of NaN.
    out = tl.where(l_i[:, None] > 0.0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + row_c[:, None] * stride_out_row + head[:, None] * stride_out_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [rows, q_heads, head_dim]
    k_ptr,  # [num_slots, kv_heads, head_dim]
    v_ptr,  # [num_slots, kv_heads, head_dim]
    req_to_token_ptr,  # [max_req + 1, max_seq_len] int64
    row_req_idx_ptr,  # [rows] int64
    row_seq_len_ptr,  # [rows] int32
    row_seq_start_ptr,  # [rows] int32, first row of each row's sequence
    block_first_row_ptr,  # [max_blocks] int32, -1: no block
    out_ptr,  # [rows, q_heads, head_dim]: the output (one split) ...
    part_acc_ptr,  # [rows, q_heads, splits, head_dim] fp32: ... or the splits' partial sums
    part_ml_ptr,  # [rows, q_heads, splits, 2] fp32: their running max and sum
    active_blocks_ptr,  # [1] int32: blocks that hold rows (DYNAMIC_SPLITS)
    row_split_ptr,  # [rows, 2] int32: each row's splits and partial-sum row (DYNAMIC_SPLITS, LENGTH_SPLITS)
    work_ptr,  # [programs, 3] int32: block (-1: none), split, the block's splits (LENGTH_SPLITS)
    split_counter_ptr,  # [max_blocks, kv_heads] int32 zeros: splits done (LENGTH_SPLITS; the last resets it)
    num_rows,
    num_part_rows,  # DYNAMIC_SPLITS: partial-sum rows (blocks past them do not split)
    fill_programs,  # DYNAMIC_SPLITS: programs that fill the GPU (its SMs): no split from there on
    target_programs,  # DYNAMIC_SPLITS: else split to about this many programs
    qk_scale,  # sm_scale * log2(e)
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_req_row,
    stride_out_row,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query rows per block
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # DYNAMIC_SPLITS: at most this many
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact products, not tf32
    EVEN_D: tl.constexpr,  # HEAD_DIM == BLOCK_DMODEL
    DYNAMIC_SPLITS: tl.constexpr = False,
    SPLIT_KEYS: tl.constexpr = DYNAMIC_SPLIT_KEYS,  # DYNAMIC_SPLITS: fewest keys per split
    LENGTH_SPLITS: tl.constexpr = False,  # decode-shaped plans: each program's (block, split) from the work list
    ONE_LOOP: tl.constexpr = False,  # every tile through the masked loop (one pipelined loop, not two)
):
    kv_head = tl.program_id(1)
    if DYNAMIC_SPLITS:
        # The blocks that hold rows come first; the programs past them help them: program
        # num_active + j reads split 1 + j // num_active of block j % num_active.
        pid = tl.program_id(0)
        num_active = tl.maximum(tl.load(active_blocks_ptr), 1)
        block = tl.where(pid < num_active, pid, (pid - num_active) % num_active)
        split = tl.where(pid < num_active, 0, 1 + (pid - num_active) // num_active)
    elif LENGTH_SPLITS:
        pid = tl.program_id(0)
        item = work_ptr + pid * WORK_FIELDS
        block = tl.load(item)
        split = tl.load(item + 1)
    else:
        tl.static_assert(NUM_SPLITS == 1, "a split plan takes DYNAMIC_SPLITS or LENGTH_SPLITS")
        block = tl.program_id(0)
        split = 0
    if LENGTH_SPLITS:
        first_row = tl.load(item + SPLIT_FIELDS)  # -1: a work item past the list
    else:
        first_row = tl.load(block_first_row_ptr + block, mask=block >= 0, other=-1)
    if first_row >= 0:
        if LENGTH_SPLITS:
            req_idx = tl.load(item + SPLIT_FIELDS + 1)
        else:
            req_idx = tl.load(row_req_idx_ptr + first_row)
        offs_m = tl.arange(0, BLOCK_M)
        q_off = offs_m // GROUP  # the tile row's query row inside the block
        head = kv_head * GROUP + offs_m % GROUP
        row = first_row + q_off
        in_rows = (q_off < BLOCK_Q) & (row < num_rows)
        row_c = tl.where(in_rows, row, first_row)
        if LENGTH_SPLITS:
            hi = tl.load(item + SPLIT_FIELDS + 2)  # the plan's: the loop's bounds need no row's length
        if LENGTH_SPLITS and BLOCK_Q == 1:  # one row a block: its length is the item's keys, no load before the keys
            valid = in_rows
            row_len = tl.zeros_like(row_c) + hi
        else:
            seq = tl.load(row_seq_start_ptr + first_row)
            first_len = tl.load(row_seq_len_ptr + first_row)
            valid = in_rows & (tl.load(row_seq_start_ptr + row_c) == seq)
            row_len = tl.where(valid, tl.load(row_seq_len_ptr + row_c), first_len)  # other tile rows copy the first row
        lo = tl.min(row_len, 0)  # keys every row of the block sees
        if not LENGTH_SPLITS:
            hi = tl.max(row_len, 0)  # keys some row of the block sees

        if DYNAMIC_SPLITS:
            # Split while the blocks that hold rows leave the GPU idle, by the block's length, as far
            # as the programs of the grid go.
            busy = num_active * tl.num_programs(1)
            n_split = tl.where(busy >= fill_programs, 1, tl.cdiv(target_programs, busy))
            n_split = tl.minimum(tl.minimum(n_split, tl.cdiv(hi, SPLIT_KEYS)), NUM_SPLITS)
            n_split = tl.minimum(n_split, (tl.num_programs(0) - block + num_active - 1) // num_active)
            n_split = tl.where((block + 1) * BLOCK_Q > num_part_rows, 1, tl.maximum(n_split, 1))
        elif LENGTH_SPLITS:
            n_split = tl.load(item + 2)
        else:
            n_split = 1
        offs_d = tl.arange(0, BLOCK_DMODEL)
        d_mask = offs_d < HEAD_DIM
        q_mask = valid[:, None] & d_mask[None, :]
        if DYNAMIC_SPLITS:
            q_mask = q_mask & (split < n_split)  # a program past the block's splits reads nothing
        q = tl.load(q_ptr + row_c[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                    mask=q_mask, other=0.0)
        # This program's share of the keys: whole tiles, split n_split ways.
        split_len = tl.cdiv(tl.cdiv(hi, n_split), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.where(split < n_split, tl.minimum(start + split_len, hi), start)
        # Tiles below ``lo`` need no mask.
        unmasked_end = tl.maximum(tl.minimum(end, (lo // BLOCK_N) * BLOCK_N), start)
        if ONE_LOOP:
            unmasked_end = start

        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)
        table = req_to_token_ptr + req_idx * stride_req_row
        kv_d = kv_head * stride_k_head + offs_d[None, :]
        kv_dv = kv_head * stride_v_head + offs_d[None, :]
        for n0 in range(start, unmasked_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, table, n0, end, row_len, kv_d, kv_dv, d_mask, m_i, l_i, acc,
                                         qk_scale, stride_k_slot, stride_v_slot, BLOCK_N, False, EVEN_D, IEEE_DOT)
        for n0 in range(unmasked_end, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, table, n0, end, row_len, kv_d, kv_dv, d_mask, m_i, l_i, acc,
                                         qk_scale, stride_k_slot, stride_v_slot, BLOCK_N, True, EVEN_D, IEEE_DOT)

        store_mask = valid[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            _store_out(out_ptr, row_c, head, offs_d, acc, l_i, store_mask, stride_out_row, stride_out_head)
        elif LENGTH_SPLITS:
            if n_split == 1:
                _store_out(out_ptr, row_c, head, offs_d, acc, l_i, store_mask, stride_out_row, stride_out_head)
            else:
                # One partial-sum row per work item's tile row (a block's splits are consecutive work items).
                # Every thread's stores, then one release per program; the block's last split (acquire)
                # resets the counter for the next launch and merges the splits in their order.
                q_heads = GROUP * tl.num_programs(1)
                first_part = ((pid - split) * BLOCK_Q + q_off) * q_heads + head  # [BLOCK_M]: split 0's entries
                split_stride = BLOCK_Q * q_heads
                part = first_part + split * split_stride
                tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
                tl.store(part_ml_ptr + part * 2, m_i, mask=valid)
                tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=valid)
                tl.debug_barrier()
                counter = split_counter_ptr + block * tl.num_programs(1) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                    _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, first_part, split_stride, n_split, row_c, head,
                                  offs_d, valid, store_mask, stride_out_row, stride_out_head, HEAD_DIM, BLOCK_M,
                                  BLOCK_DMODEL, NUM_SPLITS)
        else:
            part_row = block * BLOCK_Q + q_off  # this block's rows of the partial sums
            if split == 0:
                tl.store(row_split_ptr + row_c * 2, tl.zeros_like(row_c) + n_split, mask=valid)
                tl.store(row_split_ptr + row_c * 2 + 1, part_row, mask=valid)
            if (n_split == 1) & (split == 0):
                _store_out(out_ptr, row_c, head, offs_d, acc, l_i, store_mask, stride_out_row, stride_out_head)
            elif split < n_split:
                part = (part_row * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + split  # [BLOCK_M]
                tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
                tl.store(part_ml_ptr + part * 2, m_i, mask=valid)
                tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=valid)


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, first_part, split_stride, n_split, row_c, head, offs_d, valid,
                  store_mask, stride_out_row, stride_out_head, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_DMODEL: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The tile rows' n_split partial sums (entries first_part + s * split_stride) merged in split order, so
    the result does not depend on which program merges; unrolled, every load in flight at once; .cg reads
    the other programs' partials from L2, not a stale L1 line."""
    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        use = valid & (s < n_split)
        entry = first_part + s * split_stride
        m_s = tl.load(part_ml_ptr + entry * 2, mask=use, other=-float("inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + entry * 2 + 1, mask=use, other=0.0, cache_modifier=".cg")
        a_s = tl.load(part_acc_ptr + entry[:, None] * HEAD_DIM + offs_d[None, :], mask=use[:, None] & store_mask,
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        beta = tl.math.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        l = l * alpha + l_s * beta
        m = m_new
    _store_out(out_ptr, row_c, head, offs_d, acc, l, store_mask, stride_out_row, stride_out_head)


@triton.jit
def _combine_dynamic_splits_kernel(
    part_acc_ptr,  # [part rows, q_heads, splits, head_dim] fp32
    part_ml_ptr,  # [part rows, q_heads, splits, 2] fp32
    out_ptr,  # [rows, q_heads, head_dim]
    row_split_ptr,  # [rows, 2] int32: the row's splits and partial-sum row
    num_part_rows,
    stride_out_row,
    stride_out_head,
    Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= Q_HEADS, a power of two
    BLOCK_DMODEL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One row, every head: the row's splits merged (a row that did not split was written already;
    a row no block holds, only with a wrong ``max_seqs``, is left alone rather than read off bounds)."""
    row = tl.program_id(0)
    n = tl.load(row_split_ptr + row * 2)
    part_row = tl.load(row_split_ptr + row * 2 + 1)
    if (n > 1) & (n <= NUM_SPLITS) & (part_row >= 0) & (part_row < num_part_rows):
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_DMODEL)
        h_mask = offs_h < Q_HEADS
        hd_mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        base = (part_row * Q_HEADS + offs_h) * NUM_SPLITS  # [BLOCK_H]
        m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], dtype=tl.float32)
        for s in range(0, n):
            entry = base + s
            m_s = tl.load(part_ml_ptr + entry * 2, mask=h_mask, other=-float("inf"))
            l_s = tl.load(part_ml_ptr + entry * 2 + 1, mask=h_mask, other=0.0)
            a_s = tl.load(part_acc_ptr + entry[:, None] * HEAD_DIM + offs_d[None, :], mask=hd_mask, other=0.0)
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_safe)
            beta = tl.math.exp2(m_s - m_safe)
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            l = l * alpha + l_s * beta
            m = m_new
        out = tl.where(l[:, None] > 0.0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + row * stride_out_row + offs_h[:, None] * stride_out_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@dataclass(frozen=True)
class AttentionPlan:
    """How one forward's rows are cut into blocks; built once, read by every layer."""

    row_req_idx: torch.Tensor  # [rows] int64
    row_seq_len: torch.Tensor  # [rows] int32, keys each row sees (its position + 1)
    row_seq_start: torch.Tensor  # [rows] int32, first row of each row's sequence
    block_first_row: torch.Tensor  # [max_blocks] int32, first row of each block (-1: unused)
    group: int  # query heads per KV head
    block_q: int  # query rows per block
    block_m: int  # tile height (block_q * group, padded to a power of two)
    num_kv_splits: int  # at most this many per block
    # Prefill-shaped plans: blocks split their KV on the device while too few hold rows
    dynamic_splits: bool = False
    active_blocks: Optional[torch.Tensor] = None  # [1] int32: blocks that hold rows
    num_part_blocks: int = 0  # blocks with room for partial sums (the first ones: a split needs few)
    split_keys: int = DYNAMIC_SPLIT_KEYS  # fewest keys per dynamic split
    dynamic_programs: int = 0  # programs per KV head (``dynamic_split_programs``): the blocks, then their helpers
    # Decode-shaped plans: [programs, WORK_FIELDS] int32, each program's block and split, and the block's first
    # row, request and keys (length splits)
    work: Optional[torch.Tensor] = None
    split_counter: Optional[torch.Tensor] = None  # [max_blocks * kv_heads] int32 zeros, the kernel's counters
    wide_tiles: bool = False  # few blocks: the split launch configuration (more bytes in flight per program)
    small_grid: bool = False  # fewer still (batch 1-2): the small-grid launch configuration
    # Prefill-shaped plans: [rows, 2] int32, each row's splits and partial-sum row, written by every launch
    # for the rows of its blocks; zeros for the others (a ranged plan's rows of another plan: no split)
    row_split: Optional[torch.Tensor] = None


def block_shape(group: int, max_q_len: int, deterministic: bool) -> Tuple[int, int]:
    """(block_q, block_m): one row per block when deterministic, else enough rows for the longest run
    of one request, up to MAX_BLOCK_M tile rows."""
    if group > MAX_BLOCK_M:
        raise ValueError(f"{group} query heads per KV head exceed the tile height {MAX_BLOCK_M}")
    rows = 1 if deterministic else max(1, max_q_len)
    block_m = min(max(MIN_BLOCK_M, triton.next_power_of_2(rows * group)), MAX_BLOCK_M)
    return min(rows, block_m // group), block_m


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def length_split_programs(max_blocks: int, kv_heads: int, head_dim: int = TARGET_HEAD_DIM,
                          sms: int = H200_SMS) -> int:
    """Work items per KV head of a decode-shaped plan: one per block, and as many more as fill the GPU,
    at least one more per block (so the long blocks of a grid that is full already split too)."""
    return max_blocks + max(max_blocks, triton.cdiv(split_target_programs(head_dim, sms), kv_heads))


def length_split_work(block_len: torch.Tensor, programs: int, fill_programs: Optional[int] = None,
                      max_splits: int = MAX_KV_SPLITS, min_keys: int = DECODE_SPLIT_KEYS) -> torch.Tensor:
    """The work list of blocks whose rows see ``block_len`` keys at most (-1: no block): each block splits
    into cdiv(len, keys) programs (1 to ``max_splits``), keys = the batch's keys over a spare share of
    programs (at least ``min_keys``): max(blocks used, ``fill_programs``), never more than the programs left
    after one per block (``fill_programs`` None: all of those), so the splits always fit in ``programs``.
    The share does not grow with the list's padding (a graph's padded batch, MTP plans' room for
    misaligned runs), which split full grids for nothing. Returns [programs, SPLIT_FIELDS] int32: (block,
    split, the block's splits), consecutive per block; (-1, 0, 0) past the list. Device ops only (no host
    sync: CUDA-graph safe)."""
    blocks = block_len.shape[0]
    block_len = block_len.to(torch.int64)
    used = block_len >= 0
    left = (programs - used.sum()).clamp(min=1)
    spare = left if fill_programs is None else used.sum().clamp(min=fill_programs).clamp(max=left)
    keys = ((block_len.clamp(min=0).sum() + spare - 1) // spare).clamp(min=min_keys)
    n = torch.where(used, ((block_len + keys - 1) // keys).clamp(1, max_splits), 0)
    end = torch.cumsum(n, 0)
    p = torch.arange(programs, device=block_len.device)
    block = torch.searchsorted(end, p, right=True)
    inside = block < blocks
    b = block.clamp(max=blocks - 1)
    split = p - (end[b] - n[b])
    work = torch.stack((torch.where(inside, block, -1), torch.where(inside, split, 0), torch.where(inside, n[b], 0)), 1)
    return work.to(torch.int32)


def with_block_rows(work: torch.Tensor, block_first_row: torch.Tensor, row_req_idx: torch.Tensor,
                    block_len: torch.Tensor) -> torch.Tensor:
    """``length_split_work``'s list [programs, SPLIT_FIELDS] with each item's block's first row (-1: none),
    request and keys appended ([programs, WORK_FIELDS]): a program reads them with its item, so its first keys
    wait for one load instead of a chain (item, block, row, lengths). Device ops only."""
    block = work[:, 0].long()
    b = block.clamp(min=0)
    first = torch.where(block >= 0, block_first_row[b].long(), -1)
    req = torch.where(first >= 0, row_req_idx[first.clamp(min=0)].long(), 0)
    keys = torch.where(block >= 0, block_len[b].long().clamp(min=0), 0)
    return torch.cat((work, torch.stack((first, req, keys), 1).to(torch.int32)), 1)


def dynamic_split_programs(max_blocks: int, kv_heads: int, head_dim: int = TARGET_HEAD_DIM,
                           sms: int = H200_SMS) -> int:
    """Programs per KV head of a prefill-shaped plan that splits on the device: one per block, and helpers
    up to the programs a split plan aims for (at most DYNAMIC_MAX_SPLITS per block), so that a chunk whose few
    blocks leave the SMs idle splits even when the plan has no empty blocks (an eager chunk, a rows graph
    whose padding is short)."""
    helpers = min(max_blocks * DYNAMIC_MAX_SPLITS, triton.cdiv(split_target_programs(head_dim, sms), kv_heads))
    return max(max_blocks, helpers)


def small_grid(max_blocks: int, kv_heads: int, sms: int) -> bool:
    """Whether a decode-shaped plan's grid is small: MAX_KV_SPLITS per block would not give every SM a program
    (batch 1-2 on few KV heads)."""
    return max_blocks * kv_heads * MAX_KV_SPLITS < sms


def decode_max_splits(max_blocks: int, kv_heads: int, sms: int) -> int:
    """Most splits per block of a decode-shaped plan: SMALL_GRID_MAX_KV_SPLITS in a small grid, else
    MAX_KV_SPLITS."""
    return SMALL_GRID_MAX_KV_SPLITS if small_grid(max_blocks, kv_heads, sms) else MAX_KV_SPLITS


def split_target_programs(head_dim: int, sms: int) -> int:
    """Programs a split plan aims for."""
    return sms * SPLIT_PROGRAMS_PER_SM * max(1, TARGET_HEAD_DIM // max(head_dim, 1))


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # KV positions per tile
    num_warps: int
    num_stages: int


# Launch configurations, from sweeps on an H200 (docs/attention.md). Prefill-shaped tiles by head_dim;
# decode-shaped tiles: bigger KV tiles when the plan has few blocks (few programs: more bytes in flight each).
PREFILL_CONFIGS = {64: LaunchConfig(BLOCK_N, 4, 3), 128: LaunchConfig(2 * BLOCK_N, 8, 3)}
PREFILL_DEFAULT = LaunchConfig(BLOCK_N, 4, 2)
DECODE_CONFIG = LaunchConfig(BLOCK_N, 4, 2)
DECODE_SPLIT_CONFIG = LaunchConfig(2 * BLOCK_N, 4, 2)
# Small grids (batch 1-2): one more stage in flight (8B heads, batch 1, 8192 keys: 18.4-18.5 us a layer against
# 20.0, sweeps of the nineteenth and twenty-fifth sessions); at batch 16 it cost 148 us against 131
DECODE_SMALL_GRID_CONFIG = LaunchConfig(2 * BLOCK_N, 4, 3)
HALF_BYTES = 2  # the tables above are for bf16 / fp16; fp32 tiles take half the positions
# Decode-shaped plans: every tile in the masked loop, so a program's last, masked tile (MTP rows of unequal lengths,
# a split's end) shares the pipeline instead of waiting alone (8B heads, batch 64, 4 rows over 1024 keys: 97.3 us
# a layer against 106.9; never slower by more than 0.4 us in docs/data/perf/session26/decode_plan_variants.py)
LENGTH_SPLIT_ONE_LOOP = True


def launch_config(block_m: int, block_dmodel: int, wide: bool = False, elem_bytes: int = HALF_BYTES,
                  small: bool = False) -> LaunchConfig:
    """``wide``: a decode-shaped plan of few blocks (few programs, each reading more keys); ``small``: fewer
    still (``small_grid``)."""
    if block_m > SPLIT_MAX_BLOCK_M:
        cfg = PREFILL_CONFIGS.get(block_dmodel, PREFILL_DEFAULT)
    elif small:
        cfg = DECODE_SMALL_GRID_CONFIG
    elif wide:
        cfg = DECODE_SPLIT_CONFIG
    else:
        cfg = DECODE_CONFIG
    if elem_bytes > HALF_BYTES:  # the same shared memory per stage
        cfg = LaunchConfig(cfg.block_n * HALF_BYTES // elem_bytes, cfg.num_warps, min(cfg.num_stages, 2))
    return cfg


def plan_attention(
    row_req_idx: torch.Tensor,  # [rows] int
    row_seq_len: torch.Tensor,  # [rows] int
    q_heads: int,
    kv_heads: int,
    max_q_len: int,  # host: most consecutive rows of one request (prefill: the longest chunk)
    max_seqs: int,  # host: at most this many runs of consecutive rows of one request
    deterministic: bool = False,
    head_dim: int = TARGET_HEAD_DIM,
    rows_from: Optional[torch.Tensor] = None,  # [1] int32 device: the plan's first row (None: 0)
    rows_below: Optional[torch.Tensor] = None,  # [1] int32 device: its end (None: every row)
    max_blocks: Optional[int] = None,  # host: most blocks the plan's rows need (default: from the rows)
) -> AttentionPlan:
    """Group consecutive rows of one request into sequences and cut them into blocks, on the
    device (no host sync; a fixed shape for a fixed number of rows: CUDA-graph safe). With
    ``rows_from`` / ``rows_below`` only the rows between them get blocks (a forward's decode rows
    and its prompt chunks, each planned for its shape: ``plan_split_rows``)."""
    if q_heads % kv_heads != 0:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    rows = int(row_req_idx.shape[0])
    if row_seq_len.shape != (rows,):
        raise ValueError("row_req_idx and row_seq_len must both be [rows]")
    group = q_heads // kv_heads
    block_q, block_m = block_shape(group, max_q_len, deterministic)
    row_req_idx = row_req_idx.to(torch.int64).contiguous()
    row_seq_len = row_seq_len.to(torch.int32).contiguous()
    idx = torch.arange(rows, device=row_req_idx.device)
    ranged = rows_from is not None or rows_below is not None
    in_range = None
    if ranged:
        in_range = torch.ones(rows, dtype=torch.bool, device=idx.device)
        if rows_from is not None:
            in_range &= idx >= rows_from
        if rows_below is not None:
            in_range &= idx < rows_below
    if block_q == 1 and not ranged:
        max_blocks = max(rows, 1)
        seq_start = idx
        first = idx.to(torch.int32)
    else:
        if max_blocks is None:
            max_blocks = max(1, min(rows, triton.cdiv(rows, block_q) + max(max_seqs, 1)))
        cont = torch.zeros(rows, dtype=torch.bool, device=idx.device)
        cont[1:] = row_req_idx[1:] == row_req_idx[:-1]
        seq_start = torch.cummax(torch.where(cont, torch.zeros_like(idx), idx), 0).values
        leader = (idx - seq_start) % block_q == 0
        if ranged:
            leader &= in_range
        slot = torch.where(leader, torch.cumsum(leader, 0) - 1, max_blocks).clamp_(max=max_blocks)
        first = torch.full((max_blocks + 1,), -1, dtype=torch.int32, device=idx.device)  # the last takes the rest
        first = first.scatter_(0, slot, idx.to(torch.int32))[:max_blocks]
    sms = sm_count(idx.device)
    fills = triton.cdiv(rows, block_q) * kv_heads >= sms  # blocks that hold rows fill the SMs whatever the rows
    if not deterministic and block_m > SPLIT_MAX_BLOCK_M and block_q > 1 and not fills:
        # Blocks hold rows from the first entry on; a block splits only while fewer than fill the
        # GPU's SMs, so the first cdiv(sms, kv_heads) blocks need room for partial sums.
        active = (first >= 0).sum(dtype=torch.int32).reshape(1)
        part_blocks = min(max_blocks, triton.cdiv(sms, kv_heads))
        return AttentionPlan(row_req_idx, row_seq_len, seq_start.to(torch.int32), first, group, block_q, block_m,
                             DYNAMIC_MAX_SPLITS, True, active, part_blocks,
                             dynamic_programs=dynamic_split_programs(max_blocks, kv_heads, head_dim, sms),
                             row_split=torch.zeros((rows, 2), dtype=torch.int32, device=idx.device))
    seq_start = seq_start.to(torch.int32)
    if deterministic or block_m > SPLIT_MAX_BLOCK_M:
        return AttentionPlan(row_req_idx, row_seq_len, seq_start, first, group, block_q, block_m, 1)
    if block_q == 1 and not ranged:
        block_len = row_seq_len
    else:  # a block's longest row; its rows follow its leader (a leader past max_blocks has no block: its rows
        # go to the extra entry, so every length is that of the rows the kernel reads for the block)
        row_block = (torch.cumsum(leader, 0) - 1).clamp_(0, max_blocks)
        lens = row_seq_len if in_range is None else torch.where(in_range, row_seq_len, 0)
        block_len = torch.zeros(max_blocks + 1, dtype=torch.int32, device=idx.device)
        block_len = block_len.scatter_reduce_(0, row_block, lens, "amax")[:max_blocks]
        block_len = torch.where(first >= 0, block_len, -1)
    programs = length_split_programs(max_blocks, kv_heads, head_dim, sms)
    max_splits = decode_max_splits(max_blocks, kv_heads, sms)
    work = length_split_work(block_len, programs, triton.cdiv(split_target_programs(head_dim, sms), kv_heads),
                             max_splits)
    work = with_block_rows(work, first, row_req_idx, block_len)
    return AttentionPlan(row_req_idx, row_seq_len, seq_start, first, group, block_q, block_m, max_splits,
                         work=work, wide_tiles=max_blocks * kv_heads < sms,
                         small_grid=small_grid(max_blocks, kv_heads, sms),
                         split_counter=torch.zeros(max_blocks * kv_heads, dtype=torch.int32, device=idx.device))


def plan_split_rows(
    row_req_idx: torch.Tensor,  # [rows] int
    row_seq_len: torch.Tensor,  # [rows] int
    q_heads: int,
    kv_heads: int,
    head_rows: torch.Tensor,  # [1] int32 device: the first rows, runs of ``head_q_len`` rows of one request each
    head_q_len: int,  # host: rows per run of the head (decode rows: K + 1)
    max_head_runs: int,  # host: most runs in the head (the running requests)
    max_q_len: int,  # host: the rest's longest run (a prompt chunk)
    max_seqs: int,  # host: at most this many runs in all
    head_dim: int = TARGET_HEAD_DIM,
) -> Tuple[AttentionPlan, AttentionPlan]:
    """Two plans of one forward whose first ``head_rows`` rows are decode rows and the rest prompt
    chunks (a mixed step): the decode rows in small tiles that split their KV by length (as a
    decode step plans them), the chunks in tall tiles; every row in exactly one of them."""
    head = plan_attention(row_req_idx, row_seq_len, q_heads, kv_heads, head_q_len, max_head_runs, head_dim=head_dim,
                          rows_below=head_rows, max_blocks=max(1, max_head_runs))
    rest = plan_attention(row_req_idx, row_seq_len, q_heads, kv_heads, max_q_len, max_seqs, head_dim=head_dim,
                          rows_from=head_rows)
    return head, rest


def unified_attention(
    q: torch.Tensor,  # [rows, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    req_to_token_indexs: torch.Tensor,  # [max_req + 1, max_seq_len] int64
    plan: AttentionPlan,
    sm_scale: float,
    out: Optional[torch.Tensor] = None,  # like q: write the plan's rows here (the others are left alone)
) -> torch.Tensor:  # [rows, q_heads, head_dim]
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError("q, k_cache, v_cache must be [rows|slots, heads, head_dim]")
    rows, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if q_heads != plan.group * kv_heads:
        raise ValueError(f"q has {q_heads} heads; the plan is for {plan.group} per each of {kv_heads} KV heads")
    if rows != plan.row_req_idx.shape[0]:
        raise ValueError(f"q has {rows} rows; the plan has {plan.row_req_idx.shape[0]}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("req_to_token_indexs", req_to_token_indexs)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if req_to_token_indexs.dtype != torch.int64:
        raise ValueError("req_to_token_indexs must be int64")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be shaped as q {tuple(q.shape)} {q.dtype}")
    if rows == 0:
        return out
    splits = plan.num_kv_splits
    dynamic = plan.dynamic_splits
    by_length = plan.work is not None
    if dynamic or by_length:
        if dynamic:  # partial sums: (part row, head, split)
            part_rows = plan.num_part_blocks * plan.block_q
            part_shape = (part_rows, q_heads, splits)
        else:  # one partial-sum row per work item's query row: (part row, head)
            part_rows = plan.work.shape[0] * plan.block_q
            part_shape = (part_rows, q_heads)
        part_acc = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((*part_shape, 2), dtype=torch.float32, device=q.device)
    else:
        part_rows = 0
        part_acc = part_ml = out  # not read
    unread = plan.row_seq_len
    row_split = plan.row_split if dynamic else unread
    active = plan.active_blocks if dynamic else unread
    work, counter = (plan.work, plan.split_counter) if by_length else (unread, unread)
    sms = sm_count(q.device)
    target = split_target_programs(head_dim, sms)
    block_dmodel = triton.next_power_of_2(head_dim)
    cfg = launch_config(plan.block_m, block_dmodel, plan.wide_tiles, q.element_size(), plan.small_grid)
    if by_length:
        programs = plan.work.shape[0]
    elif dynamic:
        programs = max(plan.dynamic_programs, plan.block_first_row.shape[0])
    else:
        programs = plan.block_first_row.shape[0]
    grid = (programs, kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, req_to_token_indexs, plan.row_req_idx, plan.row_seq_len, plan.row_seq_start,
        plan.block_first_row,
        out, part_acc, part_ml, active, row_split, work, counter, rows, part_rows, sms, target, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token_indexs.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, GROUP=plan.group, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_DMODEL=block_dmodel,
        BLOCK_N=cfg.block_n, NUM_SPLITS=splits, IEEE_DOT=q.dtype == torch.float32, EVEN_D=head_dim == block_dmodel,
        DYNAMIC_SPLITS=dynamic, SPLIT_KEYS=plan.split_keys, LENGTH_SPLITS=by_length,
        ONE_LOOP=by_length and LENGTH_SPLIT_ONE_LOOP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if dynamic:
        _combine_dynamic_splits_kernel[(rows,)](
            part_acc, part_ml, out, row_split, part_rows, out.stride(0), out.stride(1), Q_HEADS=q_heads,
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(q_heads), BLOCK_DMODEL=block_dmodel, NUM_SPLITS=splits,
            num_warps=2,
        )
    return out
