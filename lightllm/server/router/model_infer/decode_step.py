"""The decode step's one owner: static buffers, CUDA graphs, verifier, drafter, one host copy.

    prepare (host): slots, one staging tensor -> one copy to static device buffers
    forward: KV slot table + input ids gathered on device, target over n*(K+1) rows
             (graph T_n replay, or the same body eagerly)
    finish:  sample -> verify (strict | ASD) -> pack -> async copy to the host
             -> drafts (graph D_n) -> scatter -> wait for the copy
    commit_step (host, pure bookkeeping over the packed result): append tokens, stop checks,
             rejected slots to free

Overlap (``launch_finish`` / ``wait``, ``prepare_successor``): the next step of the same
requests can be launched before the host has read this one; its rows take their KV lengths
from this step's accept lengths on the device. ``snapshot`` / ``restore`` undo such a step
(docs/decode_step.md, "What overlaps").

Padding rows (HOLD rows) sit after the real rows: the forwards and the draft run over
them; sampling, verification and commit never see them. On CUDA a batch of n requests is
padded to the graph ladder's size (``GraphLadder.bucket_size``) whether graphs are on or
not, so eager and graph decoding run the same kernels on the same shapes.
"""
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import CudaGraphSet, GraphLadder, capture_ladder
from lightllm.common.basemodel.mtp_verify_torch import mtp_scatter_next_token_ids_torch
from lightllm.models.llama.layer_infer.attention_backends import TORCH_BACKEND, resolve_attention_backend
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID, mtp_scatter_next_token_ids
from lightllm.server.router.model_infer.grammar import rows_bitmask
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.core.objs.sampling_params import MAX_TOP_LOGPROBS
from lightllm.server.router.model_infer.mode_backend.generic_post_process import (
    SampleOutput, max_top_logprobs, token_logprobs, top_logprobs,
)
from lightllm.server.router.model_infer.mtp_speculative.proposer import MixedProposal, Proposal
from lightllm.server.router.model_infer.mtp_speculative.utils import AsdConfig, VerifyStepRecord, verify_mtp_tokens

logger = logging.getLogger(__name__)

# Input token of a padding row (any valid id: its outputs are never read).
PAD_TOKEN_ID = 0
# Columns of the host staging tensor: one row per decode row.
STAGE_REQ_IDX, STAGE_SEQ_LEN, STAGE_SLOT, STAGE_COLUMNS = 0, 1, 2, 3
# Host staging and result buffers used by turns: one step in flight while the next is staged.
HOST_BUFFERS = 2

# sample(logits [rows, vocab], b_req_idx [rows], reqs per row, seeds per row,
#        token bitmask [rows, W] int32 host or None) -> SampleOutput
Sampler = Callable[[torch.Tensor, torch.Tensor, List[InferReq], list, Optional[torch.Tensor]], SampleOutput]
# req, row index inside its request -> the seed of that draw (or None)
SeedFn = Callable[[InferReq, int], Optional[int]]


@dataclass
class DecodeRows:
    """Row layout of one decode forward: K+1 consecutive rows per request, then padding.

    Padding (HOLD rows): ``b_req_idx`` = the HOLD row, ``mem_indexes`` = HOLD_SLOT. They run
    through the forwards but are never sampled, verified, committed or written into a table.
    Device tensors are views of the step's static buffers, valid until the next ``prepare``.
    """

    reqs: List[InferReq]  # [num_reqs]
    mtp_step: int  # K
    b_req_idx: torch.Tensor  # [rows] int32
    b_mtp_index: torch.Tensor  # [rows] int32
    b_seq_len: torch.Tensor  # [rows] int32
    b_seq_len_cpu: torch.Tensor  # [rows] int32
    mem_indexes: torch.Tensor  # [rows] int64
    mem_indexes_cpu: torch.Tensor  # [rows] int64
    b_req_mtp_start_loc: torch.Tensor  # [num_reqs] int32
    graph_size: Optional[int] = None  # ladder size (requests) the rows were padded to
    model_input: Optional[ModelInput] = None  # set by the forward; the draft reuses it

    @property
    def rows_per_req(self) -> int:
        return self.mtp_step + 1

    @property
    def num_rows(self) -> int:
        return int(self.b_req_idx.shape[0])

    @property
    def num_real_rows(self) -> int:
        """Rows of real requests; rows past them are padding."""
        return len(self.reqs) * self.rows_per_req


