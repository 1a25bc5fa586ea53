"""Tensor / data parallel ranks over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Vocabulary (docs/parallel.md):

- rank: one worker process, one GPU on CUDA. ``--tp N`` ranks in all, ``N / nnodes`` per node.
- DP group: ``--dp M`` groups of ``A = N / M`` consecutive ranks. A group owns its requests,
  its req_idx tables and its KV cache; its ranks hold the same rows.
- attention TP: inside a DP group, q/kv heads, embedding and lm_head rows are split over its
  ``A`` ranks (``attn_group``).
- MLP TP: the MLP's intermediate dim is split over all ``N`` ranks. Its input rows are
  gathered from the ``M`` DP groups (``cross_group``: the ranks with the same index inside
  their DP group) and its output is all-reduced over all ranks, then each group keeps its rows.
- driver: rank 0; it alone talks to the HTTP process and broadcasts what it receives.

Nothing here is global: a ``ParallelContext`` is built once per worker and passed down.
With one rank every collective is the identity and no process group exists.
"""
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

DRIVER_RANK = 0
# How long a rank waits in a collective before giving up (a peer died or hangs).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class TpComm:
    """The collectives of one forward (one micro-batch). Every op is the identity on one rank.

    ``attn_*``: this rank's DP group (size ``attn_size``); ``cross_group``: the ``dp_size``
    ranks with the same index in their DP group; ``mlp_group``: all ``mlp_size`` ranks.
    """

    attn_size: int = 1
    attn_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    cross_group: Any = None
    mlp_size: int = 1
    mlp_group: Any = None

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` [rows, dim] over the DP group (row-parallel o_proj, vocab-split embedding)."""
        if self.attn_size > 1 and x.numel() > 0:
            dist.all_reduce(x, group=self.attn_group)
        return x

    def attn_all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, part] on each rank of the DP group -> [rows, attn_size * part] (vocab-split logits)."""
        if self.attn_size == 1 or x.numel() == 0:
            return x if self.attn_size == 1 else x.new_empty((x.shape[0], x.shape[1] * self.attn_size))
        parts = [torch.empty_like(x) for _ in range(self.attn_size)]
        dist.all_gather(parts, x.contiguous(), group=self.attn_group)
        return torch.cat(parts, dim=-1)

    def mlp_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] of my DP group -> [dp_size * rows, hidden], every group's rows in group order.
        Every DP group runs the same number of rows (padding), so the parts have equal size."""
        if self.dp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.dp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.cross_group)
        return torch.cat(parts, dim=0)

    def mlp_reduce_rows(self, y: torch.Tensor) -> torch.Tensor:
        """Partial MLP outputs [dp_size * rows, hidden] -> the sum over all ranks, my group's rows.
        (All-reduce then slice: gloo has no reduce-scatter, and this keeps one code path.)"""
        if self.mlp_size > 1:
            dist.all_reduce(y, group=self.mlp_group)
        if self.dp_size == 1:
            return y
        rows = y.shape[0] // self.dp_size
        return y[self.dp_rank * rows:(self.dp_rank + 1) * rows]


SINGLE_RANK_COMM = TpComm()


@dataclass
class ParallelContext:
    """Who this worker is among the ranks, and the groups it talks over (see module doc)."""

    world_size: int = 1
    rank: int = 0
    dp_size: int = 1
    device: str = "cpu"
    # One TpComm per decode micro-batch (two with --enable_decode_microbatch_overlap, so
    # each micro-batch has its own communicators); comms[0] serves every other forward.
    comms: List[TpComm] = field(default_factory=lambda: [SINGLE_RANK_COMM])
    attn_src: int = 0  # global rank of the first rank of my DP group
    world_cpu_group: Any = None  # gloo group of all ranks: control messages (pickled objects)
    cross_cpu_group: Any = None  # gloo cross group: step results between DP groups

    @property
    def attn_tp_size(self) -> int:
        return self.world_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    def comm(self, microbatch: int = 0) -> TpComm:
        return self.comms[microbatch]

    # ---- host-side control (pickled objects, gloo) ----
    def broadcast_from_driver(self, obj):
        """The driver's ``obj`` on every rank (the router's incoming messages of one step)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=DRIVER_RANK, group=self.world_cpu_group)
        return box[0]

    def all_gather_across_dp(self, obj) -> List:
        """``obj`` of every DP group, in group order (ranks of one group hold equal objects)."""
        if self.dp_size == 1:
            return [obj]
        out = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=self.cross_cpu_group)
        return out

    def all_gather_objects(self, obj) -> List:
        """``obj`` of every rank (start-up status)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.world_cpu_group)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks (sizes every rank must agree on, like the KV pool)."""
        return min(self.all_gather_objects(value))

    def broadcast_in_dp_group(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrite ``t`` with its value on the first rank of my DP group (sampled tokens)."""
        comm = self.comms[0]
        if comm.attn_size > 1:
            dist.broadcast(t, src=self.attn_src, group=comm.attn_group)
        return t

    def destroy(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


# Decode micro-batches of --enable_decode_microbatch_overlap.
NUM_OVERLAP_MICROBATCHES = 2


def single_rank_context(device: str = "cpu") -> ParallelContext:
    """One rank: identity collectives for every micro-batch."""
    return ParallelContext(device=device, comms=[SINGLE_RANK_COMM] * NUM_OVERLAP_MICROBATCHES)


def local_ranks(tp: int, nnodes: int, node_rank: int) -> List[int]:
    """Global ranks that run on node ``node_rank``: ``tp / nnodes`` consecutive ones."""
    per_node = tp // nnodes
    return list(range(node_rank * per_node, (node_rank + 1) * per_node))


def init_parallel(
    tp: int, dp: int, rank: int, nnodes: int, node_rank: int, nccl_host: str, nccl_port: int,
    device_type: str, num_microbatches: int = 1,
) -> ParallelContext:
    """Join the ``tp``-rank process group as ``rank`` and build the groups.

    ``device_type``: "cuda" (NCCL; this rank uses ``cuda:<local rank>``) or "cpu" (gloo).
    Every rank must call this with the same arguments except ``rank``.
    """
    if tp == 1:
        return single_rank_context(device_type)
    device = "cpu"
    if device_type == "cuda":
        local = rank - local_ranks(tp, nnodes, node_rank)[0]
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{nccl_host}:{nccl_port}", world_size=tp, rank=rank, timeout=COLLECTIVE_TIMEOUT
    )
    return build_parallel_context(dp, device, num_microbatches)


def _new_group(ranks: List[int], backend: Optional[str] = None):
    """Every rank calls this for every group, in the same order (torch.distributed's rule)."""
    return dist.new_group(ranks=ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT)


def build_parallel_context(dp: int, device: str, num_microbatches: int = 1) -> ParallelContext:
    """The groups for ``dp`` DP groups over the initialized default process group (all ranks call it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % dp:
        raise ValueError(f"dp ({dp}) must divide the number of ranks ({world})")
    backend = dist.get_backend()
    attn = world // dp
    dp_rank, attn_rank = rank // attn, rank % attn
    all_ranks = list(range(world))
    group_ranks = [list(range(g * attn, (g + 1) * attn)) for g in range(dp)]
    cross_ranks = [[g * attn + i for g in range(dp)] for i in range(attn)]
    comms = []
    for m in range(num_microbatches):
        attn_groups = [_new_group(r) for r in group_ranks] if attn > 1 else [None] * dp
        cross_groups = [_new_group(r) for r in cross_ranks] if dp > 1 else [None] * attn
        mlp_group = None if m == 0 else _new_group(all_ranks)  # None: the default (world) group
        comms.append(TpComm(attn, attn_groups[dp_rank], dp, dp_rank, cross_groups[attn_rank], world, mlp_group))
    if backend == "gloo":
        world_cpu = None
        cross_cpu = comms[0].cross_group
    else:
        world_cpu = _new_group(all_ranks, backend="gloo")
        cross_cpu_groups = [_new_group(r, backend="gloo") for r in cross_ranks] if dp > 1 else [None] * attn
        cross_cpu = cross_cpu_groups[attn_rank]
    return ParallelContext(
        world_size=world, rank=rank, dp_size=dp, device=device, comms=comms, attn_src=dp_rank * attn,
        world_cpu_group=world_cpu, cross_cpu_group=cross_cpu,
    )
