"""The prompt cache of a rank: the radix tree (``lightllm/common/radix_cache.py``) wired to requests.

LightLLM's dynamic prompt cache (SGLang's RadixAttention, vLLM's prefix caching): the KV of the
prompts (and outputs) a rank has seen stays in the pool, and a new prompt prefills only what
follows its longest cached prefix. A request's life, for the code that calls this:

- admission (``ReqQueue``): ``match(req)`` finds the prefix; the queue checks the KV budget with it
  (the prefix's slots are not the request's to reserve; the tree's locked tokens count once),
  then ``lock(req, match)`` sets ``req.prompt_cached_len`` and keeps the prefix in the tree.
- the backend's ``add_reqs`` points the request's first ``prompt_cached_len`` positions at the
  prefix's slots and prefill starts there (a chunk that starts late, as any later chunk).
- ``cache_prompt(req)`` once its prefill is done (SGLang caches at that point too): its prompt
  goes into the tree and its lock moves to the end of it, so requests that arrive while it decodes
  share the prompt; the tree's slots no longer count in the request's KV reservation.
- ``release(req)`` when it is done (finished, aborted, refused by the backend): its tokens go into
  the tree, the slots the tree did not take go back to the pool, the lock goes (``take_back``: the
  same, but it returns those slots, for a caller that frees several requests' slots at once).
- the pool evicts unlocked cached tokens before an ``alloc`` would fail (``MemoryManager.reclaimer``).

What is cached with an MTP draft (``PrefixCacheRule``, reported by the proposer): the target's KV
of a position depends on the tokens up to it, so any prefix is exact. A draft with its own KV per
position (eagle with attention) computes the KV of position s from the tokens up to s + W (W = K:
depth d reads the token at s + d + 1). The tree then files the slot of position s under the token
at s + W (the draft window): a cached path of m tokens hands out the slots of positions
0 .. m - W - 1, each computed from tokens of that very path, and the request prefills from
m - W. The first W tokens of a path hold no slot (``NO_SLOT``). Only prompt positions are cached
then, because a decoded position's draft KV was computed from the draft's own guesses, not from
the tokens that followed. Cached positions therefore hold exactly what a prefill from token 0
computes, and outputs do not depend on the cache (the draft's proposals included, so ASD's too).
"""
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch

from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.radix_cache import SLOT_DTYPE, RadixCache, TreeNode
from lightllm.server.core.objs.messages import PromptCacheStats
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mtp_speculative.proposer import PrefixCacheRule


# A tree position that holds no slot: the first W tokens of a path with a draft window of W.
NO_SLOT = -1


@dataclass
class PrefixMatch:
    """A request's path in the tree: found at admission (``match``, not locked yet), locked by
    ``lock``, extended over its prompt by ``cache_prompt``."""

    length: int  # prompt positions whose KV it takes from the tree at admission
    slots: torch.Tensor  # [length] int64 host: their slots
    node: TreeNode  # the lock handle: the path's end (``tree_length`` tokens)
    tree_length: int  # tokens of the path (length + the draft window, or 0)
    lock_cost: int  # tokens that locking it adds to the tree's locked tokens
    # Positions 0 .. filed - 1 are the tree's or duplicates in ``dups``; the request's own slots
    # from there on are its own (admission: ``length``)
    filed: int = -1
    dups: List[torch.Tensor] = field(default_factory=list)  # own slots of KV the tree had already

    def __post_init__(self) -> None:
        if self.filed < 0:
            self.filed = self.length


def own_slots(req: InferReq) -> torch.Tensor:
    """``req.slots`` (positions ``prompt_cached_len`` .. ``kv_len`` - 1) as a host tensor; through numpy: a
    quarter of ``torch.tensor``'s time on a list (a done request's reap does this on the host's critical path)."""
    return torch.from_numpy(np.array(req.slots, dtype=np.int64))


