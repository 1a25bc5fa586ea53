"""Token-slot KV cache: one slot holds the K and V of one token in every layer.

Vocabulary:
- slot: a row index into ``k_buffer[layer]`` / ``v_buffer[layer]``; a request's
  positions map to slots through ``ReqManager.req_to_token_indexs``.
- HOLD_SLOT: the extra last row (index ``size``). Padding rows (DP ranks with
  fewer requests) write their K/V there. It is never allocated, never freed and
  nothing real is ever read back from it.

The free list lives on the host, so alloc/free never synchronize with the GPU.

A reclaimer (the prompt cache, ``Reclaimer``) may hold slots it can give back: ``alloc`` asks it for
room before it fails, so every allocation site sees cached slots as free ones.
"""
import math
from typing import Callable, List, Optional, Protocol, Union

import numpy as np
import torch

from lightllm.utils.device_memory import check_fits

# Rows reserved past the allocatable slots: the HOLD slot.
NUM_HOLD_SLOTS = 1


class KvCacheOutOfMemory(RuntimeError):
    """Raised when more slots are asked for than are free."""


class Reclaimer(Protocol):
    """Holds slots it can free on demand (``RadixCache``)."""

    @property
    def evictable_tokens(self) -> int: ...

    def evict(self, num_tokens: int, free_fn: Callable[[torch.Tensor], None]) -> int: ...


class MemoryManager:
    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int, device: str):
        if size <= 0:
            raise ValueError(f"KV cache size must be positive, got {size}")
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.HOLD_SLOT = size
        # [layer_num, size + 1, kv_head_num, head_dim]; k_buffer[layer] is one layer's cache
        buffer_shape = (layer_num, size + NUM_HOLD_SLOTS, head_num, head_dim)
        nbytes = 2 * math.prod(buffer_shape) * dtype.itemsize
        check_fits(nbytes, self.device, f"the KV cache of {size} tokens ({layer_num} layers)",
                   "lower --max_total_token_num (unset, it is sized from free memory)")
        self.k_buffer = torch.zeros(buffer_shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(buffer_shape, dtype=dtype, device=self.device)
        self.reclaimer: Optional[Reclaimer] = None  # set by the prompt cache
        self._init_free_list()

    def _init_free_list(self) -> None:
        # [size] slots; entries [_num_used, size) are free, handed out from the front (numpy: a
        # step's alloc and free cost a few microseconds, torch's CPU ops ten times that)
        self._slot_stack = np.arange(self.size, dtype=np.int64)
        self._num_used = 0
        # [size] True where a slot is free; catches double frees
        self._slot_is_free = np.ones(self.size, dtype=np.bool_)
        # [size] scratch: a freed batch's position of each slot, which finds a slot named twice without a sort
        self._free_pos = np.zeros(self.size, dtype=np.int64)
        self._positions = np.arange(self.size, dtype=np.int64)

    @property
    def can_use_mem_size(self) -> int:
        """Slots free now."""
        return self.size - self._num_used

    @property
    def available_size(self) -> int:
        """Slots an ``alloc`` can hand out: free ones and those the reclaimer can give back."""
        extra = self.reclaimer.evictable_tokens if self.reclaimer is not None else 0
        return self.can_use_mem_size + extra

    def alloc(self, need_size: int) -> torch.Tensor:
        """Returns ``need_size`` distinct free slots, int64 on the CPU."""
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size > self.can_use_mem_size and self.reclaimer is not None:
            self.reclaimer.evict(need_size - self.can_use_mem_size, self.free)
        if need_size > self.can_use_mem_size:
            raise KvCacheOutOfMemory(
                f"KV cache out of memory: need {need_size} slots, {self.can_use_mem_size} of {self.size} free"
            )
        start = self._num_used
        slots = self._slot_stack[start : start + need_size].copy()  # [need_size]
        self._num_used += need_size
        self._slot_is_free[slots] = False
        return torch.from_numpy(slots)

    def free(self, indexes: Union[torch.Tensor, List[int], np.ndarray]) -> None:
        """Gives slots back. Freeing HOLD_SLOT, an unknown slot or a free slot raises.
        Slots on the GPU are copied to the host first (a sync): pass host tensors."""
        if isinstance(indexes, torch.Tensor):
            indexes = indexes.reshape(-1).cpu().numpy()
        slots = np.asarray(indexes, dtype=np.int64).reshape(-1)  # [n] on the host
        n = slots.size
        if n == 0:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= self.size:
            raise ValueError(f"free of slots outside [0, {self.size}) (HOLD_SLOT={self.HOLD_SLOT} is never freed)")
        if self._slot_is_free[slots].any():
            raise ValueError("double free of KV cache slots")
        # a slot named twice keeps its later position: the earlier one reads back another
        positions = self._positions[:n]
        self._free_pos[slots] = positions
        if (self._free_pos[slots] != positions).any():
            raise ValueError("double free of KV cache slots (a slot named twice)")
        self._slot_is_free[slots] = True
        self._num_used -= n
        self._slot_stack[self._num_used : self._num_used + n] = slots

    def free_all(self) -> None:
        self._init_free_list()
