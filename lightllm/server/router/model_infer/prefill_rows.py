"""Short prefills as decode rows, padded to a token ladder and replayed from CUDA graphs.

A prefill step of a few hundred tokens does little GPU work but launches every kernel of
every layer one by one (14-28 ms per 120-token request on an H200 for the embedded model,
against about 2 ms of GPU time; docs/decode_step.md). The model's attention reads the KV cache through
the slot table, so new token t of a request, at position p(t), is exactly a decode row
whose ``b_seq_len`` is p(t) + 1 (its K/V and the chunk's earlier tokens' are written before
attention reads them). A prefill of T <= ``--graph_max_prefill_tokens`` new tokens therefore
runs as T decode rows, padded with HOLD rows to the token ladder's size, through one graph
replay. ``--disable_cudagraph`` pads the same way and runs the same forward eagerly, so it
stays the bit-exact reference. Longer prefills run the prefill forward.

A depth-by-depth MTP draft (``DraftProposer``) drafts over the same rows in a second graph,
after the first tokens are sampled: position s at depth d takes token x_{s+d+1}, staged from
the prompt (``known``) or, where unknown, the previous depth's guess at s.
"""
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import CudaGraphSet, GraphLadder, capture_ladder
from lightllm.server.router.model_infer.decode_step import PAD_TOKEN_ID
from lightllm.server.router.model_infer.mtp_speculative.draft import UNKNOWN_TOKEN, row_positions, tokens_ahead

# host staging columns: one copy per step moves them to the device (then K columns of known tokens)
STAGE_INPUT_ID, STAGE_REQ_IDX, STAGE_SEQ_LEN, STAGE_SLOT, STAGE_COLUMNS = 0, 1, 2, 3, 4


@dataclass
class PrefillItem:
    """One request's chunk of a prefill step."""

    req_idx: int
    start: int  # position of its first new token
    tokens: Sequence[int]  # the whole prompt (the chunk is tokens[start:start + n])
    n: int  # new tokens


@dataclass
class RowsBatch:
    """What ``stage`` laid out: the padded size and each item's rows."""

    size: int
    items: List[PrefillItem]
    first_row: List[int]  # per item


def token_ladder(max_tokens: int) -> GraphLadder:
    """Powers of two below ``max_tokens``, then ``max_tokens``."""
    return GraphLadder.from_flags(max_tokens, max_tokens, max_tokens)


