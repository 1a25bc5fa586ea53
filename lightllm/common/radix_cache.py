"""A radix tree over token ids -> KV slots: the prompt cache shared by the requests of a rank.

The KV cache is token-granular (one slot per token, ``req_to_token_indexs[req_idx, pos] = slot``),
so a cached prefix is just the slots of its tokens, shared by every request that starts with it,
without copying. Each node holds a run of token ids (its edge label) and the slots of those
tokens; the path root..node spells a cached token sequence. This follows the design of
LightLLM's ``radix_cache.py`` and SGLang's ``RadixCache``.

Ownership rule (who frees which slot):

- A slot held by the tree belongs to the tree. Only ``evict`` gives it back, through its
  ``free_fn``. A request that matched a prefix reads those slots but never frees them; it locks
  them (``inc_ref(match.last_node)``) while it uses them and unlocks them (``dec_ref``) when done.
- Every other slot of a request belongs to the request: it frees them itself, or hands them to the
  tree with ``insert``. The tree takes the slots of the positions it did not have
  (``slots[cached:]``, ``cached`` being the value ``insert`` returns). The tree never takes
  ``slots[:cached]``: of those, the request frees the ones it allocated itself. For a request that
  matched ``m`` tokens at admission (``m <= cached``: its lock kept them), ``slots[:m]`` are the
  tree's own and ``slots[m:cached]`` are duplicates of KV that another request cached meanwhile:
  the request frees ``slots[m:cached]``.

Lifecycle of a request, for the integrator:

    match = cache.match_prefix(prompt[:-1])  # keep >= 1 token to prefill: it yields the logits
    cache.inc_ref(match.last_node)
    ... req_to_token_indexs[req, :match.length] = match.slots; prefill from match.length ...
    cached = cache.insert(tokens, slots)     # tokens[i] has its KV in slots[i]
    mem_manager.free(slots[match.length:cached])
    cache.dec_ref(match.last_node)

``evict(n, mem_manager.free)`` makes room when the pool runs short: least-recently-used unlocked
leaves first, whole nodes at a time. Locked nodes are never evicted, so a lock handle
(``match.last_node``) stays valid until its ``dec_ref``; a split keeps the handle's object as the
deeper half, so the handle still names the whole locked path.

Recency: every ``match_prefix`` and ``insert`` takes one tick of the clock and stamps every node on
the path it used. A match or insert that ends inside a node splits it, so all tokens of a node
always share one last-access time and one lock count, and a parent is never older than its child.
"""
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

# Rebuild the eviction heap once it holds more than this many entries per cached node: the rest
# are stale (nodes touched, locked, grown or evicted since their entry was pushed).
HEAP_STALE_FACTOR = 2

# The element type of a slot, as ``MemoryManager.alloc`` hands them out (host tensors).
SLOT_DTYPE = torch.int64

