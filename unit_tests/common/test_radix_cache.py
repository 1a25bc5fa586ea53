"""The radix prompt cache against a brute-force reference.

The reference knows nothing of nodes: it keeps, for every cached token, the whole prefix ending at
it (a tuple) -> its slot, its last use (the op counter of the last match/insert that used it) and
how many locks cover it. Longest-prefix match scans prefix lengths; LRU eviction sorts the unlocked
tokens by (last use, deepest first). The tree's default clock ticks once per match/insert as the
reference's counter does, so the two must agree token by token, times and lock counts included.
"""
import random
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest
import torch

from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.radix_cache import HEAP_STALE_FACTOR, MatchResult, RadixCache, TreeNode

Prefix = Tuple[int, ...]


class BruteForceCache:
    """Per-token model of the cache: prefix -> slot, last use, lock count."""

    def __init__(self):
        self.slot: Dict[Prefix, int] = {}
        self.last_use: Dict[Prefix, int] = {}
        self.locks: Counter = Counter()
        self.tick = 0

    def _longest(self, tokens: Prefix) -> int:
        return max((i for i in range(len(tokens) + 1) if tokens[:i] in self.slot or i == 0))

    def match(self, tokens: Prefix) -> Tuple[int, List[int]]:
        self.tick += 1
        m = self._longest(tokens)
        for i in range(1, m + 1):
            self.last_use[tokens[:i]] = self.tick
        return m, [self.slot[tokens[:i]] for i in range(1, m + 1)]

    def insert(self, tokens: Prefix, slots: List[int]) -> int:
        self.tick += 1
        m = self._longest(tokens)
        for i in range(1, len(tokens) + 1):
            self.slot.setdefault(tokens[:i], slots[i - 1])
            self.last_use[tokens[:i]] = self.tick
        return m

    def lock(self, tokens: Prefix, m: int, delta: int) -> None:
        for i in range(1, m + 1):
            self.locks[tokens[:i]] += delta
            assert self.locks[tokens[:i]] >= 0

    def eviction_order(self) -> List[Prefix]:
        free = [p for p in self.slot if self.locks[p] == 0]
        return sorted(free, key=lambda p: (self.last_use[p], -len(p)))

    def remove(self, prefixes: List[Prefix]) -> None:
        for p in prefixes:
            del self.slot[p], self.last_use[p]

    @property
    def locked(self) -> int:
        return sum(1 for p in self.slot if self.locks[p] > 0)


def tree_state(cache: RadixCache) -> Dict[Prefix, Tuple[int, int, int]]:
    """prefix -> (slot, last_access, ref_count) of every cached token, checking the tree's shape."""
    out: Dict[Prefix, Tuple[int, int, int]] = {}
    nodes = 0
    stack: List[Tuple[Prefix, TreeNode]] = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for first, child in node.children.items():
            nodes += 1
            assert child.in_tree and child.parent is node and child.key[0] == first
            assert len(child.key) == child.slots.numel() > 0
            assert child.slots.dtype == torch.int64 and child.slots.device.type == "cpu"
            # Locks and recency only grow towards the root.
            assert child.ref_count <= node.ref_count and child.last_access <= node.last_access
            p = prefix
            for token, slot in zip(child.key, child.slots.tolist()):
                p = p + (token,)
                out[p] = (slot, child.last_access, child.ref_count)
            stack.append((p, child))
    assert nodes == cache.num_nodes
    return out


def reference_state(ref: BruteForceCache) -> Dict[Prefix, Tuple[int, int, int]]:
    return {p: (s, ref.last_use[p], ref.locks[p]) for p, s in ref.slot.items()}


def assert_same(cache: RadixCache, ref: BruteForceCache) -> None:
    assert tree_state(cache) == reference_state(ref)
    assert cache.total_tokens == len(ref.slot)
    assert cache.locked_tokens == ref.locked
    assert cache.evictable_tokens == len(ref.slot) - ref.locked


