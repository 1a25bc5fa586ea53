"""Tensors that travel between the router backend and a model forward."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DecodeHead:
    """A rows forward whose first rows are decode runs and the rest prompt chunks (a mixed step):
    the attention plans the two apart, each for its shape."""

    rows: torch.Tensor  # [1] int32 device: the decode rows, runs of ``q_len`` rows of one request each
    q_len: int  # host: rows per run (K + 1)
    max_runs: int  # host: most runs (the running requests; the prompt chunks after them are as many at most)


@dataclass
class ModelInput:
    """One forward over a batch of requests.

    Prefill: batch item i contributes ``b_seq_len[i] - b_ready_cache_len[i]`` new
    tokens (its next prompt chunk), laid out contiguously in ``input_ids``.
    Decode: every batch item is one row with one new token; with MTP a request
    has K+1 consecutive rows sharing a ``req_idx`` (row j has ``b_mtp_index == j``
    and ``b_seq_len`` one larger than row j-1).
    """

    batch_size: int
    total_token_num: int  # sum of b_seq_len
    max_len_in_batch: int  # max of b_seq_len
    input_ids: torch.Tensor  # [num_new_tokens] int64
    mem_indexes: torch.Tensor  # [num_new_tokens] int64, KV slot of each new token
    b_req_idx: torch.Tensor  # [batch] int32
    b_seq_len: torch.Tensor  # [batch] int32, tokens in cache after this forward
    is_prefill: bool
    b_ready_cache_len: Optional[torch.Tensor] = None  # [batch] int32, prefill only
    b_mtp_index: Optional[torch.Tensor] = None  # [batch] int32, decode with MTP only
    # Decode rows: most consecutive rows of one request (MTP: K + 1; prefill rows: the padded size)
    # and a bound on the runs of consecutive rows of one request (None: one per row). Attention
    # reads a run's KV once; prefill derives both from its items.
    max_q_len: int = 1
    max_q_runs: Optional[int] = None
    decode_head: Optional[DecodeHead] = None  # decode rows before prompt chunks (None: one plan for all rows)
    # The rows (new tokens) whose logits the forward computes, in this order (None: each item's
    # last new token; decode: every row).
    logit_rows: Optional[torch.Tensor] = None
    # Host copies for the python-side loops of the torch attention path.
    b_seq_len_cpu: Optional[torch.Tensor] = None  # [batch] int32
    b_ready_cache_len_cpu: Optional[torch.Tensor] = None  # [batch] int32


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [batch, vocab] fp32: last new token of each item (or ModelInput.logit_rows)
    hidden_states: torch.Tensor  # [num_new_tokens, hidden] last layer output, before final norm
    # [num_new_tokens, len(aux_layer_ids) * hidden]: outputs of the layers a draft asked for
    aux_hidden_states: Optional[torch.Tensor] = None
