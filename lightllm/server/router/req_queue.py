"""Admission: FIFO, bounded by free req_idx rows and the KV pool (GPU-free, unit-tested on CPU).

With ``--dp M`` every DP group has its own req_idx rows and KV pool; a request is admitted
into the group with the fewest running requests among those it fits (then the lowest
reservation, then the lowest index), and ``req.dp_rank`` records the choice.

With a prompt cache (one group) a request's cached prefix is not its to reserve: it reserves the
rest, and the tree's locked tokens (shared by every request that matched them) count once. The
tree's unlocked tokens are free for the budget: the pool evicts them before an allocation fails.
"""
from collections import deque
from typing import TYPE_CHECKING, Deque, List, Optional, Sequence, Union

from lightllm.server.router.model_infer.infer_batch import InferReq

if TYPE_CHECKING:
    from lightllm.server.router.model_infer.prompt_cache import PromptCache


def kv_reservation(req: InferReq, mtp_step: int, cached: int = 0) -> int:
    """KV slots a request may hold at most: prompt (less its ``cached`` prefix) + generated tokens +
    one step's draft rows."""
    return req.prompt_len - cached + req.params.max_new_tokens + mtp_step


class ReqQueue:
    def __init__(self, max_total_token_num: int, running_max_req_size: int, mtp_step: int, dp_size: int = 1,
                 prompt_cache: Optional["PromptCache"] = None):
        if prompt_cache is not None and dp_size != 1:
            raise ValueError("the prompt cache serves one DP group")
        self.max_total_token_num = max_total_token_num  # per DP group
        self.running_max_req_size = running_max_req_size  # per DP group
        self.mtp_step = mtp_step
        self.dp_size = dp_size
        self.prompt_cache = prompt_cache
        self.waiting: Deque[InferReq] = deque()
        self.reserved_per_group = [0] * dp_size  # sum of reservations of running requests

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved_per_group)

    def append(self, req: InferReq) -> None:
        self.waiting.append(req)

    def remove(self, req_id: int) -> Optional[InferReq]:
        for req in self.waiting:
            if req.req_id == req_id:
                self.waiting.remove(req)
                return req
        return None

    def pop_admissible(self, num_running: Union[int, Sequence[int]]) -> List[InferReq]:
        """Admit waiting requests in arrival order while both budgets allow; the first
        that does not fit waits (no overtaking, so long requests are not starved).

        ``num_running``: running requests of each DP group (an int with one group)."""
        running = [num_running] if isinstance(num_running, int) else list(num_running)
        if len(running) != self.dp_size:
            raise ValueError(f"num_running has {len(running)} group(s), expected {self.dp_size}")
        admitted = []
        cache = self.prompt_cache
        while self.waiting:
            req = self.waiting[0]
            # the least it can need: every prompt token but the last cached (a match never covers the last)
            least = kv_reservation(req, self.mtp_step, req.prompt_len - 1)
            if cache is not None and not self._groups_fitting(running, least, cache.locked_tokens):
                break  # not even with its whole prompt cached: no need to walk the tree
            match = cache.match(req) if cache is not None else None
            need = kv_reservation(req, self.mtp_step, match.length if match is not None else 0)
            locked = cache.locked_tokens + match.lock_cost if match is not None else 0
            fits = self._groups_fitting(running, need, locked)
            if not fits:
                break
            g = min(fits, key=lambda g: (running[g], self.reserved_per_group[g], g))
            self.waiting.popleft()
            if match is not None:
                cache.lock(req, match)
            req.dp_rank = g
            req.kv_reserved = need
            running[g] += 1
            self.reserved_per_group[g] += need
            admitted.append(req)
        return admitted

    def _groups_fitting(self, running: List[int], need: int, locked: int) -> List[int]:
        """The groups with a free running row and room for a reservation of ``need`` beside the
        others and ``locked`` tokens of the prompt cache."""
        return [g for g in range(self.dp_size)
                if running[g] < self.running_max_req_size
                and self.reserved_per_group[g] + need + locked <= self.max_total_token_num]

    def release(self, req: InferReq) -> None:
        self.reserved_per_group[req.dp_rank] -= req.kv_reserved
        req.kv_reserved = 0

    def unreserve(self, req: InferReq, tokens: int) -> None:
        """``tokens`` of ``req``'s slots went to the prompt cache (it counts them as locked now)."""
        tokens = min(tokens, req.kv_reserved)
        self.reserved_per_group[req.dp_rank] -= tokens
        req.kv_reserved -= tokens