def slots_of(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class Recorder:
    """A free_fn that records each call (one per evicted node)."""

    def __init__(self):
        self.calls: List[List[int]] = []

    def __call__(self, slots: torch.Tensor) -> None:
        self.calls.append(slots.tolist())

    @property
    def freed(self) -> List[int]:
        return [s for call in self.calls for s in call]


class ManualClock:
    def __init__(self):
        self.now = 0

    def __call__(self) -> int:
        return self.now


# ---------------------------------------------------------------- match / split / insert


def test_empty_cache_matches_nothing():
    cache = RadixCache()
    r = cache.match_prefix([1, 2, 3])
    assert isinstance(r, MatchResult)
    assert r.length == 0 and r.slots.numel() == 0 and r.slots.dtype == torch.int64
    assert r.last_node is cache.root
    assert cache.insert([], []) == 0
    assert cache.total_tokens == cache.num_nodes == 0


def test_match_within_a_node_splits_it_and_keeps_slots_consistent():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5], slots_of([10, 11, 12, 13, 14])) == 0
    (whole,) = cache.root.children.values()
    r = cache.match_prefix([1, 2, 3, 9])
    assert r.length == 3 and r.slots.tolist() == [10, 11, 12]
    upper = r.last_node
    # The new node is the upper half; the old object keeps the lower half.
    assert upper is not whole and upper.parent is cache.root and cache.root.children[1] is upper
    assert upper.key == (1, 2, 3) and upper.slots.tolist() == [10, 11, 12]
    assert whole.parent is upper and upper.children == {4: whole}
    assert whole.key == (4, 5) and whole.slots.tolist() == [13, 14]
    assert cache.num_nodes == 2 and cache.total_tokens == 5
    # Only the matched half was used now.
    assert upper.last_access > whole.last_access
    full = cache.match_prefix((1, 2, 3, 4, 5, 6))
    assert full.length == 5 and full.slots.tolist() == [10, 11, 12, 13, 14] and full.last_node is whole


def test_match_across_nodes_returns_slots_in_order():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    assert cache.insert([1, 2, 7, 8], slots_of([50, 51, 4, 5])) == 2
    assert cache.insert([1, 2, 7, 9, 9], slots_of([60, 61, 62, 6, 7])) == 3
    r = cache.match_prefix(torch.tensor([1, 2, 7, 9, 9, 1]))
    assert r.length == 5 and r.slots.tolist() == [0, 1, 4, 6, 7]
    assert cache.total_tokens == 8 and cache.num_nodes == 5


def test_insert_returns_cached_length_and_the_caller_frees_its_duplicates():
    mem = MemoryManager(8, torch.float32, 1, 1, 1, "cpu")
    cache = RadixCache()
    a = mem.alloc(4)
    assert cache.insert([5, 6, 7, 8], a) == 0  # the tree takes all four
    b = mem.alloc(3)
    cached = cache.insert([5, 6, 1], b)
    assert cached == 2
    mem.free(b[:cached])  # duplicates of what the tree had: the caller's to free
    assert mem.can_use_mem_size == 8 - 5 == 8 - cache.total_tokens
    assert cache.match_prefix([5, 6, 1]).slots.tolist() == a[:2].tolist() + b[2:].tolist()


def test_insert_of_a_cached_prefix_splits_so_recency_is_per_token():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    cache.insert([9], slots_of([4]))
    assert cache.insert([1, 2], slots_of([7, 8])) == 2  # nothing taken; [1, 2] used now
    upper = cache.root.children[1]
    assert upper.key == (1, 2) and list(upper.children) == [3]
    freed = Recorder()
    # [3, 4] was last used before [9]: it goes first.
    assert cache.evict(1, freed) == 2 and freed.calls == [[2, 3]]


def test_insert_checks_lengths_and_copies_the_slots():
    cache = RadixCache()
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        cache.insert([1, 2, 3], [0, 1])
    src = slots_of([4, 5, 6])
    cache.insert([1, 2, 3], src)
    src.fill_(0)
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [4, 5, 6]
    assert cache.insert([1, 2, 3, 4], [4, 5, 6, 7]) == 3  # a list works too


# ---------------------------------------------------------------- locks


