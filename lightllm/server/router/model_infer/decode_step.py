"""The decode step's one owner: static buffers, CUDA graphs, verifier, drafter, one host copy.

    prepare (host): slots, one staging tensor -> one copy to static device buffers
    forward: KV slot table + input ids gathered on device, target over n*(K+1) rows
             (graph T_n replay, or the same body eagerly)
    finish:  sample -> verify (strict | ASD) -> pack -> async copy to the host
             -> drafts (graph D_n) -> scatter -> wait for the copy
    commit_step (host, pure bookkeeping over the packed result): append tokens, stop checks,
             rejected slots to free

Padding rows (HOLD rows) sit after the real rows: the forwards and the draft run over
them; sampling, verification and commit never see them. On CUDA a batch of n requests is
padded to the graph ladder's size (``GraphLadder.bucket_size``) whether graphs are on or
not, so eager and graph decoding run the same kernels on the same shapes.
"""
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import CudaGraphSet, GraphLadder, capture_ladder
from lightllm.common.basemodel.mtp_verify_torch import mtp_scatter_next_token_ids_torch
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID, mtp_scatter_next_token_ids
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mode_backend.generic_post_process import SampleOutput, token_logprobs
from lightllm.server.router.model_infer.mtp_speculative.utils import AsdConfig, VerifyStepRecord, verify_mtp_tokens

logger = logging.getLogger(__name__)

# Input token of a padding row (any valid id: its outputs are never read).
PAD_TOKEN_ID = 0
# Columns of the host staging tensor: one row per decode row.
STAGE_REQ_IDX, STAGE_SEQ_LEN, STAGE_SLOT, STAGE_COLUMNS = 0, 1, 2, 3

# sample(logits [rows, vocab], b_req_idx [rows], reqs per row, seeds per row) -> SampleOutput
Sampler = Callable[[torch.Tensor, torch.Tensor, List[InferReq], list], SampleOutput]
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

    @staticmethod
    def pack(ids, logprobs, accept_len, relaxed=None, spent=None, confidence=None) -> torch.Tensor:
        """One float64 tensor (exact for token ids, fp32 values and flags)."""
        parts = [ids, logprobs, accept_len] + ([relaxed, spent] if relaxed is not None else [])
        parts += [confidence] if confidence is not None else []
        return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_rows: int, num_reqs: int, asd: bool,
               conf_width: int = 0) -> "HostStepResult":
        """``conf_width``: K when the draft reports confidences, else 0."""
        v = packed.tolist()
        ids = [int(x) for x in v[:num_rows]]
        lps = v[num_rows:2 * num_rows]
        end = 2 * num_rows + num_reqs
        out = cls(ids, lps, [int(x) for x in v[2 * num_rows:end]])
        if asd:
            out.relaxed = [x != 0.0 for x in v[end:end + num_rows]]
            out.spent = v[end + num_rows:end + num_rows + num_reqs]
            end += num_rows + num_reqs
        if conf_width:
            out.confidence = [v[end + r * conf_width:end + (r + 1) * conf_width] for r in range(num_reqs)]
        return out

    @staticmethod
    def packed_size(num_rows: int, num_reqs: int, asd: bool, conf_width: int = 0) -> int:
        return 2 * num_rows + num_reqs + ((num_rows + num_reqs) if asd else 0) + num_reqs * conf_width


@dataclass
class ReqCommit:
    """What one request kept in a step."""

    tokens: List[int]
    logprobs: List[float]
    draft_confidence: Optional[List[float]] = None  # [K] confidences of the drafts verified this step


