"""lightllm/utils/host_copy.py: values reach the device intact, and the pinned ring never rewrites bytes
a queued copy may still read (its halves, by hand with recorded events)."""
import numpy as np
import pytest
import torch

from lightllm.utils.host_copy import RING_ALIGN, PinnedRing, to_device
from unit_tests.devices import needs_cuda


class FakeEvent:
    """Records when it was recorded and synchronized, in the order of one shared log."""

    def __init__(self, log):
        self.log = log

    def record(self, stream=None):
        self.log.append(("record", id(self)))

    def synchronize(self):
        self.log.append(("sync", id(self)))


def _ring(nbytes):
    log = []
    return PinnedRing(torch.device("cpu"), nbytes, make_event=lambda: FakeEvent(log), pin=False), log


def test_ring_copies_round_trip_and_take_aligned_bytes_of_one_half():
    ring, log = _ring(4 * RING_ALIGN * 2)  # halves of 4 slots
    outs = [ring.copy(np.arange(i, i + 3, dtype=np.int64), torch.int64) for i in range(4)]
    assert [o.tolist() for o in outs] == [[i, i + 1, i + 2] for i in range(4)]
    assert ring.half == 0 and ring.head == 4 * RING_ALIGN and log == []  # 24 bytes took one aligned slot each
    # the copies own their memory: later writes to the ring do not change them
    ring.copy(np.full(3, 7, dtype=np.int64), torch.int64)
    assert outs[0].tolist() == [0, 1, 2]


def test_ring_leaves_a_half_behind_an_event_and_waits_for_it_before_reuse():
    ring, log = _ring(4 * RING_ALIGN * 2)
    slot = np.zeros(RING_ALIGN // 8, dtype=np.int64)  # exactly one slot
    for _ in range(4):
        ring.copy(slot, torch.int64)
    assert log == []
    ring.copy(slot, torch.int64)  # half 0 is full: record its event, go to half 1 (never left: no wait)
    assert ring.half == 1 and [kind for kind, _ in log] == ["record"]
    first = log[0][1]
    for _ in range(3):
        ring.copy(slot, torch.int64)
    ring.copy(slot, torch.int64)  # half 1 full: record, then wait for half 0's event before rewriting it
    assert ring.half == 0 and ring.head == RING_ALIGN
    assert [kind for kind, _ in log] == ["record", "record", "sync"] and log[2][1] == first


def test_ring_refuses_what_does_not_fit_a_half_and_empty_copies():
    ring, _ = _ring(4 * RING_ALIGN * 2)
    assert ring.usable(4 * RING_ALIGN) and not ring.usable(4 * RING_ALIGN + 1) and not ring.usable(0)


def test_ring_takes_int32_and_odd_sizes():
    ring, _ = _ring(1 << 12)
    a = ring.copy(np.array([5, -1, 2**31 - 1], dtype=np.int32), torch.int32)
    b = ring.copy(np.arange(17, dtype=np.int64), torch.int64)
    assert a.dtype == torch.int32 and a.tolist() == [5, -1, 2**31 - 1] and b.tolist() == list(range(17))


@pytest.mark.parametrize("values", [[3, 1, 2], (), torch.tensor([4, 5], dtype=torch.int32)])
def test_to_device_on_cpu(values):
    out = to_device(values, torch.device("cpu"), torch.int64)
    assert out.dtype == torch.int64 and out.tolist() == [int(v) for v in values]


@needs_cuda
def test_to_device_through_the_ring_behind_a_busy_stream():
    """Copies queued behind a long kernel, many laps of the ring: every value arrives as sent."""
    dev = torch.device("cuda")
    sent, got = [], []
    for i in range(3000):
        if i % 500 == 0:
            torch.cuda._sleep(10_000_000)  # keep the stream busy while the host queues copies
        values = list(range(i, i + 1 + i % 300))
        sent.append(values)
        got.append(to_device(values, dev, torch.int64 if i % 2 else torch.int32))
    torch.cuda.synchronize()
    assert all(g.tolist() == s for g, s in zip(got, sent))
    big = list(range(10**6))  # more than a half: its own pinned buffer
    assert to_device(big, dev).cpu().tolist() == big