def test_locks_count_tokens_once_and_unbalanced_dec_ref_raises():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    cache.insert([1, 2, 5], slots_of([0, 1, 4]))
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 5]).last_node
    cache.inc_ref(a)
    cache.inc_ref(b)
    cache.inc_ref(b)
    assert cache.locked_tokens == 5 and cache.evictable_tokens == 0
    assert cache.root.ref_count == 3 and cache.root.children[1].ref_count == 3
    cache.dec_ref(b)
    cache.dec_ref(b)
    assert cache.locked_tokens == 4 and cache.evictable_tokens == 1
    with pytest.raises(ValueError, match="unbalanced"):
        cache.dec_ref(b)
    assert cache.locked_tokens == 4 and cache.root.ref_count == 1  # the failed call changed nothing
    cache.dec_ref(a)
    assert cache.locked_tokens == 0 and cache.root.ref_count == 0
    with pytest.raises(ValueError, match="unbalanced"):
        cache.dec_ref(cache.root)


def test_empty_match_locks_the_root_only():
    cache = RadixCache()
    cache.insert([1], [0])
    r = cache.match_prefix([2])
    cache.inc_ref(r.last_node)
    assert cache.locked_tokens == 0 and cache.root.ref_count == 1
    cache.dec_ref(r.last_node)
    assert cache.root.ref_count == 0


def test_split_of_a_locked_node_keeps_the_lock_on_both_halves():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    handle = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_ref(handle)
    # Another request shares [1, 2] and diverges: the locked node is split under the lock.
    assert cache.insert([1, 2, 8], slots_of([9, 9, 4])) == 2
    upper = handle.parent
    assert upper.key == (1, 2) and handle.key == (3, 4)
    assert upper.ref_count == handle.ref_count == 1 and upper.children[8].ref_count == 0
    assert cache.locked_tokens == 4 and cache.evictable_tokens == 1
    freed = Recorder()
    assert cache.evict(cache.total_tokens, freed) == 1 and freed.calls == [[4]]
    cache.dec_ref(handle)  # the handle still names the whole locked path
    assert upper.ref_count == handle.ref_count == 0 and cache.locked_tokens == 0
    assert cache.evict(cache.total_tokens, freed) == 4 and freed.calls[1:] == [[2, 3], [0, 1]]


# ---------------------------------------------------------------- eviction


def test_evict_takes_least_recently_used_leaves_and_then_their_parents():
    clock = ManualClock()
    cache = RadixCache(clock=clock)
    clock.now = 1
    cache.insert([1, 2, 3], slots_of([0, 1, 2]))
    clock.now = 2
    cache.insert([1, 2, 4, 5], slots_of([0, 1, 3, 4]))
    clock.now = 3
    cache.insert([7, 7], slots_of([5, 6]))
    clock.now = 4
    cache.match_prefix([1, 2, 3])  # [3] is now newer than [4, 5] and [7, 7]
    freed = Recorder()
    assert cache.evict(1, freed) == 2 and freed.calls == [[3, 4]]
    assert cache.evict(1, freed) == 2 and freed.calls[-1] == [5, 6]
    # [3] goes, then its parent [1, 2] is a leaf (last used at the same time, so right after it).
    assert cache.evict(2, freed) == 3 and freed.calls[-2:] == [[2], [0, 1]]
    assert cache.total_tokens == cache.num_nodes == 0 and cache.evicted_tokens == 7


def test_evict_never_frees_locked_tokens_and_stops_when_nothing_is_left():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots_of([0, 1, 2]))
    cache.insert([1, 2, 4], slots_of([0, 1, 3]))
    cache.insert([5], slots_of([4]))
    cache.inc_ref(cache.match_prefix([1, 2, 3]).last_node)
    freed = Recorder()
    assert cache.evict(0, freed) == 0 and freed.calls == []
    with pytest.raises(ValueError):
        cache.evict(-1, freed)
    assert cache.evict(100, freed) == 2
    assert sorted(freed.freed) == [3, 4]
    assert cache.total_tokens == cache.locked_tokens == 3 and cache.evictable_tokens == 0
    assert cache.evict(100, freed) == 0
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [0, 1, 2]


def test_evict_then_reinsert_caches_the_new_slots():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots_of([0, 1, 2]))
    stale = cache.match_prefix([1, 2, 3]).last_node
    freed = Recorder()
    assert cache.evict(3, freed) == 3 and freed.freed == [0, 1, 2]
    assert not stale.in_tree
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.inc_ref(stale)  # matched, then evicted before it was locked
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.insert([1, 2, 3], slots_of([7, 8, 9])) == 0
    r = cache.match_prefix([1, 2, 3])
    assert r.length == 3 and r.slots.tolist() == [7, 8, 9]
    assert cache.evicted_tokens == 3 and cache.total_tokens == 3