def commit_step(
    reqs: List[InferReq], host: HostStepResult, slots: List[int], rows_per_req: int
) -> Tuple[List[ReqCommit], List[int]]:
    """Host bookkeeping of one decode step (no device work): append each request's accepted
    tokens until it finishes (EOS / stop / length), count MTP and ASD totals, extend its KV
    slots. Returns what each request kept and the slots of the rows it did not keep."""
    k1 = rows_per_req
    commits, free_slots = [], []
    for r, req in enumerate(reqs):
        start, a = r * k1, host.accept_len[r]
        kept = 0
        for j in range(a):
            kept += 1
            if req.append_token(host.ids[start + j], host.logprobs[start + j]):
                break
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
        commits.append(ReqCommit(host.ids[start:start + kept], host.logprobs[start:start + kept], conf))
    return commits, free_slots


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
        # Host staging (pinned on CUDA) -> one copy per step into _staged.
        self._stage_host = torch.zeros((self.max_rows, STAGE_COLUMNS), dtype=torch.int64, pin_memory=on_gpu)
        self._staged = torch.zeros((self.max_rows, STAGE_COLUMNS), dtype=torch.int64, device=dev)
        self.b_req_idx = torch.full((self.max_rows,), self.req_manager.HOLD_REQUEST_ID, dtype=torch.int32, device=dev)
        self.b_seq_len = torch.ones((self.max_rows,), dtype=torch.int32, device=dev)
        self.mem_indexes = torch.full((self.max_rows,), self.mem_manager.HOLD_SLOT, dtype=torch.int64, device=dev)
        self.b_mtp_index = torch.arange(k1, dtype=torch.int32, device=dev).repeat(max_reqs)
        self.b_req_mtp_start_loc = torch.arange(0, self.max_rows, k1, dtype=torch.int32, device=dev)
        self._mtp_offsets_host = torch.arange(k1, dtype=torch.int64)
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
        max_packed = HostStepResult.packed_size(self.max_rows, max_reqs, asd is not None, self.conf_width)
        self._packed_host = torch.zeros((max_packed,), dtype=torch.float64, pin_memory=on_gpu)
        self._copy_done = torch.cuda.Event() if on_gpu else None
        self.graphs: Optional[CudaGraphSet] = None
        if use_graphs:
            self._capture_graphs()

    # ---- rows ----
    def prepare(self, reqs: List[InferReq], num_rows: Optional[int] = None) -> DecodeRows:
        """Allocate K+1 KV slots per request and stage the rows; pad with HOLD rows to
        ``num_rows`` rows (DP: the same rows on every rank) or, on CUDA, to the ladder's size."""
        k1 = self.mtp_step + 1
        n = len(reqs)
        real = n * k1
        graph_size = None
        if num_rows is None:
            graph_size = self.ladder.bucket_size(n) if self.ladder is not None else None
            num_rows = graph_size * k1 if graph_size is not None else real
        if num_rows < real:
            raise ValueError(f"{n} requests need {real} rows, more than num_rows={num_rows}")
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} decode rows exceed the step's {self.max_rows} static rows")
        slots = self.mem_manager.alloc(real)  # [real] host
        st = self._stage_host[:num_rows]
        if real:
            req_idx = torch.tensor([r.req_idx for r in reqs], dtype=torch.int64)
            kv_len = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
            st[:real, STAGE_REQ_IDX].view(n, k1).copy_(req_idx[:, None].expand(n, k1))
            # the row of position kv_len + j caches kv_len + j + 1 tokens after the forward
            st[:real, STAGE_SEQ_LEN].view(n, k1).copy_(kv_len[:, None] + self._mtp_offsets_host[None, :] + 1)
            st[:real, STAGE_SLOT] = slots
        st[real:, STAGE_REQ_IDX] = self.req_manager.HOLD_REQUEST_ID
        st[real:, STAGE_SEQ_LEN] = 1
        st[real:, STAGE_SLOT] = self.mem_manager.HOLD_SLOT
        seq_cpu = st[:, STAGE_SEQ_LEN].to(torch.int32)
        staged = self._staged[:num_rows]
        staged.copy_(st, non_blocking=True)
        self.b_req_idx[:num_rows].copy_(staged[:, STAGE_REQ_IDX])
        self.b_seq_len[:num_rows].copy_(staged[:, STAGE_SEQ_LEN])
        self.mem_indexes[:num_rows].copy_(staged[:, STAGE_SLOT])
        return DecodeRows(
            reqs=reqs,
            mtp_step=self.mtp_step,
            b_req_idx=self.b_req_idx[:num_rows],
            b_mtp_index=self.b_mtp_index[:num_rows],
            b_seq_len=self.b_seq_len[:num_rows],
            b_seq_len_cpu=seq_cpu,
            mem_indexes=self.mem_indexes[:num_rows],
            mem_indexes_cpu=slots,
            b_req_mtp_start_loc=self.b_req_mtp_start_loc[:n],
            graph_size=graph_size,
        )

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
        )

    # ---- forward ----
    def forward(self, rows: DecodeRows) -> ModelOutput:
        if self.graphs is not None and ("target", rows.graph_size) in self.graphs:
            rows.model_input, out = self.graphs.replay(("target", rows.graph_size))
            return out
        rows.model_input = self.model_input(rows)
        return self.model.forward(rows.model_input)

    def _propose(self, rows: DecodeRows, out: ModelOutput) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
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
        self, rows: DecodeRows, out: ModelOutput, sampler: Sampler, seed_of: SeedFn
    ) -> HostStepResult:
        """sample -> verify -> pack + async host copy -> draft -> scatter -> wait for the copy."""
        k1 = rows.rows_per_req
        real = rows.num_real_rows
        n = len(rows.reqs)
        b_req_idx = rows.b_req_idx[:real]
        row_reqs = [r for r in rows.reqs for _ in range(k1)]
        seeded = any(r.params.seed is not None for r in rows.reqs)
        seeds = [seed_of(r, j) for r in rows.reqs for j in range(k1)] if seeded else None
        s = sampler(out.logits[:real], b_req_idx, row_reqs, seeds)
        next_ids = s.next_token_ids
        asd = self.asd
        verifying = self.mtp_step > 0 and n > 0
        target_ids = next_ids.clone() if verifying and self.verify_observer is not None else next_ids
        relaxed = self._relaxed_mask[:real] if asd is not None else None
        if verifying:
            accept_len, _ = verify_mtp_tokens(
                self.req_to_next_token_ids, rows.b_req_mtp_start_loc, next_ids, b_req_idx,
                s.processed_logits, self.params_manager, asd, relaxed,
            )
        else:  # nothing verified (K = 0, or a DP rank with only padding)
            accept_len = torch.ones(n, dtype=torch.int32, device=next_ids.device)
        if verifying and self.verify_observer is not None:
            self.verify_observer(self._verify_record(rows, target_ids, next_ids, s.processed_logits, accept_len))
        # Log-probs after verification: a relaxed row reports the token it commits.
        logprobs = token_logprobs(s.processed_logits, next_ids)
        with_asd = self.mtp_step > 0 and asd is not None
        req_rows = b_req_idx[::k1].long() if with_asd or self.conf_width else None  # [n]
        spent = self.params_manager.req_to_asd_cum_regret[req_rows] if with_asd else None
        conf = self.req_to_draft_conf[req_rows] if self.conf_width else None  # drafts verified now
        packed = HostStepResult.pack(next_ids, logprobs, accept_len, relaxed if with_asd else None, spent, conf)
        host = self._packed_host[:packed.shape[0]]
        host.copy_(packed, non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        # The GPU drafts while the host waits for the copy and commits.
        if self.mtp_step > 0:
            self.first_tokens[:real].copy_(next_ids)
            self.first_tokens[real:rows.num_rows].fill_(PAD_TOKEN_ID)
            if self.draft.uses_accept_len:
                self._accept_len[:n].copy_(accept_len)
                self._accept_len[n:].fill_(1)
            all_next, new_conf = self._propose(rows, out)
            if self.conf_width:
                self.req_to_draft_conf[req_rows] = new_conf[:n]
            scatter = mtp_scatter_next_token_ids if next_ids.is_cuda else mtp_scatter_next_token_ids_torch
            scatter(self.req_to_next_token_ids, rows.b_req_mtp_start_loc, all_next[:real], b_req_idx, accept_len)
        else:
            self.req_to_next_token_ids[b_req_idx.long(), 0] = next_ids
        if self._copy_done is not None:
            self._copy_done.synchronize()
        return HostStepResult.unpack(host, real, n, with_asd, self.conf_width)

    def _verify_record(self, rows, target_ids, next_ids, logits, accept_len) -> VerifyStepRecord:
        k, real = rows.mtp_step, rows.num_real_rows
        b_req_idx, b_mtp_index = rows.b_req_idx[:real], rows.b_mtp_index[:real]
        col = torch.clamp(b_mtp_index.long() + 1, max=k)  # bonus row: any column, masked below
        drafts = self.req_to_next_token_ids[b_req_idx.long(), col]
        drafts = torch.where(b_mtp_index == k, torch.full_like(drafts, NO_DRAFT_TOKEN_ID), drafts)
        return VerifyStepRecord(k, b_req_idx.clone(), drafts, target_ids, next_ids.clone(), logits, accept_len.clone())