class PrefillRows:
    """Owns the static row buffers and graphs of short prefills (one rank, CUDA or tests)."""

    def __init__(self, model, max_tokens: int, use_graphs: bool, draft=None):
        self.model = model
        self.draft = draft  # a DraftProposer (drafts over rows) or None
        self.k = draft.mtp_step if draft is not None else 0
        self.ladder = token_ladder(max_tokens)
        self.max_tokens = max_tokens
        dev = model.device
        hold_req, hold_slot = model.req_manager.HOLD_REQUEST_ID, model.mem_manager.HOLD_SLOT
        width = STAGE_COLUMNS + self.k
        self._hold_row = torch.tensor([PAD_TOKEN_ID, hold_req, 1, hold_slot] + [UNKNOWN_TOKEN] * self.k, dtype=torch.int64)
        self._stage_host = torch.zeros((max_tokens, width), dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._staged = torch.zeros((max_tokens, width), dtype=torch.int64, device=dev)
        # [K, max_tokens]: the token each row takes at each draft depth (UNKNOWN_TOKEN: its guess)
        self.known = torch.full((self.k, max_tokens), UNKNOWN_TOKEN, dtype=torch.int64, device=dev)
        self.input_ids = torch.full((max_tokens,), PAD_TOKEN_ID, dtype=torch.int64, device=dev)
        self.b_req_idx = torch.full((max_tokens,), hold_req, dtype=torch.int32, device=dev)
        self.b_seq_len = torch.ones((max_tokens,), dtype=torch.int32, device=dev)
        self.mem_indexes = torch.full((max_tokens,), hold_slot, dtype=torch.int64, device=dev)
        # the staging buffer is rewritten only after the GPU has read it (a prefill step may not sync)
        self._copy_done = torch.cuda.Event() if dev.type == "cuda" else None
        self.graphs: Optional[CudaGraphSet] = None
        if use_graphs:
            self.graphs = CudaGraphSet(dev)
            capture_ladder(self.graphs, self.ladder.sizes, self._capture_one, what="prefill token counts")

    def bucket_size(self, num_tokens: int) -> Optional[int]:
        """The padded row count of a ``num_tokens`` prefill; None: too long (prefill forward)."""
        return self.ladder.bucket_size(num_tokens)

    def _model_input(self, size: int, seq_len_cpu: torch.Tensor) -> ModelInput:
        return ModelInput(
            batch_size=size, total_token_num=0, max_len_in_batch=int(seq_len_cpu.max()),
            input_ids=self.input_ids[:size], mem_indexes=self.mem_indexes[:size], b_req_idx=self.b_req_idx[:size],
            b_seq_len=self.b_seq_len[:size], is_prefill=False, b_seq_len_cpu=seq_len_cpu, max_q_len=size,
        )

    def _capture_one(self, size: int) -> None:
        self.stage(size, [], [])
        mi, out = self.graphs.capture(("target", size), lambda: self._target(size, torch.ones(size, dtype=torch.int32)))
        if self.draft is not None:
            self.graphs.capture(("draft", size), lambda: self._draft(size, mi, out))

    def _target(self, size: int, seq_len_cpu: torch.Tensor):
        mi = self._model_input(size, seq_len_cpu)
        return mi, self.model.forward(mi)

    def _draft(self, size: int, mi: ModelInput, out: ModelOutput) -> torch.Tensor:
        return self.draft.propose_rows(mi, out, self.known[:, :size])

    def stage(self, size: int, items: List[PrefillItem], slots: Sequence[int]) -> RowsBatch:
        """Rows of the items' new tokens (and, with a draft, their known tokens per depth), HOLD
        rows up to ``size``; one host-to-device copy. ``slots``: the new tokens' KV slots in order."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
        st = self._stage_host[:size]
        lens = [it.n for it in items]
        row = sum(lens)
        first_row = [r - n for r, n in zip(itertools.accumulate(lens), lens)]
        if items:
            starts = [it.start for it in items]
            item, pos = row_positions(starts, lens)
            # offset 0: the row's own token; 1..K: x_{s+d+1} inside the prompt (the first token comes after sampling)
            tokens = tokens_ahead([it.tokens for it in items], item, pos, range(self.k + 1))
            st[:row, STAGE_INPUT_ID] = tokens[0]
            st[:row, STAGE_REQ_IDX] = torch.tensor([it.req_idx for it in items])[item]
            st[:row, STAGE_SEQ_LEN] = pos + 1
            st[:row, STAGE_COLUMNS:] = tokens[1:].t()
        st[:row, STAGE_SLOT] = torch.as_tensor(slots, dtype=torch.int64)
        st[row:] = self._hold_row
        self._seq_cpu = st[:, STAGE_SEQ_LEN].to(torch.int32)
        staged = self._staged[:size]
        staged.copy_(st, non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        self.input_ids[:size].copy_(staged[:, STAGE_INPUT_ID])
        self.b_req_idx[:size].copy_(staged[:, STAGE_REQ_IDX])
        self.b_seq_len[:size].copy_(staged[:, STAGE_SEQ_LEN])
        self.mem_indexes[:size].copy_(staged[:, STAGE_SLOT])
        if self.k:
            self.known[:, :size].copy_(staged[:, STAGE_COLUMNS:].t())
        return RowsBatch(size, list(items), first_row)

    def forward(self, batch: RowsBatch) -> ModelOutput:
        """The prefill forward's output (each item's last-token logits, every new token's hidden
        states) from the staged rows. The slot table must map every new position to its slot."""
        size, t = batch.size, sum(it.n for it in batch.items)
        if self.graphs is not None:
            mi, out = self.graphs.replay(("target", size))
        else:
            mi, out = self._target(size, self._seq_cpu)
        self._mi, self._out = mi, out  # for propose
        last = torch.tensor([r + it.n - 1 for r, it in zip(batch.first_row, batch.items)], device=self.model.device)
        aux = out.aux_hidden_states
        return ModelOutput(logits=out.logits[last], hidden_states=out.hidden_states[:t],
                           aux_hidden_states=None if aux is None else aux[:t])

    def propose(self, batch: RowsBatch, first_tokens: Dict[int, int]) -> Optional[torch.Tensor]:
        """After ``forward``: the draft pass over every row (its KV, also for unfinished chunks),
        then the K proposals [done, K] after the first tokens of the items in ``first_tokens``
        (item -> token), in item order; None when no prompt is done."""
        done = sorted(first_tokens)
        rows, depths, toks = [], [], []
        for i in done:  # position s = L - 1 - d takes x_L (the first token) at depth d
            it, r0 = batch.items[i], batch.first_row[i]
            for d in range(self.k):
                o = len(it.tokens) - 1 - d - it.start
                if 0 <= o < it.n:
                    rows.append(r0 + o)
                    depths.append(d)
                    toks.append(first_tokens[i])
        dev = self.model.device
        if rows:
            self.known[torch.tensor(depths, device=dev), torch.tensor(rows, device=dev)] = torch.tensor(toks, device=dev)
        if self.graphs is not None:
            guesses = self.graphs.replay(("draft", batch.size))
        else:
            guesses = self._draft(batch.size, self._mi, self._out)
        if not done:
            return None
        last = torch.tensor([batch.first_row[i] + batch.items[i].n - 1 for i in done], device=dev)
        return guesses[last]
