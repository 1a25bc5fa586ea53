"""Per-forward batch layout, derived once from a ModelInput and read by every layer.

Vocabulary:
- item: one entry of the batch (a prefill chunk of a request, or one decode row;
  with MTP a request has K+1 decode rows, each its own item).
- new tokens: the tokens this forward computes, laid out item after item.
- position: index of a token inside its request (rope position, column of
  ``req_to_token_indexs``).
"""
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightllm.common.basemodel.batch_objs import DecodeHead, ModelInput
from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.utils.dist_utils import SINGLE_RANK_COMM, TpComm


@dataclass
class InferStateInfo:
    is_prefill: bool
    batch_size: int
    num_new_tokens: int
    max_new_len: int  # host int: most new tokens of one item (1 in decode)
    max_len_in_batch: int  # host int: max of b_seq_len
    input_ids: torch.Tensor  # [num_new_tokens] int64
    mem_indexes: torch.Tensor  # [num_new_tokens] int64, KV slot written by each new token
    b_req_idx: torch.Tensor  # [batch] int64
    b_seq_len: torch.Tensor  # [batch] int32, tokens in cache after this forward
    b_q_start_pos: torch.Tensor  # [batch] int64, position of each item's first new token
    positions: torch.Tensor  # [num_new_tokens] int64
    token_item: torch.Tensor  # [num_new_tokens] int64, item of each new token
    token_offset: torch.Tensor  # [num_new_tokens] int64, index among its item's new tokens
    last_token_index: torch.Tensor  # [logit rows] int64: the rows whose logits the forward computes
    mem_manager: MemoryManager
    req_manager: ReqManager
    comm: TpComm = SINGLE_RANK_COMM  # collectives of this forward (tensor / data parallel ranks)
    max_q_len: int = 1  # host int: most consecutive rows (new tokens) of one request
    max_q_runs: int = 1  # host int: at most this many runs of consecutive rows of one request
    decode_head: Optional[DecodeHead] = None  # decode rows before prompt chunks (ModelInput.decode_head)
    # The triton attention's plans (unified_attention.AttentionPlan, one per group of rows), built by the first layer.
    attention_plan: Optional[Any] = None
    # Filled by the model after construction (rope tables of the new tokens' positions).
    position_cos: Optional[torch.Tensor] = None  # [num_new_tokens, head_dim]
    position_sin: Optional[torch.Tensor] = None  # [num_new_tokens, head_dim]

    @classmethod
    def from_model_input(
        cls, model_input: ModelInput, mem_manager: MemoryManager, req_manager: ReqManager, device: torch.device,
        comm: TpComm = SINGLE_RANK_COMM,
    ) -> "InferStateInfo":
        """No host sync in decode; prefill reads the host copies (or copies to host once)."""
        batch_size = model_input.batch_size
        num_new_tokens = model_input.input_ids.shape[0]
        b_seq_len = model_input.b_seq_len.to(device)
        b_seq_len_long = b_seq_len.long()
        item_ids = torch.arange(batch_size, device=device)  # [batch]
        if model_input.is_prefill:
            if model_input.b_ready_cache_len is None:
                b_ready = torch.zeros_like(b_seq_len_long)
            else:
                b_ready = model_input.b_ready_cache_len.to(device).long()
            new_len = b_seq_len_long - b_ready  # [batch]
            new_end = torch.cumsum(new_len, dim=0)  # [batch]
            token_item = torch.repeat_interleave(item_ids, new_len, output_size=num_new_tokens)
            token_offset = torch.arange(num_new_tokens, device=device) - (new_end - new_len)[token_item]
            b_q_start_pos = b_ready
            last_token_index = new_end - 1
            max_new_len = _max_new_len_on_host(model_input)
            max_q_len, max_q_runs = max_new_len, batch_size
        else:
            if num_new_tokens != batch_size:
                raise ValueError(f"decode needs one new token per row: {num_new_tokens} tokens, {batch_size} rows")
            token_item = item_ids
            token_offset = torch.zeros_like(item_ids)
            b_q_start_pos = b_seq_len_long - 1
            last_token_index = item_ids
            max_new_len = 1
            max_q_len = model_input.max_q_len
            max_q_runs = batch_size if model_input.max_q_runs is None else model_input.max_q_runs
        if model_input.logit_rows is not None:
            last_token_index = model_input.logit_rows.to(device)
        return cls(
            is_prefill=model_input.is_prefill,
            batch_size=batch_size,
            num_new_tokens=num_new_tokens,
            max_new_len=max_new_len,
            max_len_in_batch=model_input.max_len_in_batch,
            input_ids=model_input.input_ids.to(device),
            mem_indexes=model_input.mem_indexes.to(device),
            b_req_idx=model_input.b_req_idx.to(device).long(),
            b_seq_len=b_seq_len,
            b_q_start_pos=b_q_start_pos,
            positions=b_q_start_pos[token_item] + token_offset,
            token_item=token_item,
            token_offset=token_offset,
            last_token_index=last_token_index,
            mem_manager=mem_manager,
            req_manager=req_manager,
            comm=comm,
            max_q_len=max_q_len,
            max_q_runs=max_q_runs,
            decode_head=None if model_input.is_prefill else model_input.decode_head,
        )


def _max_new_len_on_host(model_input: ModelInput) -> int:
    seq_len_cpu = model_input.b_seq_len_cpu
    if seq_len_cpu is None:
        seq_len_cpu = model_input.b_seq_len.cpu()
    ready_cpu = model_input.b_ready_cache_len_cpu
    if ready_cpu is None:
        ready = model_input.b_ready_cache_len
        ready_cpu = torch.zeros_like(seq_len_cpu) if ready is None else ready.cpu()
    return int((seq_len_cpu.long() - ready_cpu.long()).max())
