import pytest
import torch

from lightllm.common.kv_cache_mem_manager import KvCacheOutOfMemory, MemoryManager

SIZE = 16
KV_HEADS = 2
HEAD_DIM = 4
LAYERS = 3


def _manager() -> MemoryManager:
    return MemoryManager(SIZE, torch.float32, KV_HEADS, HEAD_DIM, LAYERS, "cpu")


def test_buffers_have_a_hold_slot_per_layer():
    mem = _manager()
    assert mem.HOLD_SLOT == SIZE
    assert mem.k_buffer[LAYERS - 1].shape == (SIZE + 1, KV_HEADS, HEAD_DIM)
    assert mem.v_buffer.shape == (LAYERS, SIZE + 1, KV_HEADS, HEAD_DIM)
    assert mem.can_use_mem_size == SIZE


def test_alloc_gives_distinct_int64_host_slots():
    mem = _manager()
    a, b = mem.alloc(5), mem.alloc(7)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    assert len(set(a.tolist()) | set(b.tolist())) == 12
    assert mem.can_use_mem_size == SIZE - 12
    assert mem.alloc(0).numel() == 0


def test_exhaustion_raises_and_changes_nothing():
    mem = _manager()
    mem.alloc(SIZE - 2)
    with pytest.raises(KvCacheOutOfMemory, match="need 3 slots, 2 of 16 free"):
        mem.alloc(3)
    assert mem.can_use_mem_size == 2
    assert mem.alloc(2).numel() == 2


def test_free_returns_slots_for_reuse():
    mem = _manager()
    a = mem.alloc(SIZE)
    mem.free(a[3:9])
    mem.free(a[:2].tolist())  # a list works too
    assert mem.can_use_mem_size == 8
    again = mem.alloc(8)
    assert sorted(again.tolist()) == sorted(a[:2].tolist() + a[3:9].tolist())
    mem.free(torch.tensor([], dtype=torch.int64))
    assert mem.can_use_mem_size == 0


def test_double_free_is_caught():
    mem = _manager()
    a = mem.alloc(4)
    mem.free(a[:2])
    with pytest.raises(ValueError, match="double free"):
        mem.free(a[1:3])
    with pytest.raises(ValueError, match="double free"):
        mem.free([int(a[3]), int(a[3])])  # twice in one call
    with pytest.raises(ValueError, match="double free"):
        mem.free([SIZE - 1])  # never allocated
    assert mem.can_use_mem_size == SIZE - 2


def test_a_slot_named_twice_anywhere_in_a_batch_is_caught_and_changes_nothing():
    mem = _manager()
    a = mem.alloc(6).tolist()
    for bad in ([a[0], a[1], a[2], a[1]], [a[4], a[0], a[5], a[3], a[2], a[4]], [a[5]] * 3):
        with pytest.raises(ValueError, match="double free"):
            mem.free(bad)
        assert mem.can_use_mem_size == SIZE - 6  # the batch was refused whole
    mem.free([a[2], a[0], a[5]])  # then a clean batch of the same slots goes back
    mem.free(torch.tensor([a[1], a[4], a[3]]))
    assert mem.can_use_mem_size == SIZE
    assert sorted(mem.alloc(SIZE).tolist()) == list(range(SIZE))


def test_hold_slot_is_never_allocated_nor_freed():
    mem = _manager()
    slots = mem.alloc(SIZE)
    assert mem.HOLD_SLOT not in slots.tolist()
    with pytest.raises(ValueError, match="HOLD_SLOT"):
        mem.free([mem.HOLD_SLOT])
    with pytest.raises(ValueError, match="outside"):
        mem.free([-1])
    mem.free(slots)
    for _ in range(3):  # churn: still never handed out
        assert mem.HOLD_SLOT not in mem.alloc(SIZE).tolist()
        mem.free_all()
    assert mem.can_use_mem_size == SIZE