@dataclass
class HostStepResult:
    """What the host needs after a decode step: one packed device-to-host copy, unpacked."""

    ids: List[int]  # [real rows] committed candidates (relaxed rows hold the draft)
    logprobs: List[float]  # [real rows]
    accept_len: List[int]  # [num_reqs]
    relaxed: Optional[List[bool]] = None  # [real rows], ASD only
    spent: Optional[List[float]] = None  # [num_reqs] ASD ledger after the step, ASD only
    confidence: Optional[List[List[float]]] = None  # [num_reqs][K] the verified drafts' confidences
    # [real rows][k_max] each row's most likely tokens and their log-probs, descending; only
    # when some request of the step asks for top log-probs (k_max > 0)
    top_ids: Optional[List[List[int]]] = None
    top_logprobs: Optional[List[List[float]]] = None

    @staticmethod
    def pack(ids, logprobs, accept_len, relaxed=None, spent=None, confidence=None, top=None) -> torch.Tensor:
        """One float64 tensor (exact for token ids, fp32 values and flags). ``top``: ([rows, k]
        ids, [rows, k] log-probs) of every row, or None (k_max 0: nothing appended)."""
        parts = [ids, logprobs, accept_len] + ([relaxed, spent] if relaxed is not None else [])
        parts += [confidence] if confidence is not None else []
        parts += list(top) if top is not None else []
        return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_rows: int, num_reqs: int, asd: bool,
               conf_width: int = 0, top_width: int = 0) -> "HostStepResult":
        """``conf_width``: K when the draft reports confidences, else 0; ``top_width``: k_max, the
        top log-probs per row the step kept (0: none)."""
        a = packed.numpy()  # host memory (the pinned copy): numpy converts whole slices at once
        end = 2 * num_rows + num_reqs
        out = cls(a[:num_rows].astype(np.int64).tolist(), a[num_rows:2 * num_rows].tolist(),
                  a[2 * num_rows:end].astype(np.int64).tolist())
        if asd:
            out.relaxed = (a[end:end + num_rows] != 0.0).tolist()
            out.spent = a[end + num_rows:end + num_rows + num_reqs].tolist()
            end += num_rows + num_reqs
        if conf_width:
            out.confidence = a[end:end + num_reqs * conf_width].reshape(num_reqs, conf_width).tolist()
            end += num_reqs * conf_width
        if top_width:
            w = top_width
            out.top_ids = a[end:end + num_rows * w].reshape(num_rows, w).astype(np.int64).tolist()
            end += num_rows * w
            out.top_logprobs = a[end:end + num_rows * w].reshape(num_rows, w).tolist()
        return out

    @staticmethod
    def packed_size(num_rows: int, num_reqs: int, asd: bool, conf_width: int = 0, top_width: int = 0) -> int:
        return (2 * num_rows + num_reqs + ((num_rows + num_reqs) if asd else 0) + num_reqs * conf_width
                + 2 * num_rows * top_width)

    def row_top_logprobs(self, row: int, k: int) -> List[Tuple[int, float]]:
        """Row ``row``'s ``k`` most likely tokens as (id, log-prob) (k <= the step's k_max)."""
        return list(zip(self.top_ids[row][:k], self.top_logprobs[row][:k]))


@dataclass
class PendingResult:
    """A step whose packed result is on its way to the host (``DecodeStep.launch_finish``)."""

    host: torch.Tensor  # pinned view the async copy writes
    done: Optional[torch.cuda.Event]  # None on CPU (the copy is synchronous there)
    num_rows: int  # real rows
    num_reqs: int
    asd: bool
    accept_len: torch.Tensor  # [num_reqs] int32 device: what a successor step's KV lengths add
    top_width: int = 0  # k_max: top log-probs per row in the packed result (0: none)


@dataclass
class FirstTokens:
    """Prompts whose last chunk runs in a mixed step: each samples its first token (and, with a
    draft, gets its first K drafts) in the same flow as the step's decode rows."""

    reqs: List[InferReq]  # [m]
    req_idx: torch.Tensor  # [m] int32 device
    logit_rows: torch.Tensor  # [decode rows + m] device: the sampled rows' logits in the forward's output
    # (decode rows' verified tokens [rows], first tokens [m], accept lengths [n]) -> the proposals after them;
    # None without a draft
    propose: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], MixedProposal]] = None


