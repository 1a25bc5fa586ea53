"""Plays the router backend for model tests: req_idx, KV slots, req_to_token_indexs, ModelInput."""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from lightllm.common.basemodel.basemodel import TpPartBaseModel
from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput

# A decode row that is padding: b_req_idx is the HOLD row, its K/V go to HOLD_SLOT.
PAD_ROW = None
PAD_TOKEN_ID = 0


class ModelDriver:
    def __init__(self, model: TpPartBaseModel):
        self.model = model
        self.seq_len: Dict[int, int] = {}  # req_idx -> tokens in cache

    def add_request(self) -> int:
        req_idx = self.model.req_manager.alloc()
        self.seq_len[req_idx] = 0
        return req_idx

    def free_request(self, req_idx: int) -> None:
        table = self.model.req_manager.req_to_token_indexs
        self.model.mem_manager.free(table[req_idx, : self.seq_len.pop(req_idx)].cpu())
        self.model.req_manager.free(req_idx)

    def _append_slots(self, req_idx: int, num: int) -> torch.Tensor:
        """Allocates ``num`` slots for the request's next positions and records them in the table."""
        slots = self.model.mem_manager.alloc(num)
        start = self.seq_len[req_idx]
        self.model.req_manager.req_to_token_indexs[req_idx, start : start + num] = slots.to(self.model.device)
        self.seq_len[req_idx] = start + num
        return slots

    def prefill(self, chunks: Sequence[Tuple[int, Sequence[int]]]) -> ModelOutput:
        """One prefill forward; each chunk is (req_idx, next prompt tokens of that request)."""
        return self.model.forward(self.prefill_input(chunks))

    def decode(self, rows: Sequence[Optional[Tuple[int, int]]], pad_seq_len: int = 1) -> ModelOutput:
        """One decode forward; each row is (req_idx, token) or PAD_ROW. Consecutive rows of one
        request are MTP rows: each sees the rows before it."""
        return self.model.forward(self.decode_input(rows, pad_seq_len))

    def prefill_input(self, chunks: Sequence[Tuple[int, Sequence[int]]]) -> ModelInput:
        """Allocates the chunks' slots, fills req_to_token_indexs, builds the prefill ModelInput."""
        ids, slots, req_idx, seq_len, ready = [], [], [], [], []
        for req, tokens in chunks:
            ready.append(self.seq_len[req])
            slots.append(self._append_slots(req, len(tokens)))
            ids.extend(tokens)
            req_idx.append(req)
            seq_len.append(self.seq_len[req])
        return self._model_input(ids, torch.cat(slots), req_idx, seq_len, is_prefill=True, ready=ready)

    def decode_input(self, rows: Sequence[Optional[Tuple[int, int]]], pad_seq_len: int = 1) -> ModelInput:
        """Allocates one slot per real row, fills req_to_token_indexs, builds the decode ModelInput."""
        hold_req = self.model.req_manager.HOLD_REQUEST_ID
        hold_slot = self.model.mem_manager.HOLD_SLOT
        ids, slots, req_idx, seq_len = [], [], [], []
        for row in rows:
            if row is PAD_ROW:
                ids.append(PAD_TOKEN_ID)
                slots.append(torch.tensor([hold_slot]))
                req_idx.append(hold_req)
                seq_len.append(pad_seq_len)
                continue
            req, token = row
            ids.append(token)
            slots.append(self._append_slots(req, 1))
            req_idx.append(req)
            seq_len.append(self.seq_len[req])
        return self._model_input(ids, torch.cat(slots), req_idx, seq_len, is_prefill=False)

    def _model_input(
        self,
        ids: List[int],
        slots: torch.Tensor,
        req_idx: List[int],
        seq_len: List[int],
        is_prefill: bool,
        ready: Optional[List[int]] = None,
    ) -> ModelInput:
        device = self.model.device
        b_seq_len_cpu = torch.tensor(seq_len, dtype=torch.int32)
        b_ready_cpu = torch.tensor(ready, dtype=torch.int32) if ready is not None else None
        return ModelInput(
            batch_size=len(req_idx),
            total_token_num=sum(seq_len),
            max_len_in_batch=max(seq_len),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            mem_indexes=slots.to(device),
            b_req_idx=torch.tensor(req_idx, dtype=torch.int32, device=device),
            b_seq_len=b_seq_len_cpu.to(device),
            is_prefill=is_prefill,
            b_ready_cache_len=b_ready_cpu.to(device) if b_ready_cpu is not None else None,
            b_seq_len_cpu=b_seq_len_cpu,
            b_ready_cache_len_cpu=b_ready_cpu,
        )

    def greedy_generate(self, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
        req = self.add_request()
        token = int(self.prefill([(req, prompt)]).logits[0].argmax())
        out = [token]
        for _ in range(max_new_tokens - 1):
            token = int(self.decode([(req, token)]).logits[0].argmax())
            out.append(token)
        self.free_request(req)
        return out
