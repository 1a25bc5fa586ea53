"""Where a step's rows are laid out: decode rows and prefill chunks in one forward.

A row is one new token of one request. A step holds, in this order,

    decode items   K + 1 rows per running request: its pending token, then its K drafts
                   (input ids gathered on the device from ``req_to_next_token_ids``)
    prefill items  the next chunk of an admitted prompt (input ids staged from the prompt)
    padding        HOLD rows up to the ladder's size (CUDA)

The attention reads the KV cache through the slot table, so row t of a request at position
p is a query that sees positions 0..p: a decode row, an MTP verify row and a prefill token are
the same thing, and one forward serves them all (docs/decode_step.md, "Mixed steps").

Two layouts of the same rows:
- rows (CUDA): every row a decode-style row, padded to the step ladder and replayed from a
  CUDA graph per size (``--disable_cudagraph`` pads the same way and runs the same body
  eagerly); logits of every row;
- items (CPU and other ranks layouts, no ladder): each item a prefill-style chunk over its
  cached prefix, logits of the rows a step samples only (``ModelInput.logit_rows``).

A depth-by-depth MTP draft (``DraftProposer``) drafts over the same rows after sampling:
position s at depth d takes token x_{s+d+1}: from the prompt (``known``), the sampled token
(a decode row's verified token at depth 0, a finished prompt's first token), or the previous
depth's guess at s.
"""
import itertools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightllm.common.basemodel.batch_objs import DecodeHead, ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import CudaGraphSet, GraphLadder, capture_ladder
from lightllm.server.router.model_infer.mtp_speculative.draft import UNKNOWN_TOKEN, tokens_ahead
from lightllm.utils.host_copy import to_device

# Input token of a padding row (any valid id: its outputs are never read).
PAD_TOKEN_ID = 0
# Staged input id of a decode row: gather it from req_to_next_token_ids[req, mtp_index].
GATHER_INPUT = -1
# Host staging columns (one copy per step moves them to the device), then K columns of known tokens.
# STAGE_LOGIT_ROW: entry i of that column is the row whose logits come i-th (rows layout);
# STAGE_DRAFT_ROW: entry i is the i-th row whose draft guesses can be read (rows layout; unused: the size).
(STAGE_INPUT_ID, STAGE_REQ_IDX, STAGE_SEQ_LEN, STAGE_SLOT, STAGE_MTP_INDEX, STAGE_LOGIT_ROW, STAGE_DRAFT_ROW,
 STAGE_COLUMNS) = range(8)
# Step ladder: powers of two below this many rows, then one captured size every STEP_GROW_ROWS rows
# (a mixed step of 256 decode rows and a 400-token chunk pads to 768 rows, not 1024).
STEP_SPLIT_ROWS = 512
STEP_GROW_ROWS = 256


@dataclass
class RowItem:
    """One request's rows in a step."""

    req_idx: int
    start: int  # position of its first row
    n: int  # rows
    tokens: Optional[Sequence[int]] = None  # prefill: the whole prompt (rows take tokens[start:start + n]); None: decode


@dataclass
class RowsBatch:
    """What ``stage`` laid out: the padded size (rows layout) or None (items layout), each item's rows."""

    size: Optional[int]
    items: List[RowItem]
    first_row: List[int]  # per item
    num_decode_rows: int  # rows of the decode items (the first items)
    num_rows: int  # real rows
    # the target forward's input and output (set by ``forward``; the draft pass reads them)
    model_input: Optional[ModelInput] = None
    output: Optional[ModelOutput] = None

    def last_row(self, item: int) -> int:
        return self.first_row[item] + self.items[item].n - 1

    def sampled_rows(self, sampled_items: Sequence[int]) -> List[int]:
        """The rows a step samples: every decode row, then the last row of each sampled item."""
        return list(range(self.num_decode_rows)) + [self.last_row(i) for i in sampled_items]

    def draft_rows(self, k: int) -> List[int]:
        """The rows whose draft guesses a step can read: every decode row, and the last K rows of
        each prefill item (a later depth there may take the guess before it; a finished prompt's
        last row proposes). The other rows' next tokens are in the prompt."""
        d = self.num_decode_rows
        return list(range(d)) + [r for i, it in enumerate(self.items) if it.tokens is not None
                                 for r in range(max(self.last_row(i) + 1 - k, self.first_row[i]), self.last_row(i) + 1)]

    def logit_positions(self, sampled_items: Sequence[int]) -> List[int]:
        """Where ``sampled_rows`` are in the output of a forward that computed the logits of the
        decode rows, then of each prefill item's last row in item order (``max_logit_rows``)."""
        d, decode_items = self.num_decode_rows, sum(it.tokens is None for it in self.items)
        return list(range(d)) + [d + i - decode_items for i in sampled_items]