@dataclass
class ReqCommit:
    """What one request kept in a step."""

    tokens: List[int]
    logprobs: List[float]
    draft_confidence: Optional[List[float]] = None  # [K] confidences of the drafts verified this step
    # per token: the request's top_logprobs (id, log-prob) of the row that chose it; None when it asked 0
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None


def commit_step(
    reqs: List[InferReq], host: HostStepResult, slots: List[int], rows_per_req: int
) -> Tuple[List[Optional[ReqCommit]], List[int]]:
    """Host bookkeeping of one decode step (no device work): append each request's accepted
    tokens until it finishes (EOS / stop / length), count MTP and ASD totals, extend its KV
    slots. Returns what each request kept (None for a request that had already finished or
    was aborted when the step ran: an overlapped step; it keeps nothing) and the slots of the
    rows nobody kept."""
    k1 = rows_per_req
    commits, free_slots = [], []
    for r, req in enumerate(reqs):
        start, a = r * k1, host.accept_len[r]
        if req.finish_reason is not None:
            free_slots.extend(slots[start:start + k1])
            commits.append(None)
            continue
        kept = req.append_tokens(host.ids[start:start + a], host.logprobs[start:start + a])
        req.decode_steps += 1
        req.mtp_accepted_token_num += min(kept, a - 1)
        if host.relaxed is not None:
            req.asd_relaxed_token_num += sum(host.relaxed[start + j] for j in range(min(kept, a - 1)))
        if host.spent is not None:
            req.asd_regret_spent = host.spent[r]
        req.kv_len += kept
        req.slots.extend(slots[start:start + kept])
        free_slots.extend(slots[start + kept:start + k1])
        conf = host.confidence[r] if host.confidence is not None else None
        k = req.params.top_logprobs
        top = [host.row_top_logprobs(start + j, k) for j in range(kept)] if k else None
        commits.append(ReqCommit(host.ids[start:start + kept], host.logprobs[start:start + kept], conf, top))
    return commits, free_slots


def decode_attention_is_torch(model) -> bool:
    """Whether the model decodes with the torch attention path (it reads KV lengths on the host)."""
    kvargs = getattr(model, "kvargs", None)
    name = getattr(kvargs, "decode_attention_backend", "auto")
    return resolve_attention_backend(name, model.device) == TORCH_BACKEND


