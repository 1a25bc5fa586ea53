"""req_idx-indexed tables shared by the router backend and the model.

Every table has ``max_request_num + 1`` rows: the last one is the HOLD row, the
req_idx that padding rows (DP ranks with fewer requests) point at. Nothing real
is ever stored there and nothing reads it back. Its ``req_to_token_indexs`` row points
every position at ``mem_manager.HOLD_SLOT``, so a padding row's attention reads only the
HOLD slot it writes.
"""
import math
from typing import List, Optional, Sequence

import numpy as np
import torch

from lightllm.common.basemodel.triton_kernel.init_req_rows import (
    ASD_BUDGET_COL, FREQUENCY_PENALTY_COL, PRESENCE_PENALTY_COL, REPETITION_PENALTY_COL, REQ_IDX_COL, TEMPERATURE_COL,
    TOP_K_COL, TOP_P_COL, init_req_rows_triton, pack_req_rows,
)
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.server.core.objs.sampling_params import MAX_TOP_LOGPROBS
from lightllm.utils.device_memory import check_fits
from lightllm.utils.host_copy import to_device
from lightllm.utils.numbers import is_number


class ReqManager:
    def __init__(self, max_request_num: int, max_sequence_length: int, mem_manager: MemoryManager, device: str):
        self.max_request_num = max_request_num
        self.max_sequence_length = max_sequence_length
        self.mem_manager = mem_manager
        self.HOLD_REQUEST_ID = max_request_num
        # [max_request_num + 1, max_sequence_length] KV slot of every position of a request
        check_fits((max_request_num + 1) * max_sequence_length * torch.int64.itemsize,
                   torch.device(device), f"the request table of {max_request_num} requests x {max_sequence_length} "
                   f"positions", "lower --running_max_req_size or --max_req_total_len")
        self.req_to_token_indexs = torch.zeros(
            (max_request_num + 1, max_sequence_length), dtype=torch.int64, device=device
        )
        self.req_to_token_indexs[self.HOLD_REQUEST_ID] = mem_manager.HOLD_SLOT
        self._free_req_idx: List[int] = list(range(max_request_num))

    def get_paused_req_num(self) -> int:
        return 0

    @property
    def can_alloc_num(self) -> int:
        return len(self._free_req_idx)

    def alloc(self) -> int:
        if not self._free_req_idx:
            raise RuntimeError("no free req_idx: running_max_req_size reached")
        return self._free_req_idx.pop()

    def free(self, req_idx: int) -> None:
        assert 0 <= req_idx < self.max_request_num, f"bad req_idx {req_idx}"
        assert req_idx not in self._free_req_idx, f"req_idx {req_idx} freed twice"
        self._free_req_idx.append(req_idx)

    def free_all(self) -> None:
        """Every req_idx back to the free list (after a failed step, when no request holds one)."""
        self._free_req_idx = list(range(self.max_request_num))


# Ranges of the tables' element types: a value outside them cannot be stored.
INT32_MIN, INT32_MAX = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
FP32_MAX = torch.finfo(torch.float32).max


class ReqParamsError(ValueError):
    """A request's parameters cannot be held by the worker's tables; the message names the field."""


def _check_fp32(name: str, v) -> None:
    if not is_number(v) or abs(v) > FP32_MAX or not math.isfinite(v):  # abs first: huge ints
        raise ReqParamsError(f"{name}: {v!r} is not a finite number within the worker's float32 range "
                             f"(|x| <= {FP32_MAX:.6g})")


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ReqParamsError(f"{name}: token id {bad!r} outside the vocabulary [0, {vocab_size})")


def writes_by_kernel(device) -> bool:
    """Whether admission writes the tables with init_req_rows' kernel (CUDA) or per table (the CPU backend)."""
    return torch.device(device).type == "cuda"


