"""Readable PyTorch attention over a slot-indexed KV cache, and random batches to test kernels on.

The reference computes each row alone in fp32: softmax(q k^T * scale) v over the slots of its
request's positions 0..row_seq_len - 1, K/V gathered through the slot table.
"""
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


def reference_attention(q, k_cache, v_cache, req_to_token, row_req_idx, row_seq_len, sm_scale) -> torch.Tensor:
    """[rows, q_heads, head_dim] fp32; a row that sees no key gives zeros."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for row in range(q.shape[0]):
        n = int(row_seq_len[row])
        if n == 0:
            continue
        slots = req_to_token[int(row_req_idx[row]), :n]
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, q_heads, head_dim]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * sm_scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out


@dataclass
class RowBatch:
    """A batch of rows over a random cache: runs of (request, first key count, rows)."""

    q: torch.Tensor  # [rows, q_heads, head_dim]
    k_cache: torch.Tensor  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [reqs, max_len] int64, scattered slots
    row_req_idx: torch.Tensor  # [rows] int64
    row_seq_len: torch.Tensor  # [rows] int32
    max_q_len: int
    num_runs: int

    def reference(self, sm_scale: float) -> torch.Tensor:
        return reference_attention(self.q, self.k_cache, self.v_cache, self.req_to_token, self.row_req_idx,
                                   self.row_seq_len, sm_scale)


def make_batch(runs: Sequence[Tuple[int, int, int]], q_heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str, seed: int = 0, same_len: bool = False) -> RowBatch:
    """``runs``: (request, keys seen by the run's first row, rows); row j of a run sees one key more
    than row j - 1 (a prefill chunk, MTP rows), or as many (``same_len``: dspark's block rows)."""
    gen = torch.Generator().manual_seed(seed)
    reqs = max(r for r, _, _ in runs) + 1
    max_len = max(first + (0 if same_len else n - 1) for _, first, n in runs) + 1
    num_slots = reqs * max_len + 1
    req_to_token = torch.stack([torch.randperm(num_slots, generator=gen)[:max_len] for _ in range(reqs)])
    req_idx: List[int] = []
    seq_len: List[int] = []
    for r, first, n in runs:
        req_idx += [r] * n
        seq_len += [first] * n if same_len else list(range(first, first + n))
    rows = len(req_idx)
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    q = torch.randn(rows, q_heads, head_dim, generator=gen)
    return RowBatch(
        q.to(dtype).to(device), k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), req_to_token.to(device),
        torch.tensor(req_idx, dtype=torch.int64, device=device), torch.tensor(seq_len, dtype=torch.int32, device=device),
        max(n for _, _, n in runs), len(runs),
    )