def test_a_failing_free_fn_leaves_the_node_cached():
    cache = RadixCache()
    cache.insert([1, 2], slots_of([0, 1]))

    def fail(slots: torch.Tensor) -> None:
        raise RuntimeError("pool refused")

    with pytest.raises(RuntimeError):
        cache.evict(1, fail)
    assert cache.total_tokens == 2 and cache.evicted_tokens == 0
    freed = Recorder()
    assert cache.evict(1, freed) == 2 and freed.freed == [0, 1]


def test_the_heap_of_candidates_stays_bounded():
    cache = RadixCache()
    cache.insert([1, 2], slots_of([0, 1]))
    cache.insert([3], slots_of([2]))
    for _ in range(100):
        cache.match_prefix([1, 2])  # each touch of a leaf queues a fresh entry
    assert len(cache._heap) <= HEAP_STALE_FACTOR * cache.num_nodes
    freed = Recorder()
    assert cache.evict(1, freed) == 1 and freed.calls == [[2]]


def test_reset_forgets_everything_without_freeing():
    cache = RadixCache()
    cache.insert([1, 2], slots_of([0, 1]))
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_ref(node)
    cache.reset()
    assert cache.total_tokens == cache.locked_tokens == cache.num_nodes == 0
    assert not node.in_tree and cache.match_prefix([1, 2]).length == 0
    with pytest.raises(ValueError):
        cache.dec_ref(node)


# ---------------------------------------------------------------- property test


POOL_SIZE = 160
VOCAB = 3  # few token ids: many accidental shared prefixes and splits
NUM_SYSTEM_PROMPTS = 3
SYSTEM_PROMPT_LEN = (4, 12)
TURN_LEN = (0, 10)
GEN_LEN = (0, 6)
ROUNDS = 1500
SEEDS = (0, 1, 2)


@dataclass
class Request:
    tokens: Prefix  # prompt + generated: what finish inserts
    matched: int  # prompt tokens matched (and locked) at admission
    node: TreeNode  # the lock handle
    slots: List[int]  # [len(tokens)]: the tree's [:matched], then the request's own