class ReqSamplingParamsManager:
    """Device tables of per-request sampling parameters and state, indexed by req_idx.

    The ASD ledger (``req_to_asd_cum_regret``) and budgets exist only when ASD is
    enabled. The HOLD row keeps neutral parameters and a budget of 0.
    """

    def __init__(self, max_request_num: int, vocab_size: int, device: str, asd_enabled: bool):
        rows = max_request_num + 1
        self.vocab_size = vocab_size
        self.device = device
        self.req_to_temperature = torch.ones(rows, dtype=torch.float32, device=device)  # [rows]
        self.req_to_top_k = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self.req_to_top_p = torch.ones(rows, dtype=torch.float32, device=device)  # [rows]
        self.req_to_repetition_penalty = torch.ones(rows, dtype=torch.float32, device=device)  # [rows]
        self.req_to_presence_penalty = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]
        self.req_to_frequency_penalty = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]
        # Penalty state: counts of generated tokens, and tokens seen in prompt or output.
        self.req_to_out_token_counts = torch.zeros((rows, vocab_size), dtype=torch.int32, device=device)  # [rows, vocab]
        self.req_to_token_seen = torch.zeros((rows, vocab_size), dtype=torch.bool, device=device)  # [rows, vocab]
        self.req_to_asd_cum_regret = None
        self.req_to_asd_budget = None
        if asd_enabled:
            self.req_to_asd_cum_regret = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]
            self.req_to_asd_budget = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]

    def check_req(self, req) -> None:
        """Raise ReqParamsError when ``req`` cannot be stored in (or sampled from) these tables.

        The HTTP edge validates requests; this is the worker's own guard, so a value that got
        past it fails its request alone. It reads only the request (no device state), so every
        rank reaches the same verdict."""
        p = req.params
        top_k = p.top_k
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not INT32_MIN <= top_k <= INT32_MAX:
            raise ReqParamsError(f"top_k: {top_k!r} is not an integer within the worker's int32 range "
                                 f"[{INT32_MIN}, {INT32_MAX}]")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _check_fp32(name, getattr(p, name))
        if self.req_to_asd_budget is not None:
            _check_fp32("asd_regret_budget", req.asd_budget)
        if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool)):
            raise ReqParamsError(f"seed: must be an integer, got {p.seed!r}")
        k = p.top_logprobs
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ReqParamsError(f"top_logprobs: must be an integer in 0..{MAX_TOP_LOGPROBS}, got {k!r}")
        _check_token_ids("inputs", req.prompt_ids, self.vocab_size)
        _check_token_ids("logit_bias", list(p.logit_bias), self.vocab_size)
        bad_bias = next((v for v in p.logit_bias.values() if not is_number(v) or math.isnan(v)), None)
        if bad_bias is not None:
            raise ReqParamsError(f"logit_bias: {bad_bias!r} is not a number")

    def init_req_sampling_params(self, req) -> None:
        """Reset every table row of ``req.req_idx`` for a new request (the prefill seam).

        Raises ReqParamsError (before writing anything) when ``check_req`` refuses ``req``."""
        self.check_req(req)
        self.init_reqs_sampling_params([req])

    def init_reqs_sampling_params(self, reqs: Sequence, next_token_ids: Optional[torch.Tensor] = None) -> None:
        """``init_req_sampling_params`` of requests ``check_req`` accepted, all at once (admission), and each
        one's row of ``next_token_ids`` ([max_req + 1, W], the backend's) set to NO_DRAFT_TOKEN_ID. On CUDA the
        values go as one packed copy and one kernel (init_req_rows.py), whatever the number of requests."""
        if not reqs:
            return
        params = [r.params for r in reqs]
        rows = pack_req_rows(
            [r.req_idx for r in reqs], [p.top_k for p in params], [p.temperature for p in params],
            [p.top_p for p in params], [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
            [r.asd_budget if self.req_to_asd_budget is not None else 0.0 for r in reqs],
        )
        if writes_by_kernel(self.device):
            init_req_rows_triton(
                to_device(rows.reshape(-1), self.device, torch.int32).view(rows.shape), self.req_to_temperature,
                self.req_to_top_k, self.req_to_top_p, self.req_to_repetition_penalty, self.req_to_presence_penalty,
                self.req_to_frequency_penalty, next_token_ids, self.req_to_asd_budget, self.req_to_asd_cum_regret,
            )
        else:  # the CPU backend: a vectorized write per table
            column = lambda col, dtype=np.float32: torch.from_numpy(rows.view(dtype)[:, col].copy())  # noqa: E731
            idx = column(REQ_IDX_COL, np.int32).long()
            self.req_to_top_k[idx] = column(TOP_K_COL, np.int32)
            for table, col in ((self.req_to_temperature, TEMPERATURE_COL), (self.req_to_top_p, TOP_P_COL),
                               (self.req_to_repetition_penalty, REPETITION_PENALTY_COL),
                               (self.req_to_presence_penalty, PRESENCE_PENALTY_COL),
                               (self.req_to_frequency_penalty, FREQUENCY_PENALTY_COL)):
                table[idx] = column(col)
            if self.req_to_asd_budget is not None:
                self.req_to_asd_budget[idx] = column(ASD_BUDGET_COL)
                self.req_to_asd_cum_regret[idx] = 0.0
            if next_token_ids is not None:
                next_token_ids[idx] = NO_DRAFT_TOKEN_ID
        for req in reqs:
            if req.has_penalty:  # only such requests read or write their counts (two vocabulary-wide rows)
                idx = req.req_idx
                self.req_to_out_token_counts[idx].zero_()
                self.req_to_token_seen[idx].zero_()
                prompt = to_device(req.prompt_ids, self.device)  # pinned: no stream sync
                self.req_to_token_seen[idx, prompt] = True

    def update_penalty_state(self, b_req_idx: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count committed tokens (``b_req_idx`` [n], ``token_ids`` [n]) for the penalties."""
        ones = torch.ones_like(b_req_idx, dtype=torch.int32)
        self.req_to_out_token_counts.index_put_((b_req_idx.long(), token_ids), ones, accumulate=True)
        self.req_to_token_seen[b_req_idx.long(), token_ids] = True