class PromptCache:
    def __init__(self, mem_manager: MemoryManager, rule: PrefixCacheRule):
        self.mem_manager = mem_manager
        self.rule = rule
        self.window = rule.draft_window
        self.tree = RadixCache()
        mem_manager.reclaimer = self
        self._no_slot_tokens = 0  # tree tokens holding NO_SLOT (they free nothing when evicted)
        self.hit_tokens_total = 0  # prompt tokens admitted requests took from the tree
        self.computed_tokens_total = 0  # prompt tokens admitted requests prefill

    @property
    def locked_tokens(self) -> int:
        return self.tree.locked_tokens

    # ---- the pool's reclaimer (MemoryManager.alloc) ----
    @property
    def evictable_tokens(self) -> int:
        """Slots eviction can free (a lower bound: unlocked tokens less every NO_SLOT token)."""
        return max(0, self.tree.evictable_tokens - self._no_slot_tokens)

    def evict(self, num_tokens: int, free_fn: Callable[[torch.Tensor], None]) -> int:
        """Free at least ``num_tokens`` slots, least recently used first, while any are evictable. The evicted
        nodes' slots go back in one ``free_fn`` call (numpy per node: a pool that runs full evicts at every alloc,
        on the host's critical path)."""
        freed = 0
        taken: List[np.ndarray] = []

        def take(slots: torch.Tensor) -> None:
            nonlocal freed
            arr = slots.numpy()
            real = arr[arr != NO_SLOT]
            taken.append(real)
            freed += real.size
            self._no_slot_tokens -= arr.size - real.size

        while freed < num_tokens and self.tree.evict(num_tokens - freed, take):
            pass
        if taken:
            free_fn(torch.from_numpy(np.concatenate(taken)))
        return freed

    # ---- a request's life ----
    def match(self, req: InferReq) -> PrefixMatch:
        # The last prompt token is always prefilled: its logits give the first output token.
        m = self.tree.match_prefix(req.prompt_ids[:-1])
        w = self.window
        usable = max(0, m.length - w)
        return PrefixMatch(usable, m.slots[w:w + usable], m.last_node, m.length, self.tree.lock_cost(m.last_node))

    def lock(self, req: InferReq, match: PrefixMatch) -> None:
        self.tree.inc_ref(match.node)
        req.prompt_cached_len = match.length
        req.prefix = match
        self.hit_tokens_total += match.length
        self.computed_tokens_total += req.prompt_len - match.length

    def cacheable_len(self, req: InferReq) -> int:
        """Leading positions of ``req`` whose KV the tree may keep (before the draft window)."""
        return req.kv_len if self.rule.cache_decoded else min(req.kv_len, req.prompt_len)

    def cache_prompt(self, req: InferReq) -> int:
        """``req``'s prefill is done: file its prompt in the tree and lock the path to its end.
        Returns how many of its own slots the tree took (they leave its KV reservation)."""
        match = req.prefix
        if match is None:
            return 0
        taken = self._file(req, req.prompt_len)
        if taken or match.tree_length < req.prompt_len:
            path = self.tree.match_prefix(req.prompt_ids)  # the path of exactly the prompt (a split if need be)
            if path.length == req.prompt_len:
                self.tree.inc_ref(path.last_node)
                self.tree.dec_ref(match.node)
                match.node, match.tree_length = path.last_node, path.length
        return taken

    def _file(self, req: InferReq, n: int, own: Optional[torch.Tensor] = None) -> int:
        """Put ``req``'s first ``n`` tokens in the tree (token t holds the slot of position t - W);
        returns how many own slots the tree took. Own slots of KV the tree had go to ``dups``.
        ``own``: ``req.slots`` as a tensor, if the caller has it."""
        match, w = req.prefix, self.window
        if n <= max(match.tree_length, w) or n - w <= match.filed:
            return 0
        if own is None:
            own = own_slots(req)
        positions = torch.cat([match.slots, own])
        filed = torch.cat([torch.full((w,), NO_SLOT, dtype=SLOT_DTYPE), positions[:n - w]])
        dup = self.tree.insert_request((req.prompt_ids + req.output_ids)[:n], filed, match.tree_length)
        cached = match.tree_length + dup.numel()  # tokens the tree had
        self._no_slot_tokens += max(0, w - cached)
        dup = dup[dup != NO_SLOT]
        taken = n - w - match.filed - dup.numel()
        match.dups.append(dup)
        match.filed = n - w
        return taken

    def held_slots(self, req: InferReq) -> int:
        """Slots of ``req``'s positions that are its own, not the tree's."""
        match = req.prefix
        if match is None:
            return len(req.slots)
        return len(req.slots) - (match.filed - match.length) + sum(d.numel() for d in match.dups)

    def release(self, req: InferReq) -> None:
        """``req`` is done: cache its tokens, give back every own slot the tree did not take, unlock."""
        self.mem_manager.free(self.take_back(req))

    def take_back(self, req: InferReq) -> torch.Tensor:
        """``release`` of ``req`` but for the pool: returns the slots to free (a caller that releases several
        requests frees them in one ``MemoryManager.free``)."""
        match = req.prefix
        own = own_slots(req)
        if match is not None:
            self._file(req, self.cacheable_len(req), own)
            own = torch.cat(match.dups + [own[match.filed - match.length:]])
            self.tree.dec_ref(match.node)
        req.slots = []
        req.prefix = None
        return own

    def reset(self) -> None:
        """The pool was reset (``MemoryManager.free_all``): forget every node; locks go with them."""
        self.tree.reset()
        self._no_slot_tokens = 0

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(self.tree.total_tokens - self._no_slot_tokens, self.hit_tokens_total,
                                self.computed_tokens_total, self.tree.evicted_tokens)


def make_prompt_cache(args, mem_manager: MemoryManager, dp_size: int, draft) -> Optional[PromptCache]:
    """The rank's prompt cache, or None: --disable_dynamic_prompt_cache, or --dp above 1 (each group's
    admission would need its own tree; the queue places requests before it knows a group)."""
    if args.disable_dynamic_prompt_cache or dp_size > 1:
        return None
    rule = draft.prefix_cache_rule() if draft is not None else PrefixCacheRule()
    return PromptCache(mem_manager, rule)