class Simulation:
    """Requests over one pool, the tree and the reference side by side; conservation checked."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.mem = MemoryManager(POOL_SIZE, torch.float32, 1, 1, 1, "cpu")
        self.cache = RadixCache()
        self.ref = BruteForceCache()
        self.active: List[Request] = []
        self.history: List[Prefix] = []
        self.systems = [self.random_tokens(*SYSTEM_PROMPT_LEN) for _ in range(NUM_SYSTEM_PROMPTS)]
        self.taken: Counter = Counter()  # slots the tree took (with multiplicity over reuse)
        self.evicted: Counter = Counter()  # slots handed to free_fn

    def random_tokens(self, lo: int, hi: int) -> Prefix:
        return tuple(self.rng.randrange(VOCAB) for _ in range(self.rng.randint(lo, hi)))

    def prompt(self) -> Prefix:
        kind = self.rng.random()
        if self.history and kind < 0.4:  # the next turn of a conversation
            base = self.rng.choice(self.history)
        elif self.history and kind < 0.55:  # a prefix of an earlier one: a match inside a node
            seen = self.rng.choice(self.history)
            return seen[: self.rng.randint(0, len(seen))]
        elif kind < 0.85:
            base = self.rng.choice(self.systems)
        else:
            base = ()
        return base + self.random_tokens(*TURN_LEN)

    def free_fn(self, slots: torch.Tensor) -> None:
        self.evicted.update(slots.tolist())
        self.mem.free(slots)  # raises on a double free

    def evict(self, n: int) -> None:
        order = self.ref.eviction_order()
        rec = Recorder()
        got = self.cache.evict(n, lambda s: (rec(s), self.free_fn(s)))
        assert got == len(rec.freed) and got <= len(order)
        assert got >= n or got == len(order)  # enough, or all that could go
        if rec.calls:
            assert got - len(rec.calls[-1]) < n  # stopped as soon as it had enough
        expected = order[:got]
        assert sorted(rec.freed) == sorted(self.ref.slot[p] for p in expected)
        assert all(self.ref.locks[p] == 0 for p in expected)
        self.ref.remove(expected)

    def alloc(self, n: int):
        short = n - self.mem.can_use_mem_size
        if short > 0:
            self.evict(short)
        return self.mem.alloc(n).tolist() if n <= self.mem.can_use_mem_size else None

    def admit(self) -> None:
        prompt = self.prompt()
        tokens = prompt + self.random_tokens(*GEN_LEN)
        r = self.cache.match_prefix(prompt)
        m, ref_slots = self.ref.match(prompt)
        assert r.length == m and r.slots.tolist() == ref_slots
        self.cache.inc_ref(r.last_node)
        self.ref.lock(prompt, m, +1)
        own = self.alloc(len(tokens) - m)
        if own is None:  # the pool is full of locked KV: the request waits (is dropped here)
            self.cache.dec_ref(r.last_node)
            self.ref.lock(prompt, m, -1)
            return
        self.active.append(Request(tokens, m, r.last_node, ref_slots + own))

    def finish(self, req: Request) -> None:
        self.active.remove(req)
        cached = self.cache.insert(req.tokens, req.slots)
        assert cached == self.ref.insert(req.tokens, req.slots)
        assert cached >= req.matched  # the lock kept the matched prefix
        self.mem.free(req.slots[req.matched : cached])
        self.taken.update(req.slots[cached:])
        self.cache.dec_ref(req.node)
        self.ref.lock(req.tokens, req.matched, -1)
        self.history.append(req.tokens)

    def abort(self, req: Request) -> None:
        self.active.remove(req)
        self.mem.free(req.slots[req.matched :])
        self.cache.dec_ref(req.node)
        self.ref.lock(req.tokens, req.matched, -1)

    def insert_fresh(self) -> None:
        """A caller with fresh slots for every position: it frees slots[:cached] itself."""
        tokens = self.prompt()
        slots = self.alloc(len(tokens))
        if slots is None:
            return
        cached = self.cache.insert(tokens, slots)
        assert cached == self.ref.insert(tokens, slots)
        self.mem.free(slots[:cached])
        self.taken.update(slots[cached:])

    def lookup(self) -> None:
        tokens = self.prompt()
        r = self.cache.match_prefix(tokens)
        assert (r.length, r.slots.tolist()) == self.ref.match(tokens)

    def check(self) -> None:
        assert_same(self.cache, self.ref)
        cached = Counter(self.ref.slot.values())
        assert max(cached.values(), default=1) == 1  # the tree holds a slot once
        # Conservation: what free_fn got is what the tree took minus what it still holds.
        assert self.taken - self.evicted == cached and self.evicted - self.taken == Counter()
        own = [s for req in self.active for s in req.slots[req.matched :]]
        used = set(cached) | set(own)
        assert len(used) == len(cached) + len(own)  # nobody shares a slot with the tree by mistake
        assert self.mem.can_use_mem_size == POOL_SIZE - len(used)
        assert self.cache.root.ref_count == len(self.active)

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35:
            self.admit()
        elif op < 0.6 and self.active:
            self.finish(self.rng.choice(self.active))
        elif op < 0.67 and self.active:
            self.abort(self.rng.choice(self.active))
        elif op < 0.77:
            self.insert_fresh()
        elif op < 0.9:
            self.lookup()
        else:
            self.evict(self.rng.randint(0, POOL_SIZE // 4))

    def drain(self) -> None:
        while self.active:
            self.finish(self.active[0])
        self.evict(self.cache.total_tokens)
        assert self.cache.total_tokens == self.cache.num_nodes == 0 and not self.ref.slot
        assert self.mem.can_use_mem_size == POOL_SIZE
        assert self.evicted == self.taken  # every slot the tree took was freed exactly once
        assert self.cache.evicted_tokens == sum(self.evicted.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_matches_the_brute_force_reference(seed):
    sim = Simulation(seed)
    for _ in range(ROUNDS):
        sim.step()
        sim.check()
    sim.drain()
    sim.check()
    # The workload did exercise what it is meant to.
    assert sim.cache.evicted_tokens > POOL_SIZE and len(sim.history) > ROUNDS // 10
