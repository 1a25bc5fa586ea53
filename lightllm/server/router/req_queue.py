"""Admission: FIFO, bounded by free req_idx rows and the KV pool (GPU-free, unit-tested on CPU)."""
from collections import deque
from typing import Deque, List, Optional

from lightllm.server.router.model_infer.infer_batch import InferReq


def kv_reservation(req: InferReq, mtp_step: int) -> int:
    """KV slots a request may hold at most: prompt + generated tokens + one step's draft rows."""
    return req.prompt_len + req.params.max_new_tokens + mtp_step


class ReqQueue:
    def __init__(self, max_total_token_num: int, running_max_req_size: int, mtp_step: int):
        self.max_total_token_num = max_total_token_num
        self.running_max_req_size = running_max_req_size
        self.mtp_step = mtp_step
        self.waiting: Deque[InferReq] = deque()
        self.reserved_tokens = 0  # sum of reservations of running requests

    def append(self, req: InferReq) -> None:
        self.waiting.append(req)

    def remove(self, req_id: int) -> Optional[InferReq]:
        for req in self.waiting:
            if req.req_id == req_id:
                self.waiting.remove(req)
                return req
        return None

    def pop_admissible(self, num_running: int) -> List[InferReq]:
        """Admit waiting requests in arrival order while both budgets allow; the first
        that does not fit waits (no overtaking, so long requests are not starved)."""
        admitted = []
        while self.waiting and num_running + len(admitted) < self.running_max_req_size:
            need = kv_reservation(self.waiting[0], self.mtp_step)
            if self.reserved_tokens + need > self.max_total_token_num:
                break
            self.reserved_tokens += need
            admitted.append(self.waiting.popleft())
        return admitted

    def release(self, req: InferReq) -> None:
        self.reserved_tokens -= kv_reservation(req, self.mtp_step)