class DecodeStep:
    """Owns the decode step's static buffers and graphs; the backend owns requests and pools."""

    def __init__(
        self,
        model,
        req_to_next_token_ids: torch.Tensor,  # [max_req + 1, W] int64
        params_manager,
        draft,  # a proposer (mtp_speculative/draft.py) or None
        mtp_step: int,
        asd: Optional[AsdConfig],
        max_reqs: int,  # most requests one decode forward holds (padding included)
        ladder: Optional[GraphLadder],  # CUDA: the padding ladder (also eager); None: no padding
        use_graphs: bool,
    ):
        self.model = model
        self.mem_manager = model.mem_manager
        self.req_manager = model.req_manager
        self.req_to_next_token_ids = req_to_next_token_ids
        self.params_manager = params_manager
        self.draft = draft
        self.mtp_step = mtp_step
        self.asd = asd
        self.ladder = ladder
        self.verify_observer: Optional[Callable[[VerifyStepRecord], None]] = None
        self.device = model.device
        k1 = mtp_step + 1
        self.max_rows = max_reqs * k1
        dev, on_gpu = self.device, self.device.type == "cuda"
        # Host staging (pinned on CUDA) -> one copy per step into _staged; two of each host buffer,
        # used by turns, so that a step can be staged while the previous one is still in flight.
        self._stage_hosts = [torch.zeros((self.max_rows, STAGE_COLUMNS), dtype=torch.int64, pin_memory=on_gpu)
                             for _ in range(HOST_BUFFERS)]
        self._stage_nps = [h.numpy() for h in self._stage_hosts]  # the same memory, as numpy
        self._hold_stage_row = np.zeros(STAGE_COLUMNS, dtype=np.int64)  # a padding row's columns
        self._hold_stage_row[[STAGE_REQ_IDX, STAGE_SEQ_LEN, STAGE_SLOT]] = (
            self.req_manager.HOLD_REQUEST_ID, 1, self.mem_manager.HOLD_SLOT)
        self._stage_turn = 0
        self._staged = torch.zeros((self.max_rows, STAGE_COLUMNS), dtype=torch.int64, device=dev)
        self.b_req_idx = torch.full((self.max_rows,), self.req_manager.HOLD_REQUEST_ID, dtype=torch.int32, device=dev)
        self.b_seq_len = torch.ones((self.max_rows,), dtype=torch.int32, device=dev)
        self.mem_indexes = torch.full((self.max_rows,), self.mem_manager.HOLD_SLOT, dtype=torch.int64, device=dev)
        self.b_mtp_index = torch.arange(k1, dtype=torch.int32, device=dev).repeat(max_reqs)
        self.b_req_mtp_start_loc = torch.arange(0, self.max_rows, k1, dtype=torch.int32, device=dev)
        self.first_tokens = torch.full((self.max_rows,), PAD_TOKEN_ID, dtype=torch.int64, device=dev)
        # accept length per request for the draft (padding requests: 1)
        self._accept_len = torch.ones((max_reqs,), dtype=torch.int32, device=dev)
        # [max_req + 1, K] confidences of each request's pending drafts (drafts that report them)
        self.conf_width = mtp_step if draft is not None and draft.has_confidence else 0
        self.req_to_draft_conf = (
            torch.zeros((self.req_manager.HOLD_REQUEST_ID + 1, mtp_step), dtype=torch.float32, device=dev)
            if self.conf_width else None
        )
        # ASD verify's relaxed-row output (strict verification has none)
        self._relaxed_mask = torch.zeros((self.max_rows,), dtype=torch.int32, device=dev) if asd is not None else None
        # room for the top log-probs of every row (only filled in steps where a request asks)
        max_packed = HostStepResult.packed_size(self.max_rows, max_reqs, asd is not None, self.conf_width,
                                                MAX_TOP_LOGPROBS)
        self._packed_hosts = [torch.zeros((max_packed,), dtype=torch.float64, pin_memory=on_gpu)
                              for _ in range(HOST_BUFFERS)]
        self._copies_done = [torch.cuda.Event() if on_gpu else None for _ in range(HOST_BUFFERS)]
        self._packed_turn = 0
        # What an overlapped step may change per request, saved before it runs (``snapshot``).
        self._snap_next = torch.zeros((max_reqs, req_to_next_token_ids.shape[1]), dtype=torch.int64, device=dev)
        self._snap_regret = torch.zeros((max_reqs,), dtype=torch.float32, device=dev)
        self._snap_conf = torch.zeros((max_reqs, max(self.conf_width, 1)), dtype=torch.float32, device=dev)
        # The torch attention path reads the rows' KV lengths on the host: a successor step then
        # needs them exact (a device read; CPU only in practice), elsewhere an upper bound does.
        self.exact_host_seq_len = not on_gpu or decode_attention_is_torch(model)
        self.graphs: Optional[CudaGraphSet] = None
        if use_graphs:
            self._capture_graphs()

    # ---- rows ----
    def padded_rows(self, num_reqs: int) -> int:
        """Rows a decode step of ``num_reqs`` requests runs: padded to the ladder's size on CUDA."""
        size = self.ladder.bucket_size(num_reqs) if self.ladder is not None else None
        return (num_reqs if size is None else size) * (self.mtp_step + 1)

    def prepare(self, reqs: List[InferReq], num_rows: Optional[int] = None, kv_ahead: Union[int, Dict[int, int]] = 0,
                graph_size: Optional[int] = None) -> DecodeRows:
        """Allocate K+1 KV slots per request and stage the rows; pad with HOLD rows to
        ``num_rows`` rows (DP: the same rows on every rank; ``graph_size``: the ladder size they are) or, on
        CUDA, to the ladder's size. ``kv_ahead``: KV positions each request gains before the step runs (plain
        decoding staged under a step in flight: 1; by req_idx under a mixed step: its chunk for a prompt)."""
        k1 = self.mtp_step + 1
        n = len(reqs)
        real = n * k1
        if graph_size is not None and num_rows != graph_size * k1:
            raise ValueError(f"num_rows {num_rows} is not graph_size {graph_size} requests' rows")
        if num_rows is None:
            graph_size = self.ladder.bucket_size(n) if self.ladder is not None else None
            num_rows = graph_size * k1 if graph_size is not None else real
        if num_rows < real:
            raise ValueError(f"{n} requests need {real} rows, more than num_rows={num_rows}")
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} decode rows exceed the step's {self.max_rows} static rows")
        gains = [kv_ahead.get(r.req_idx, 0) for r in reqs] if isinstance(kv_ahead, dict) else [kv_ahead] * n
        kv_len = np.fromiter((r.kv_len + g for r, g in zip(reqs, gains)), dtype=np.int64, count=n)
        # the row of position kv_len + j caches kv_len + j + 1 tokens after the forward
        seq = (kv_len[:, None] + np.arange(1, k1 + 1, dtype=np.int64)[None, :]).reshape(-1)
        seq_cpu, slots = self._stage(reqs, num_rows, seq)
        return self._rows(reqs, num_rows, seq_cpu, slots, graph_size)

    def prepare_successor(self, prev: DecodeRows, prev_result: PendingResult) -> DecodeRows:
        """The next step of ``prev``'s requests, staged before the host has read ``prev``'s
        result: same rows and padding, fresh KV slots, and KV lengths that add ``prev``'s
        accept lengths on the device. (A request that finishes in ``prev`` still has rows here;
        the commit drops them.)"""
        k1, n = prev.rows_per_req, len(prev.reqs)
        real = n * k1
        # computed before the staged copy below overwrites b_seq_len
        seq_dev = (self.b_seq_len[:real].view(n, k1) + prev_result.accept_len.view(n, 1)).view(-1)
        bound = prev.b_seq_len_cpu[:real].numpy().astype(np.int64) + k1  # what any accept length keeps below
        seq_cpu, slots = self._stage(prev.reqs, prev.num_rows, bound)
        self.b_seq_len[:real].copy_(seq_dev)
        if self.exact_host_seq_len:
            seq_cpu = self.b_seq_len[:prev.num_rows].to("cpu", copy=True)
        return self._rows(prev.reqs, prev.num_rows, seq_cpu, slots, prev.graph_size)

    def _stage(self, reqs: List[InferReq], num_rows: int, seq: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        """Slots for the real rows, then one host->device copy of (req_idx, seq_len, slot) per row
        into the static buffers; returns the rows' seq lengths on the host (int32) and the slots.
        ``seq``: [real rows] int64. The host layout is written through numpy views of the pinned
        buffer (a few microseconds per op, a torch CPU op's ~10)."""
        k1 = self.mtp_step + 1
        n = len(reqs)
        real = n * k1
        slots = self.mem_manager.alloc(real)  # [real] host
        turn = self._stage_turn
        self._stage_turn = (turn + 1) % HOST_BUFFERS
        st = self._stage_nps[turn][:num_rows]
        if real:
            st[:real, STAGE_REQ_IDX] = np.repeat(np.fromiter((r.req_idx for r in reqs), dtype=np.int64, count=n), k1)
            st[:real, STAGE_SEQ_LEN] = seq
            st[:real, STAGE_SLOT] = slots.numpy()
        st[real:] = self._hold_stage_row
        seq_cpu = torch.from_numpy(st[:, STAGE_SEQ_LEN].astype(np.int32))  # a copy: the buffer is staged again later
        staged = self._staged[:num_rows]
        staged.copy_(self._stage_hosts[turn][:num_rows], non_blocking=True)
        self.b_req_idx[:num_rows].copy_(staged[:, STAGE_REQ_IDX])
        self.b_seq_len[:num_rows].copy_(staged[:, STAGE_SEQ_LEN])
        self.mem_indexes[:num_rows].copy_(staged[:, STAGE_SLOT])
        return seq_cpu, slots

    def _rows(self, reqs, num_rows: int, seq_cpu: torch.Tensor, slots: torch.Tensor,
              graph_size: Optional[int]) -> DecodeRows:
        return DecodeRows(
            reqs=reqs,
            mtp_step=self.mtp_step,
            b_req_idx=self.b_req_idx[:num_rows],
            b_mtp_index=self.b_mtp_index[:num_rows],
            b_seq_len=self.b_seq_len[:num_rows],
            b_seq_len_cpu=seq_cpu,
            mem_indexes=self.mem_indexes[:num_rows],
            mem_indexes_cpu=slots,
            b_req_mtp_start_loc=self.b_req_mtp_start_loc[:len(reqs)],
            graph_size=graph_size,
        )

    def snapshot(self, rows: DecodeRows) -> None:
        """Save what a step of ``rows`` changes per request (pending tokens and drafts, the ASD
        ledger, draft confidences), so that ``restore`` can undo it. Device-only."""
        self.snapshot_reqs(self._req_rows(rows))

    def snapshot_reqs(self, req: torch.Tensor) -> None:
        """``snapshot`` of the requests whose table rows are ``req`` [n] (int64, device), in the order of the rows of
        the step ``restore`` will undo (a mixed step's, before it is launched)."""
        n = req.numel()
        self._snap_next[:n] = self.req_to_next_token_ids[req]
        if self.params_manager.req_to_asd_cum_regret is not None:
            self._snap_regret[:n] = self.params_manager.req_to_asd_cum_regret[req]
        if self.conf_width:
            self._snap_conf[:n] = self.req_to_draft_conf[req]

    def restore(self, rows: DecodeRows) -> None:
        """Undo a step of ``rows`` (run after ``snapshot``): its KV slots are the caller's to free."""
        n, req = len(rows.reqs), self._req_rows(rows)
        self.req_to_next_token_ids[req] = self._snap_next[:n]
        if self.params_manager.req_to_asd_cum_regret is not None:
            self.params_manager.req_to_asd_cum_regret[req] = self._snap_regret[:n]
        if self.conf_width:
            self.req_to_draft_conf[req] = self._snap_conf[:n]

    @staticmethod
    def _req_rows(rows: DecodeRows) -> torch.Tensor:
        """[num_reqs] int64: each request's table row (its first decode row's)."""
        return rows.b_req_idx[:rows.num_real_rows:rows.rows_per_req].long()

    def model_input(self, rows: DecodeRows) -> ModelInput:
        """Device-only: point each row's position at its slot, gather its input token."""
        mi = self._model_input(rows.num_rows, int(rows.b_seq_len_cpu.max()) if rows.num_rows else 0)
        mi.b_seq_len_cpu = rows.b_seq_len_cpu
        return mi

    def _model_input(self, num_rows: int, max_len: int) -> ModelInput:
        b_req_idx = self.b_req_idx[:num_rows]
        b_seq_len = self.b_seq_len[:num_rows]
        b_mtp_index = self.b_mtp_index[:num_rows]
        mem_indexes = self.mem_indexes[:num_rows]
        req = b_req_idx.long()
        self.req_manager.req_to_token_indexs[req, b_seq_len.long() - 1] = mem_indexes
        input_ids = self.req_to_next_token_ids[req, b_mtp_index.long()]
        return ModelInput(
            batch_size=num_rows,
            total_token_num=0,  # unused by decode
            max_len_in_batch=max_len,  # the torch attention path only (never captured)
            input_ids=input_ids,
            mem_indexes=mem_indexes,
            b_req_idx=b_req_idx,
            b_seq_len=b_seq_len,
            is_prefill=False,
            b_mtp_index=b_mtp_index,
            max_q_len=self.mtp_step + 1,
            # K + 1 rows per request, then one run of padding rows
            max_q_runs=num_rows // (self.mtp_step + 1) + 1,
        )

    # ---- forward ----
    def forward(self, rows: DecodeRows) -> ModelOutput:
        if self.graphs is not None and ("target", rows.graph_size) in self.graphs:
            rows.model_input, out = self.graphs.replay(("target", rows.graph_size))
            return out
        rows.model_input = self.model_input(rows)
        return self.model.forward(rows.model_input)

    def _propose(self, rows: DecodeRows, out: ModelOutput) -> Proposal:
        if self.graphs is not None and ("draft", rows.graph_size) in self.graphs:
            return self.graphs.replay(("draft", rows.graph_size))
        return self._run_draft(rows.model_input, out, rows.num_rows)

    def _run_draft(self, model_input: ModelInput, out: ModelOutput, num_rows: int):
        return self.draft.propose(model_input, out, self.first_tokens[:num_rows], self._accept_len)

    def set_draft_confidence(self, req_idx: torch.Tensor, conf: Optional[torch.Tensor]) -> None:
        """Confidences [n, K] of the drafts just written for requests ``req_idx`` (prefill)."""
        if conf is not None and self.req_to_draft_conf is not None:
            self.req_to_draft_conf[req_idx.long()] = conf

    def _capture_graphs(self) -> None:
        """Target (and draft) graph per ladder size, captured over HOLD rows only."""
        self.graphs = CudaGraphSet(self.device)
        k1 = self.mtp_step + 1

        def capture_one(size: int) -> None:
            num_rows = size * k1
            self.prepare([], num_rows=num_rows)  # all HOLD rows
            mi, out = self.graphs.capture(
                ("target", size), lambda: (lambda m: (m, self.model.forward(m)))(self._model_input(num_rows, 1))
            )
            if self.draft is not None:
                self.graphs.capture(("draft", size), lambda: self._run_draft(mi, out, num_rows))

        capture_ladder(self.graphs, self.ladder.sizes, capture_one)

    # ---- after the forward ----
    def finish(
        self, rows: DecodeRows, out: ModelOutput, sampler: Sampler, seed_of: SeedFn,
        firsts: Optional["FirstTokens"] = None,
    ) -> HostStepResult:
        """sample -> verify -> pack + async host copy -> draft -> scatter -> wait for the copy."""
        return self.wait(self.launch_finish(rows, out, sampler, seed_of, firsts))

    def wait(self, pending: PendingResult) -> HostStepResult:
        """Wait for a launched step's packed result and unpack it."""
        if pending.done is not None:
            pending.done.synchronize()
        return HostStepResult.unpack(pending.host, pending.num_rows, pending.num_reqs, pending.asd, self.conf_width,
                                     pending.top_width)

    def launch_finish(
        self, rows: DecodeRows, out: ModelOutput, sampler: Sampler, seed_of: SeedFn,
        firsts: Optional["FirstTokens"] = None,
    ) -> PendingResult:
        """sample -> verify -> pack + async host copy -> draft -> scatter, all queued; no host wait.
        ``firsts``: prompts finishing in the same forward (a mixed step), sampled beside the rows;
        their tokens and log-probs follow the rows' in the packed result. When a request of the
        step asks for top log-probs, the top k_max of every sampled row join the same copy (a step
        where none asks runs no top-k)."""
        k1 = rows.rows_per_req
        real = rows.num_real_rows
        n = len(rows.reqs)
        m = 0 if firsts is None else len(firsts.reqs)
        b_req_idx = rows.b_req_idx[:real]
        row_reqs = [r for r in rows.reqs for _ in range(k1)]
        seeded = any(r.params.seed is not None for r in rows.reqs)
        seeds = [seed_of(r, j) for r in rows.reqs for j in range(k1)] if seeded else None
        if firsts is None:
            logits, sampled_req_idx = out.logits[:real], b_req_idx
        else:
            logits, sampled_req_idx = out.logits[firsts.logit_rows], torch.cat([b_req_idx, firsts.req_idx])
            row_reqs = row_reqs + firsts.reqs
            if seeded or any(r.params.seed is not None for r in firsts.reqs):
                seeds = (seeds or [seed_of(r, j) for r in rows.reqs for j in range(k1)]) + [seed_of(r, 0) for r in firsts.reqs]
        s = sampler(logits, sampled_req_idx, row_reqs, seeds, self._grammar_bitmask(rows, firsts, logits.shape[-1]))
        next_ids, first_ids = s.next_token_ids[:real], s.next_token_ids[real:]
        asd = self.asd
        verifying = self.mtp_step > 0 and n > 0
        target_ids = next_ids.clone() if verifying and self.verify_observer is not None else next_ids
        relaxed = self._relaxed_mask[:real] if asd is not None else None
        if verifying:
            accept_len, _ = verify_mtp_tokens(
                self.req_to_next_token_ids, rows.b_req_mtp_start_loc, next_ids, b_req_idx,
                s.processed_logits[:real], self.params_manager, asd, relaxed,
            )
        else:  # nothing verified (K = 0, or a DP rank with only padding)
            accept_len = torch.ones(n, dtype=torch.int32, device=next_ids.device)
        if verifying and self.verify_observer is not None:
            self.verify_observer(self._verify_record(rows, target_ids, next_ids, s.processed_logits[:real], accept_len))
        # Log-probs after verification: a relaxed row reports the token it commits.
        logprobs = token_logprobs(s.processed_logits, s.next_token_ids)
        # k_max from the requests' parameters on the host: 0 (nobody asks) adds no device work
        top_width = min(max(max_top_logprobs(rows.reqs), max_top_logprobs(firsts.reqs) if m else 0),
                        s.processed_logits.shape[-1])
        top = top_logprobs(s.processed_logits, top_width) if top_width else None
        with_asd = self.mtp_step > 0 and asd is not None
        req_rows = b_req_idx[::k1].long() if with_asd or self.conf_width else None  # [n]
        spent = self.params_manager.req_to_asd_cum_regret[req_rows] if with_asd else None
        conf = self.req_to_draft_conf[req_rows] if self.conf_width else None  # drafts verified now
        if with_asd and m:  # a first token is never relaxed
            relaxed = torch.cat([relaxed, torch.zeros(m, dtype=relaxed.dtype, device=relaxed.device)])
        packed = HostStepResult.pack(s.next_token_ids, logprobs, accept_len, relaxed if with_asd else None, spent, conf,
                                     top)
        turn = self._packed_turn
        self._packed_turn = (turn + 1) % HOST_BUFFERS
        host, done = self._packed_hosts[turn][:packed.shape[0]], self._copies_done[turn]
        host.copy_(packed, non_blocking=True)
        if done is not None:
            done.record()
        # The GPU drafts while the host waits for the copy and commits.
        if self.mtp_step > 0 and firsts is not None:
            proposal = firsts.propose(next_ids, first_ids, accept_len)
            guesses = proposal.guesses  # [real + m, K]
            if self.conf_width:
                self.req_to_draft_conf[req_rows] = proposal.confidence[:n]
                self.req_to_draft_conf[firsts.req_idx.long()] = proposal.confidence[n:]
            all_next = torch.cat([next_ids[:, None], guesses[:real]], dim=1)
            scatter = mtp_scatter_next_token_ids if next_ids.is_cuda else mtp_scatter_next_token_ids_torch
            scatter(self.req_to_next_token_ids, rows.b_req_mtp_start_loc, all_next, b_req_idx, accept_len)
            first_rows = firsts.req_idx.long()
            self.req_to_next_token_ids[first_rows, 0] = first_ids
            self.req_to_next_token_ids[first_rows, 1:self.mtp_step + 1] = guesses[real:]
        elif self.mtp_step > 0:
            self.first_tokens[:real].copy_(next_ids)
            self.first_tokens[real:rows.num_rows].fill_(PAD_TOKEN_ID)
            if self.draft.uses_accept_len:
                self._accept_len[:n].copy_(accept_len)
                self._accept_len[n:].fill_(1)
            proposal = self._propose(rows, out)
            all_next, new_conf = proposal.all_next, proposal.confidence
            if self.conf_width:
                self.req_to_draft_conf[req_rows] = new_conf[:n]
            scatter = mtp_scatter_next_token_ids if next_ids.is_cuda else mtp_scatter_next_token_ids_torch
            scatter(self.req_to_next_token_ids, rows.b_req_mtp_start_loc, all_next[:real], b_req_idx, accept_len)
        else:
            self.req_to_next_token_ids[b_req_idx.long(), 0] = next_ids
            if m:
                self.req_to_next_token_ids[firsts.req_idx.long(), 0] = first_ids
        return PendingResult(host, done, real + m, n, with_asd, accept_len, top_width)

    def _grammar_bitmask(self, rows: DecodeRows, firsts: Optional["FirstTokens"], vocab_size: int):
        """[real rows + m, W] int32 host masks of a step holding a request with a grammar (verify row j
        after its drafts 1..j, grammar.py), else None: other steps pay nothing. With MTP, one small
        copy of the drafts to the host (such a step runs synchronously: the backend never overlaps it)."""
        first_reqs = firsts.reqs if firsts is not None else []
        if all(r.grammar is None for r in rows.reqs) and all(r.grammar is None for r in first_reqs):
            return None
        n, k = len(rows.reqs), self.mtp_step
        drafts: List[List[int]] = [[] for _ in range(n)]
        if k and n:
            req_rows = rows.b_req_idx[:rows.num_real_rows:rows.rows_per_req].long()  # [n]
            drafts = self.req_to_next_token_ids[req_rows, 1:k + 1].tolist()  # [n, K]
        return rows_bitmask([r.grammar for r in rows.reqs] + [r.grammar for r in first_reqs],
                            drafts + [[] for _ in first_reqs], vocab_size)

    def _verify_record(self, rows, target_ids, next_ids, logits, accept_len) -> VerifyStepRecord:
        k, real = rows.mtp_step, rows.num_real_rows
        b_req_idx, b_mtp_index = rows.b_req_idx[:real], rows.b_mtp_index[:real]
        col = torch.clamp(b_mtp_index.long() + 1, max=k)  # bonus row: any column, masked below
        drafts = self.req_to_next_token_ids[b_req_idx.long(), col]
        drafts = torch.where(b_mtp_index == k, torch.full_like(drafts, NO_DRAFT_TOKEN_ID), drafts)
        return VerifyStepRecord(k, b_req_idx.clone(), drafts, target_ids, next_ids.clone(), logits, accept_len.clone())