Tokens = Union[Sequence[int], torch.Tensor]
Slots = Union[Sequence[int], torch.Tensor]
# Gives slots back to the KV pool (``MemoryManager.free``); called with an int64 host tensor.
FreeFn = Callable[[torch.Tensor], None]
Clock = Callable[[], int]


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=SLOT_DTYPE)


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: a run of tokens and their KV slots. Compared by identity."""

    key: Tuple[int, ...]  # the token ids of this run (empty only at the root)
    slots: torch.Tensor  # [len(key)] int64 host: the KV slot of each token of ``key``
    parent: Optional["TreeNode"] = field(default=None, repr=False)
    # children by their first token (children of one node never share a first token)
    children: Dict[int, "TreeNode"] = field(default_factory=dict, repr=False)
    ref_count: int = 0  # locks of requests whose path passes through this node
    last_access: int = 0  # clock tick of the last match/insert that used this node
    in_tree: bool = True  # False once evicted (or dropped by ``reset``)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    """The longest cached prefix of a token sequence."""

    length: int  # tokens matched
    slots: torch.Tensor  # [length] int64 host: the KV slots of the matched tokens, in order
    last_node: TreeNode  # the node the match ended at (the root when length == 0): lock it


@dataclass(order=True)
class _HeapEntry:
    """An eviction candidate; stale when its node changed after the push (checked at pop)."""

    last_access: int
    seq: int  # push order: breaks ties, so nodes are never compared
    node: TreeNode = field(compare=False)


def _as_key(tokens: Tokens) -> Tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.reshape(-1).tolist())
    # numpy integers hash and compare as the ints they hold, so a sequence's items are kept as they are
    return tuple(tokens)


def _as_slots(slots: Slots) -> torch.Tensor:
    # A copy: the tree must not see later writes to the caller's tensor.
    return torch.as_tensor(slots, dtype=SLOT_DTYPE).reshape(-1).cpu().clone()


# Tokens compared per slice by _common_prefix_len before it looks at single tokens.
COMPARE_BLOCK = 256


def _common_prefix_len(key: Tuple[int, ...], tokens: Tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:]``: block by block (tuple slices
    compare in C), then token by token inside the first block that differs."""
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i:i + COMPARE_BLOCK] == tokens[start + i:start + min(i + COMPARE_BLOCK, n)]:
        i += COMPARE_BLOCK
    i = min(i, n)
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    """Token ids -> KV slots of every cached sequence, with locks and LRU eviction of leaves."""

    def __init__(self, clock: Optional[Clock] = None):
        # The default clock ticks once per call, so every match/insert gets its own time.
        self._clock: Clock = clock if clock is not None else itertools.count(1).__next__
        self._push_seq = itertools.count()
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = TreeNode(key=(), slots=_empty_slots())
        self._heap: List[_HeapEntry] = []
        self._total_tokens = 0
        self._locked_tokens = 0
        self._num_nodes = 0  # nodes other than the root
        self._evicted_tokens = 0

    # ---- counters ----
    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def total_tokens(self) -> int:
        """Tokens cached (each slot held by the tree counts once, however many requests share it)."""
        return self._total_tokens

    @property
    def locked_tokens(self) -> int:
        """Cached tokens on some request's locked path: not evictable."""
        return self._locked_tokens

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens no request locks: what ``evict`` can free."""
        return self._total_tokens - self._locked_tokens

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted since construction (or the last ``reset``)."""
        return self._evicted_tokens

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root."""
        return self._num_nodes

    # ---- lookup and insertion ----
    def match_prefix(self, tokens: Tokens) -> MatchResult:
        """The longest cached prefix of ``tokens``; stamps its path as used now.

        A match that ends inside a node splits it, so ``last_node`` covers exactly the match.
        Locks nothing: call ``inc_ref(result.last_node)`` before the next ``evict``."""
        path = self._walk(_as_key(tokens))
        node = path[-1]
        self._push_if_evictable(node)
        parts = [n.slots for n in path[1:]]
        slots = torch.cat(parts) if parts else _empty_slots()
        return MatchResult(length=slots.numel(), slots=slots, last_node=node)

    def _walk(self, key: Tuple[int, ...]) -> List[TreeNode]:
        """The path root..node of the longest cached prefix of ``key``, stamped as used now (one
        clock tick). A prefix that ends inside a node, or diverges there, splits it: every node of
        the path is used whole."""
        now = self._clock()
        node, pos = self._root, 0
        node.last_access = now
        path = [node]
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            node = child
            node.last_access = now
            path.append(node)
            pos += matched
        return path

    def insert(self, tokens: Tokens, slots: Slots) -> int:
        """Cache ``tokens`` whose KV lives in ``slots`` (``slots[i]`` holds ``tokens[i]``).

        Returns ``cached``: how many leading tokens the tree already had. The tree keeps its own
        slots for those positions and takes ``slots[cached:]``; the caller still owns
        ``slots[:cached]`` and frees those it allocated itself (see the module docstring).
        Stamps the whole path as used now; locks nothing."""
        key = _as_key(tokens)
        values = _as_slots(slots)
        if values.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {values.numel()} slots")
        path = self._walk(key)
        node = path[-1]
        cached = sum(len(n.key) for n in path)
        if cached < len(key):
            leaf = TreeNode(key=key[cached:], slots=values[cached:].clone(), parent=node, last_access=node.last_access)
            node.children[key[cached]] = leaf
            self._num_nodes += 1
            self._total_tokens += len(leaf.key)
            node = leaf
        self._push_if_evictable(node)
        return cached

    def insert_request(self, tokens: Tokens, slots: Slots, owned_from: int) -> torch.Tensor:
        """``insert`` for a request that is done: ``slots[:owned_from]`` are the tree's own (its
        locked match), the rest its own. Returns the own slots the tree did not take (duplicates of
        KV another request cached meanwhile): the caller frees them."""
        values = _as_slots(slots)
        cached = self.insert(tokens, values)
        return values[owned_from:max(cached, owned_from)].clone()

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after its first ``at`` tokens (0 < at < len); returns the new upper half.

        ``node`` itself becomes the lower half, so a caller's handle to it still names the same
        path. The upper half inherits the lock count (every lock through ``node`` passes through
        it) and the last-access time; token counts do not change."""
        assert 0 < at < len(node.key), f"split at {at} of a {len(node.key)}-token node"
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = TreeNode(
            key=node.key[:at],
            slots=node.slots[:at].clone(),
            parent=parent,
            ref_count=node.ref_count,
            last_access=node.last_access,
        )
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.slots = node.slots[at:].clone()
        node.parent = upper
        upper.children[node.key[0]] = node
        self._num_nodes += 1
        return upper

    # ---- locks ----
    def inc_ref(self, node: TreeNode) -> None:
        """Lock the path root..node for a request: none of it can be evicted until ``dec_ref``."""
        if not node.in_tree:
            raise ValueError("inc_ref of a node no longer in the tree (evicted after its match)")
        walk: Optional[TreeNode] = node
        while walk is not None:
            if walk.ref_count == 0:
                self._locked_tokens += len(walk.key)
            walk.ref_count += 1
            walk = walk.parent

    def lock_cost(self, node: TreeNode) -> int:
        """Tokens ``inc_ref(node)`` would add to ``locked_tokens`` (those of unlocked nodes on its path)."""
        cost, walk = 0, node
        while walk is not None:
            if walk.ref_count == 0:
                cost += len(walk.key)
            walk = walk.parent
        return cost

    def dec_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_ref(node)``. Raises, changing nothing, when ``node`` holds no lock."""
        if not node.in_tree or node.ref_count <= 0:
            raise ValueError("unbalanced dec_ref: the node holds no lock")
        walk: Optional[TreeNode] = node
        while walk is not None:
            walk.ref_count -= 1
            if walk.ref_count == 0:
                self._locked_tokens -= len(walk.key)
                self._push_if_evictable(walk)
            walk = walk.parent

    # ---- eviction ----
    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        """Free at least ``num_tokens`` cached tokens (fewer when fewer are evictable).

        Evicts unlocked leaves, least recently used first, whole nodes at a time (so it may free
        more than asked); a parent whose last child goes becomes a leaf and a candidate.
        ``free_fn(slots)`` is called once per evicted node with its slots, before the node leaves
        the tree: if it raises, that node stays cached. Returns the tokens evicted."""
        if num_tokens < 0:
            raise ValueError(f"evict: num_tokens must be >= 0, got {num_tokens}")
        evicted = 0
        while evicted < num_tokens and self._heap:
            entry = self._heap[0]
            node = entry.node
            if not self._is_evictable(node) or node.last_access != entry.last_access:
                heapq.heappop(self._heap)  # stale
                continue
            free_fn(node.slots)
            heapq.heappop(self._heap)
            parent = self._detach(node)
            evicted += len(node.key)
            self._push_if_evictable(parent)
        self._evicted_tokens += evicted
        return evicted

    def _detach(self, leaf: TreeNode) -> TreeNode:
        """Remove an evicted leaf from the tree; returns its parent."""
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.ref_count == 0
        del parent.children[leaf.key[0]]
        leaf.in_tree = False
        leaf.parent = None
        self._num_nodes -= 1
        self._total_tokens -= len(leaf.key)
        return parent

    def _is_evictable(self, node: TreeNode) -> bool:
        return node.in_tree and node is not self._root and node.is_leaf and node.ref_count == 0

    def _push_if_evictable(self, node: TreeNode) -> None:
        """Queue ``node`` for eviction at its current last-access time, if it can be evicted."""
        if not self._is_evictable(node):
            return
        heapq.heappush(self._heap, _HeapEntry(node.last_access, next(self._push_seq), node))
        if len(self._heap) > HEAP_STALE_FACTOR * max(self._num_nodes, 1):
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries: one entry per evictable leaf."""
        self._heap = [
            _HeapEntry(n.last_access, next(self._push_seq), n) for n in self._nodes() if self._is_evictable(n)
        ]
        heapq.heapify(self._heap)

    def _nodes(self) -> List[TreeNode]:
        """Every node other than the root."""
        out: List[TreeNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        """Forget every node without freeing any slot: for when the KV pool itself was reset
        (``MemoryManager.free_all``). Old handles become invalid."""
        for node in self._nodes():
            node.in_tree = False
        self._init_tree()