def token_ladder(max_tokens: int) -> GraphLadder:
    """Powers of two below ``max_tokens``, then ``max_tokens``."""
    return GraphLadder.from_flags(max_tokens, max_tokens, max_tokens)


def max_sampled_rows(running_reqs: int, mtp_step: int) -> int:
    """Most rows one step samples: K + 1 per decoding request, one per prompt chunk."""
    return running_reqs * (mtp_step + 1)


def step_ladder(max_prefill_tokens: int, max_rows: int) -> GraphLadder:
    """Powers of two below STEP_SPLIT_ROWS, then every STEP_GROW_ROWS rows up to the larger of
    ``max_prefill_tokens`` (a prefill-only step) and ``max_rows`` (decode rows beside a chunk)."""
    return GraphLadder.from_flags(max(max_rows, max_prefill_tokens), min(max_prefill_tokens, STEP_SPLIT_ROWS),
                                  STEP_GROW_ROWS)


class StepRows:
    """Owns the static row buffers (and CUDA graphs) of steps laid out as rows."""

    def __init__(self, model, req_to_next_token_ids: torch.Tensor, ladder: Optional[GraphLadder],
                 use_graphs: bool, draft=None, max_rows: Optional[int] = None,
                 max_logit_rows: Optional[int] = None,
                 context: Optional[Callable[[ModelInput, ModelOutput], None]] = None,
                 decode_runs: Optional[Tuple[int, int]] = None):
        """``ladder``: padded sizes (rows layout) or None (items layout, unpadded, no graphs).
        ``draft``: a DraftProposer (drafts over rows) or None. ``max_rows``: most real rows of an
        items-layout step (buffers grow past it). ``max_logit_rows``: rows layout, most rows a step
        samples (decode rows plus one per prompt chunk: running requests x (K + 1)); the forward
        computes the logits of that many rows, not of every row (None: every row). ``context``: a
        draft's per-row state written from a mixed step's rows (dspark's context K/V; a graph per size).
        ``decode_runs``: (K + 1, most running requests) when steps may hold decode rows (mixed steps,
        rows layout): the attention then plans the decode rows apart from the prompt chunks."""
        self.model = model
        self.context = context
        self.req_to_next_token_ids = req_to_next_token_ids
        self.draft = draft
        self.k = draft.mtp_step if draft is not None else 0
        self.ladder = ladder
        self.max_tokens = ladder.max_size if ladder is not None else None
        self.max_logit_rows = max_logit_rows if ladder is not None else None
        self.device = model.device
        self.decode_runs = decode_runs if ladder is not None else None
        hold = [PAD_TOKEN_ID, model.req_manager.HOLD_REQUEST_ID, 1, model.mem_manager.HOLD_SLOT, 0, 0, 0]  # STAGE_COLUMNS
        self._hold_row_np = np.array(hold + [UNKNOWN_TOKEN] * self.k, dtype=np.int64)
        self._alloc(self.max_tokens if ladder is not None else (max_rows or 1))
        # the staging buffer is rewritten only after the GPU has read it (a step may not sync)
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self.graphs: Optional[CudaGraphSet] = None
        if use_graphs and ladder is not None:
            self.graphs = CudaGraphSet(self.device)
            capture_ladder(self.graphs, ladder.sizes, self._capture_one, what="step row counts")

    def _alloc(self, rows: int) -> None:
        dev, on_gpu, width = self.device, self.device.type == "cuda", STAGE_COLUMNS + self.k
        self.capacity = rows
        self._stage_host = torch.zeros((rows, width), dtype=torch.int64, pin_memory=on_gpu)
        self._stage_np = self._stage_host.numpy()
        self._staged = torch.zeros((rows, width), dtype=torch.int64, device=dev)
        # [K, rows]: the token each row takes at each draft depth (UNKNOWN_TOKEN: its guess)
        self.known = torch.full((self.k, rows), UNKNOWN_TOKEN, dtype=torch.int64, device=dev)
        self.staged_ids = torch.full((rows,), PAD_TOKEN_ID, dtype=torch.int64, device=dev)
        self.b_req_idx = torch.full((rows,), self.model.req_manager.HOLD_REQUEST_ID, dtype=torch.int32, device=dev)
        self.b_seq_len = torch.ones((rows,), dtype=torch.int32, device=dev)
        self.mem_indexes = torch.full((rows,), self.model.mem_manager.HOLD_SLOT, dtype=torch.int64, device=dev)
        self.b_mtp_index = torch.zeros((rows,), dtype=torch.int32, device=dev)
        self.logit_index = torch.zeros((rows,), dtype=torch.int64, device=dev)
        self.draft_index = torch.zeros((rows,), dtype=torch.int64, device=dev)

    def logit_count(self, size: int) -> int:
        """Rows whose logits a rows-layout forward of ``size`` rows computes."""
        return size if self.max_logit_rows is None else min(size, self.max_logit_rows)

    def bucket_size(self, num_rows: int) -> Optional[int]:
        """The padded size of a ``num_rows`` step; None: no ladder or too many rows."""
        return self.ladder.bucket_size(num_rows) if self.ladder is not None else None

    def fits(self, num_rows: int) -> bool:
        """Whether a step of ``num_rows`` real rows can be laid out here."""
        return self.ladder is None or self.ladder.bucket_size(num_rows) is not None

    # ---- staging ----
    def stage(self, items: List[RowItem], slots: torch.Tensor, size: Optional[int] = None) -> RowsBatch:
        """Rows of the items (decode items first), HOLD rows up to the ladder's size; one
        host-to-device copy. ``slots``: the rows' KV slots in order (host int64).
        ``size``: the padded size (default: the ladder's bucket; rows layout only)."""
        lens = [it.n for it in items]
        real = sum(lens)
        if self.ladder is not None:
            size = size if size is not None else self.ladder.bucket_size(real)
            if size is None or size < real:
                raise ValueError(f"{real} rows do not fit the step ladder (largest {self.max_tokens})")
        elif real > self.capacity:
            self._alloc(real)
        rows = size if size is not None else real
        if self._copy_done is not None:
            self._copy_done.synchronize()
        st = self._stage_host[:rows]
        sn = self._stage_np[:rows]  # the same memory as numpy: a few us per op, not a torch op's ~10
        first_row = [r - n for r, n in zip(itertools.accumulate(lens), lens)]
        decode_items = next((i for i, it in enumerate(items) if it.tokens is not None), len(items))
        if any(it.tokens is None for it in items[decode_items:]):
            raise ValueError("decode items come before prefill items")
        num_decode = sum(lens[:decode_items])
        if items:
            lens_a, first_a = np.array(lens, dtype=np.int64), np.array(first_row, dtype=np.int64)
            item = np.repeat(np.arange(len(items)), lens_a)
            offset = np.arange(real) - first_a[item]  # the row's place in its item
            sn[:real, STAGE_REQ_IDX] = np.array([it.req_idx for it in items], dtype=np.int64)[item]
            sn[:real, STAGE_SEQ_LEN] = offset + np.array([it.start for it in items], dtype=np.int64)[item] + 1
            offset[num_decode:] = 0  # a prefill row's input is staged, not gathered
            sn[:real, STAGE_MTP_INDEX] = offset
            sn[:num_decode, STAGE_INPUT_ID] = GATHER_INPUT
            sn[:num_decode, STAGE_COLUMNS:] = UNKNOWN_TOKEN  # decode rows' known tokens are on the device
            for i in range(decode_items, len(items)):
                # row r at position s = start + r: the token at s (its input), then x_{s+1} .. x_{s+K}
                # (the token depth d takes), UNKNOWN_TOKEN past the prompt
                it, r0 = items[i], first_row[i]
                ahead = tokens_ahead(it.tokens, it.start, it.n, self.k + 1)
                sn[r0:r0 + it.n, STAGE_INPUT_ID] = ahead[:, 0]
                sn[r0:r0 + it.n, STAGE_COLUMNS:] = ahead[:, 1:]
        sn[:real, STAGE_SLOT] = slots.numpy()
        sn[real:] = self._hold_row_np
        batch = RowsBatch(size, list(items), first_row, num_decode, real)
        if size is not None and self.max_logit_rows is not None:
            logit_rows = batch.sampled_rows(range(decode_items, len(items)))
            if len(logit_rows) > self.logit_count(rows):
                raise ValueError(f"{len(logit_rows)} sampled rows exceed max_logit_rows {self.max_logit_rows}")
            sn[:, STAGE_LOGIT_ROW] = 0  # the unused entries name row 0
            sn[:len(logit_rows), STAGE_LOGIT_ROW] = logit_rows
            if self.k:
                draft_rows = batch.draft_rows(self.k)
                if len(draft_rows) > self.logit_count(rows):
                    raise ValueError(f"{len(draft_rows)} draft rows exceed max_logit_rows {self.max_logit_rows}")
                sn[:, STAGE_DRAFT_ROW] = rows  # unused entries name the scratch row past the last
                sn[:len(draft_rows), STAGE_DRAFT_ROW] = draft_rows
        seq_cpu = torch.from_numpy(sn[:, STAGE_SEQ_LEN].astype(np.int32))  # a copy: the buffer is staged again
        staged = self._staged[:rows]
        staged.copy_(st, non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        self.staged_ids[:rows].copy_(staged[:, STAGE_INPUT_ID])
        self.b_req_idx[:rows].copy_(staged[:, STAGE_REQ_IDX])
        self.b_seq_len[:rows].copy_(staged[:, STAGE_SEQ_LEN])
        self.mem_indexes[:rows].copy_(staged[:, STAGE_SLOT])
        self.b_mtp_index[:rows].copy_(staged[:, STAGE_MTP_INDEX])
        self.logit_index[:rows].copy_(staged[:, STAGE_LOGIT_ROW])
        self.draft_index[:rows].copy_(staged[:, STAGE_DRAFT_ROW])
        if self.k:
            self.known[:, :rows].copy_(staged[:, STAGE_COLUMNS:].t())
        self.staged_seq_len_cpu = seq_cpu
        return batch

    def logit_rows(self, batch: RowsBatch, sampled_items: Sequence[int]) -> torch.Tensor:
        """[decode rows + len(sampled_items)] device: the rows a step samples (every decode row,
        the last row of each sampled item) as indices into ``forward``'s logits."""
        if batch.size is None:  # items layout: the forward computed exactly these, in this order
            return torch.arange(batch.num_decode_rows + len(sampled_items), device=self.device)
        if self.max_logit_rows is not None:
            return to_device(batch.logit_positions(sampled_items), self.device)
        return to_device(batch.sampled_rows(sampled_items), self.device)

    # ---- forward ----
    def _inputs(self, rows: int) -> torch.Tensor:
        """Device-only: point each row's position at its slot, take its input token."""
        req = self.b_req_idx[:rows].long()
        self.model.req_manager.req_to_token_indexs[req, self.b_seq_len[:rows].long() - 1] = self.mem_indexes[:rows]
        ids = self.staged_ids[:rows]
        gathered = self.req_to_next_token_ids[req, self.b_mtp_index[:rows].long()]
        return torch.where(ids == GATHER_INPUT, gathered, ids)

    def _rows_input(self, size: int, seq_len_cpu: torch.Tensor) -> ModelInput:
        head = None
        if self.decode_runs is not None:  # the decode rows (staged to be gathered) come first
            head_rows = (self.staged_ids[:size] == GATHER_INPUT).sum(dtype=torch.int32).reshape(1)
            head = DecodeHead(head_rows, *self.decode_runs)
        return ModelInput(
            batch_size=size, total_token_num=0, max_len_in_batch=int(seq_len_cpu.max()),
            input_ids=self._inputs(size), mem_indexes=self.mem_indexes[:size], b_req_idx=self.b_req_idx[:size],
            b_seq_len=self.b_seq_len[:size], is_prefill=False, b_seq_len_cpu=seq_len_cpu, max_q_len=size,
            logit_rows=None if self.max_logit_rows is None else self.logit_index[:self.logit_count(size)],
            decode_head=head,
        )

    def _items_input(self, batch: RowsBatch, sampled_items: Sequence[int]) -> ModelInput:
        starts = torch.tensor([it.start for it in batch.items], dtype=torch.int32)
        seq = starts + torch.tensor([it.n for it in batch.items], dtype=torch.int32)
        dev = self.device
        return ModelInput(
            batch_size=len(batch.items), total_token_num=int(seq.sum()), max_len_in_batch=int(seq.max()),
            input_ids=self._inputs(batch.num_rows), mem_indexes=self.mem_indexes[:batch.num_rows],
            b_req_idx=to_device([it.req_idx for it in batch.items], dev, torch.int32),
            b_seq_len=to_device(seq, dev, torch.int32), is_prefill=True,
            b_ready_cache_len=to_device(starts, dev, torch.int32), b_seq_len_cpu=seq,
            b_ready_cache_len_cpu=starts, logit_rows=to_device(batch.sampled_rows(sampled_items), dev),
        )

    def _capture_one(self, size: int) -> None:
        self.stage([], torch.zeros(0, dtype=torch.int64), size)
        mi, out = self.graphs.capture(("target", size), lambda: self._target(size, torch.ones(size, dtype=torch.int32)))
        if self.draft is not None:
            self.graphs.capture(("draft", size), lambda: self._draft(mi, out, self.known[:, :size]))
        if self.context is not None:
            self.graphs.capture(("context", size), lambda: self.context(mi, out))

    def _target(self, size: int, seq_len_cpu: torch.Tensor):
        mi = self._rows_input(size, seq_len_cpu)
        return mi, self.model.forward(mi)

    def _draft(self, mi: ModelInput, out: ModelOutput, known: torch.Tensor, sel: Optional[torch.Tensor] = None):
        if sel is None and self.max_logit_rows is not None:  # rows layout: the staged draft rows
            sel = self.draft_index[:self.logit_count(known.shape[1])]
        return self.draft.propose_rows(mi, out, known, sel)

    def forward_rows(self, batch: RowsBatch, sampled_items: Sequence[int] = ()) -> Tuple[ModelInput, ModelOutput]:
        """The target over the staged rows. Rows layout: logits of every row, or of the staged
        sampled rows with ``max_logit_rows`` (``logit_rows`` picks);
        items layout: of the decode rows and the last rows of ``sampled_items`` only."""
        if batch.size is None:
            mi = self._items_input(batch, sampled_items)
            return mi, self.model.forward(mi)
        if self.graphs is not None:
            return self.graphs.replay(("target", batch.size))
        return self._target(batch.size, self.staged_seq_len_cpu)

    def forward(self, batch: RowsBatch) -> ModelOutput:
        """A prefill-only step's output as the prefill forward gives it (each item's last-token
        logits, every new token's hidden states). The slot table must map every new position."""
        mi, out = self.forward_rows(batch, range(len(batch.items)))
        batch.model_input, batch.output = mi, out
        t = batch.num_rows
        logits = out.logits if batch.size is None else out.logits[self.logit_rows(batch, range(len(batch.items)))]
        aux = out.aux_hidden_states
        return ModelOutput(logits=logits, hidden_states=out.hidden_states[:t],
                           aux_hidden_states=None if aux is None else aux[:t])

    # ---- draft ----
    def write_context(self, batch: RowsBatch, mi: ModelInput, out: ModelOutput) -> None:
        """``context`` over the rows of ``forward_rows``' output (a graph replay in the rows layout)."""
        if self.graphs is not None and batch.size is not None:
            self.graphs.replay(("context", batch.size))
        else:
            self.context(mi, out)

    def propose_after(self, batch: RowsBatch, mi: ModelInput, out: ModelOutput, decode_ids: Optional[torch.Tensor],
                      done: Sequence[int], first_ids: torch.Tensor) -> torch.Tensor:
        """After sampling: the draft pass over every row (its KV, also for unfinished chunks).
        ``decode_ids``: [decode rows] each decode row's verified token; ``done``: the items whose
        prompt finished, ``first_ids``: [len(done)] their first tokens (device). Returns the
        guesses [decode rows + len(done), K]: every decode row's, then each done item's last row's."""
        dev = self.device
        d_rows = batch.num_decode_rows
        if d_rows:
            self.known[0, :d_rows] = decode_ids
        rows, depths, which = [], [], []
        for j, i in enumerate(done):  # position s = L - 1 - d takes x_L (the first token) at depth d
            it, r0 = batch.items[i], batch.first_row[i]
            for d in range(self.k):
                o = len(it.tokens) - 1 - d - it.start
                if 0 <= o < it.n:
                    rows.append(r0 + o)
                    depths.append(d)
                    which.append(j)
        if rows:
            self.known[to_device(depths, dev), to_device(rows, dev)] = first_ids[to_device(which, dev)]
        last = [batch.last_row(i) for i in done]
        if batch.size is not None and self.graphs is not None:
            guesses = self.graphs.replay(("draft", batch.size))
        elif batch.size is not None:
            guesses = self._draft(mi, out, self.known[:, :batch.size])
        else:  # items layout: greedy guesses only where a later depth or the result reads them
            guesses = self._draft(mi, out, self.known[:, :batch.num_rows], to_device(batch.draft_rows(self.k), dev))
        if not last:
            return guesses[:d_rows]
        return torch.cat([guesses[:d_rows], guesses[to_device(last, dev)]])

    def propose(self, batch: RowsBatch, first_tokens) -> Optional[torch.Tensor]:
        """After ``forward`` of a prefill-only step: the K proposals [done, K] after the first tokens
        of the items in ``first_tokens`` (item -> token), in item order; None when no prompt is done."""
        done = sorted(first_tokens)
        ids = to_device([first_tokens[i] for i in done], self.device)
        guesses = self.propose_after(batch, batch.model_input, batch.output, None, done, ids)
        return guesses if done else None
