"""Model worker backend: owns the model, the req_idx tables and the KV pool.

One shared decode flow (``verify_draft_commit``) serves every decode call site;
the modes only differ in how rows are laid out and run.
"""
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID
from lightllm.common.constants import MTP_TABLE_WIDTH
from lightllm.common.req_manager import ReqSamplingParamsManager
from lightllm.models.registry import load_model
from lightllm.server.core.objs.messages import ReqStepUpdate  # noqa: F401 (its home; re-exported here)
from lightllm.server.core.objs.sampling_params import TOP_K_GREEDY
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.model_infer.decode_step import (
    PAD_TOKEN_ID, DecodeRows, DecodeStep, FirstTokens, HostStepResult, PendingResult, commit_step,
)
from lightllm.server.router.model_infer.grammar import GrammarCompiler, rows_bitmask
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mode_backend.generic_post_process import (
    SampleOutput, max_top_logprobs, sample, token_logprobs, top_logprobs,
)
from lightllm.server.router.model_infer.mtp_speculative.proposer import DraftKvNeeds, MixedAnchors, MixedProposal
from lightllm.server.router.model_infer.prompt_cache import make_prompt_cache, own_slots
from lightllm.server.router.model_infer.step_rows import RowItem, RowsBatch, StepRows, max_sampled_rows, step_ladder
from lightllm.utils.dist_utils import ParallelContext, single_rank_context
from lightllm.utils.host_copy import to_device
from lightllm.utils.model_len import max_model_len

logger = logging.getLogger(__name__)

# torch.Generator.manual_seed takes [-2**63, 2**64): a request's per-position seed is taken
# modulo 2**64, which keeps every seed that fits unchanged (negative ones draw the same).
SEED_MODULUS = 2**64


@dataclass
class StepResult:
    """What one ``run_step`` call did: its updates, and what the router's step clock files."""

    updates: List[ReqStepUpdate]
    prefilled: bool = False  # its forward prefilled prompt chunks (a prefill or a mixed step)
    decode_reqs: int = 0  # requests whose decode rows it ran (or, with overlap, committed)
    steps: int = 1  # forwards it launched (0: it only committed one an earlier call launched)
    # a decode step of this many requests it also launched after committing a mixed step (the step the plain
    # schedule's next call launches; the router counts it as that call would)
    launched_decode_reqs: int = 0


@dataclass
class MixedStep:
    """A mixed step from its staging to its commit (``ModeBackend.stage_mixed`` / ``launch_mixed`` /
    ``commit_mixed``)."""

    rows_owner: StepRows
    decoding: List[InferReq]  # requests whose decode rows come first
    reqs: List[InferReq]  # prompts with a chunk in the step, in order
    chunk_lens: List[int]
    slots: torch.Tensor  # [rows] int64 host: the decode rows', then the chunks'
    batch: RowsBatch
    done_items: List[int]  # the items whose prompt the step finishes
    rows: Optional[DecodeRows] = None  # set at launch
    done: Optional[List[InferReq]] = None  # set at launch: the prompts the step finishes
    pending: Optional[PendingResult] = None  # set at launch


# Decode steps a request's KV table must hold room for past its committed tokens: the step
# being committed and one overlapped step launched before it (docs/decode_step.md).
OVERLAP_STEPS_AHEAD = 2
CPU_DEFAULT_KV_TOKENS = 16384  # CPU default KV pool when --max_total_token_num is unset
GPU_KV_MEMORY_FRACTION = 0.5  # share of free GPU memory the default KV pool may take


def resolve_max_total_token_num(args: StartArgs, device: str, dtype: str, mtp_step: int, attn_tp_size: int = 1,
                                draft_kv_layers: Optional[int] = None) -> int:
    """--max_total_token_num, or a default: enough for every request at full length,
    bounded by free memory (CUDA) or a fixed size (CPU), never below one full request."""
    if args.max_total_token_num is not None:
        return args.max_total_token_num
    per_req = max_model_len(args.max_req_total_len, args.resolved_model_dir) + mtp_step
    wanted = args.running_max_req_size * per_req
    if torch.device(device).type == "cuda":  # "cuda" or a rank's "cuda:<i>"
        from transformers import AutoConfig

        from lightllm.common.basemodel.basemodel import TORCH_DTYPES, TransformerArch

        arch = TransformerArch.from_hf_config(AutoConfig.from_pretrained(args.resolved_model_dir))
        elem = TORCH_DTYPES[dtype].itemsize
        # target layers plus the draft's KV buffers (one per MTP depth unless the draft says)
        draft_layers = mtp_step if draft_kv_layers is None else draft_kv_layers
        per_token = (arch.num_layers + draft_layers) * 2 * (arch.kv_heads // attn_tp_size) * arch.head_dim * elem
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        limit = int(GPU_KV_MEMORY_FRACTION * free / per_token)
    else:
        limit = CPU_DEFAULT_KV_TOKENS
    return max(min(wanted, limit), per_req)


class ModeBackend:
    def __init__(self, args: StartArgs, device: str, dtype: str, parallel: Optional[ParallelContext] = None):
        self.args = args
        self.device = device
        # This rank's place among tensor / data parallel ranks (docs/parallel.md).
        self.parallel = parallel if parallel is not None else single_rank_context(device)
        self.mtp_step = args.mtp_step if args.mtp_mode else 0
        self.max_model_len = max_model_len(args.max_req_total_len, args.resolved_model_dir)  # the request tables' width
        needs = draft_cache_needs(args)
        draft_kv_layers, extra_positions = needs.kv_layers, needs.extra_positions
        kvargs = ModelKvArgs(
            model_dir=args.resolved_model_dir,
            # every rank schedules with the same pool size (each sized its own from free memory)
            max_total_token_num=self.parallel.min_over_ranks(
                resolve_max_total_token_num(args, device, dtype, self.mtp_step, self.parallel.attn_tp_size,
                                            draft_kv_layers)
            ),
            max_req_num=args.running_max_req_size,
            # one decode step past the longest request, and one more for a step launched before the
            # previous one's tokens are known (overlap)
            max_seq_length=self.max_model_len + OVERLAP_STEPS_AHEAD * (self.mtp_step + 1) + extra_positions,
            data_type=dtype,
            device=device,
            load_format=args.load_format,
            deterministic_inference=args.enable_deterministic_inference,
        )
        self.model = load_model(kvargs, self.parallel)
        self.req_manager = self.model.req_manager
        self.mem_manager = self.model.mem_manager
        self.vocab_size = self.model.vocab_size
        # JSON output: compiled on the first request that asks (docs/structured_output.md)
        self.grammars = GrammarCompiler(args.resolved_model_dir, self.vocab_size)
        self.params_manager = ReqSamplingParamsManager(
            args.running_max_req_size, self.vocab_size, device, asd_enabled=args.asd_enabled
        )
        # [max_req + 1, MTP_TABLE_WIDTH] column 0: pending token, 1..K: drafts
        self.req_to_next_token_ids = torch.full(
            (args.running_max_req_size + 1, MTP_TABLE_WIDTH), NO_DRAFT_TOKEN_ID, dtype=torch.int64, device=device
        )
        self.draft = None  # MTP draft proposer
        # DP micro-batches may pad one request more than the running maximum (the ladder never does)
        max_step_reqs = args.running_max_req_size + 1
        if self.mtp_step:
            from lightllm.server.router.model_infer.mtp_speculative.draft import make_draft_proposer

            self.draft = make_draft_proposer(args.mtp_mode, args.mtp_draft_model_dir, self.mtp_step, self.model,
                                             max_step_reqs)
        # padding rows gather their input token from the HOLD row
        self.req_to_next_token_ids[self.req_manager.HOLD_REQUEST_ID] = PAD_TOKEN_ID
        # the KV of prompts seen before (None: off); the router's admission queue matches with it
        self.prompt_cache = make_prompt_cache(args, self.mem_manager, self.parallel.dp_size, self.draft)
        self.asd_config = None
        if args.asd_enabled:
            from lightllm.server.router.model_infer.mtp_speculative.utils import AsdConfig

            g = args.mtp_asd_local_regret_ratio
            m = args.mtp_asd_block_max_mismatch
            self.asd_config = AsdConfig(
                local_regret_ratio=math.inf if g is None else g,
                block_max_mismatch=self.mtp_step if m is None else m,
            )
        ladder, use_graphs = decode_graph_plan(args, torch.device(device), self.parallel)
        self.decode_step = DecodeStep(
            self.model, self.req_to_next_token_ids, self.params_manager, self.draft, self.mtp_step,
            self.asd_config, max_reqs=max_step_reqs, ladder=ladder, use_graphs=use_graphs,
        )
        self.step_rows = None  # short prefills (and mixed steps) as graph rows (step_rows.py)
        rows_draft = self.draft if self.draft is not None and self.draft.drafts_prefill_rows else None
        self.rows_draft = rows_draft
        # a draft that drafts rows steps as blocks (dspark): its context from the rows, blocks padded to the ladder
        block_draft = self.draft if self.draft is not None and rows_draft is None else None
        self.rows_context = block_draft.write_context if block_draft is not None else None
        if block_draft is not None and ladder is not None:
            block_draft.use_block_ladder(ladder, use_graphs)
        # step rows: one DP group (DP groups prefill their own chunk plans, padded to equal tokens, eagerly)
        if (ladder is not None and graph_capable(args, self.parallel) and self.parallel.dp_size == 1
                and args.graph_max_prefill_tokens):
            max_rows = args.graph_max_prefill_tokens
            if self.mixed_steps_enabled():
                max_rows += args.running_max_req_size * (self.mtp_step + 1)
            self.step_rows = StepRows(self.model, self.req_to_next_token_ids,
                                      step_ladder(args.graph_max_prefill_tokens, max_rows), use_graphs, rows_draft,
                                      max_logit_rows=max_sampled_rows(args.running_max_req_size, self.mtp_step),
                                      context=self.rows_context,
                                      decode_runs=((self.mtp_step + 1, args.running_max_req_size)
                                                   if self.mixed_steps_enabled() else None))

    def mixed_steps_enabled(self) -> bool:
        """Whether a step may hold decode rows and prefill chunks together (the chunked-prefill backend)."""
        return False

    def captured_graphs(self) -> int:
        """CUDA graphs captured at start-up: the decode ladder's and the step rows' (0: eager)."""
        owners = (self.decode_step, self.step_rows)
        return sum(len(o.graphs) for o in owners if o is not None and o.graphs is not None)

    @property
    def verify_observer(self):
        """Optional callable(VerifyStepRecord) after each verify step (calibration, analysis)."""
        return self.decode_step.verify_observer

    @verify_observer.setter
    def verify_observer(self, fn) -> None:
        self.decode_step.verify_observer = fn

    # ---- request lifecycle ----
    def add_reqs(self, reqs: List[InferReq]) -> List[Tuple[InferReq, Exception]]:
        """Give ``reqs`` (admitted together) their table rows; returns the requests it could not store, with
        why (each holds no row then, or one ``free_reqs`` gives back). The rows' values go in one batch."""
        refused, taken = [], []
        for req in reqs:
            try:
                fmt = req.params.response_format
                if fmt is not None:  # before any table row is taken: a failure leaves nothing to free
                    req.grammar = self.grammars.matcher(fmt, req.eos_token_ids)
                self.params_manager.check_req(req)
                req.req_idx = self.req_manager.alloc()
            except Exception as e:
                refused.append((req, e))
                continue
            taken.append(req)
        try:
            self.params_manager.init_reqs_sampling_params(taken, self.req_to_next_token_ids)
            self._point_at_prefixes([r for r in taken if r.prompt_cached_len])
        except Exception as e:  # nothing of theirs is valid then: all of them fail
            return refused + [(req, e) for req in taken]
        return refused

    def _point_at_prefixes(self, reqs: List[InferReq]) -> None:
        """Each request's first ``prompt_cached_len`` positions at its cached prefix's slots (matched at
        admission; prefill starts after them), in one copy and one scatter."""
        if not reqs:
            return
        lens = [r.prompt_cached_len for r in reqs]
        where = np.empty((3, sum(lens)), dtype=np.int64)  # req_idx, position, slot of each cached position
        where[0] = np.repeat([r.req_idx for r in reqs], lens)
        where[1] = np.concatenate([np.arange(n) for n in lens])
        where[2] = torch.cat([r.prefix.slots for r in reqs]).numpy()
        idx, pos, slots = to_device(where.reshape(-1), self.device).view(where.shape)
        self.req_manager.req_to_token_indexs[idx, pos] = slots
        for req in reqs:
            req.kv_len = req.prompt_cached_len

    def cache_prompt(self, req: InferReq) -> int:
        """``req``'s prefill is done: its prompt goes into the prompt cache; returns the slots it took."""
        return self.prompt_cache.cache_prompt(req) if self.prompt_cache is not None else 0

    def free_reqs(self, reqs: List[InferReq]) -> None:
        """Give back the rows and slots of ``reqs`` (done: finished, aborted or refused); with the prompt cache
        their tokens are cached first. The slots go back to the pool in one free."""
        slots = []
        for req in reqs:
            if self.prompt_cache is not None:
                slots.append(self.prompt_cache.take_back(req))
            elif req.slots:
                slots.append(own_slots(req))
                req.slots = []
            if req.req_idx >= 0:
                self.req_manager.free(req.req_idx)
                req.req_idx = -1
        if slots:
            self.mem_manager.free(torch.cat(slots))

    def reset_pools(self) -> None:
        """Every KV slot and req_idx row back (after a failed step: no request holds any)."""
        self.mem_manager.free_all()
        self.req_manager.free_all()
        if self.prompt_cache is not None:
            self.prompt_cache.reset()

    def _to_dev(self, values, dtype) -> torch.Tensor:
        return to_device(values, self.device, dtype)

    # ---- sampling ----
    def sample_rows(
        self,
        logits: torch.Tensor,  # [rows, vocab] fp32
        b_req_idx: torch.Tensor,  # [rows] int32
        reqs: List[InferReq],  # [rows] the request of each row
        seeds,  # [rows] per-row seed or None
        token_bitmask: Optional[torch.Tensor] = None,  # [rows, W] int32 host: grammar rows' allowed tokens
    ) -> SampleOutput:
        """``sample()`` of the rows; every rank of a DP group gets the same tokens.

        The logits are the same on those ranks (gathered), so greedy rows agree by
        construction; random draws need not, so rank 0 of the group broadcasts its tokens."""
        s = sample(logits, b_req_idx, self.params_manager, reqs, seeds, token_bitmask)
        if any(r.params.top_k != TOP_K_GREEDY for r in reqs):
            self.parallel.broadcast_in_dp_group(s.next_token_ids)
        return s

    # ---- prefill ----
    def prefill(self, reqs: List[InferReq], chunk_lens: List[int], pad_tokens: int = 0) -> List[ReqStepUpdate]:
        """Prefill the next ``chunk_lens[i]`` prompt tokens of each request.

        ``pad_tokens``: padding tokens after them (DP: every rank runs the same number of
        tokens), as HOLD items: HOLD row, HOLD_SLOT, never sampled."""
        input_ids, slots_all, b_seq, b_ready, b_req_idx = [], [], [], [], []
        for req, n in zip(reqs, chunk_lens):
            slots = self.mem_manager.alloc(n)
            pos = torch.arange(req.kv_len, req.kv_len + n, device=self.device)
            self.req_manager.req_to_token_indexs[req.req_idx, pos] = self._to_dev(slots, torch.int64)
            req.slots.extend(slots.tolist())
            input_ids.extend(req.prompt_ids[req.kv_len:req.kv_len + n])
            slots_all.append(slots)
            b_ready.append(req.kv_len)
            b_seq.append(req.kv_len + n)
            b_req_idx.append(req.req_idx)
        # One HOLD item per at most max_model_len tokens (its attention reads the HOLD row).
        while pad_tokens > 0:
            n = min(pad_tokens, self.max_model_len)
            input_ids.extend([PAD_TOKEN_ID] * n)
            slots_all.append(torch.full((n,), self.mem_manager.HOLD_SLOT, dtype=torch.int64))
            b_ready.append(0)
            b_seq.append(n)
            b_req_idx.append(self.req_manager.HOLD_REQUEST_ID)
            pad_tokens -= n
        b_seq_cpu = torch.tensor(b_seq, dtype=torch.int32)
        b_ready_cpu = torch.tensor(b_ready, dtype=torch.int32)
        slots_cpu = torch.cat(slots_all)
        size = None
        if self.step_rows is not None and not pad_tokens and len(input_ids) <= self.args.graph_max_prefill_tokens:
            size = self.step_rows.bucket_size(len(input_ids))
        rows_draft = size is not None and self.step_rows.draft is not None
        rows_blocks = size is not None and self.step_rows.context is not None  # dspark over the rows
        model_input = None  # the prefill forward's input: without rows, or for a draft that drafts prefills itself
        if size is None or (self.draft is not None and not rows_draft and not rows_blocks):
            model_input = ModelInput(
                batch_size=len(b_req_idx),
                total_token_num=int(b_seq_cpu.sum()),
                max_len_in_batch=int(b_seq_cpu.max()),
                input_ids=self._to_dev(input_ids, torch.int64),
                mem_indexes=self._to_dev(slots_cpu, torch.int64),
                b_req_idx=self._to_dev(b_req_idx, torch.int32),
                b_seq_len=self._to_dev(b_seq_cpu, torch.int32),
                is_prefill=True,
                b_ready_cache_len=self._to_dev(b_ready_cpu, torch.int32),
                b_seq_len_cpu=b_seq_cpu,
                b_ready_cache_len_cpu=b_ready_cpu,
            )
        if size is not None:
            items = [RowItem(r.req_idx, r.kv_len, n, r.prompt_ids) for r, n in zip(reqs, chunk_lens)]
            rows = self.step_rows.stage(items, slots_cpu, size)
            out = self.step_rows.forward(rows)
        else:
            out = self.model.forward(model_input)
        for req, n in zip(reqs, chunk_lens):
            req.kv_len += n
        done = [i for i, r in enumerate(reqs) if not r.in_prefill]
        updates, first_tokens = self._first_tokens([reqs[i] for i in done], out, done) if done else ([], {})
        if self.draft is None:
            return updates
        if rows_draft:
            drafts = self.step_rows.propose(rows, first_tokens)
            if drafts is not None:
                self._write_prefill_drafts(self._to_dev([reqs[i].req_idx for i in sorted(first_tokens)], torch.int64),
                                           drafts, None)
        elif rows_blocks:
            self.step_rows.write_context(rows, rows.model_input, rows.output)
            if first_tokens:  # no decode rows: the blocks of the finished prompts only
                done = sorted(first_tokens)
                none = torch.zeros(0, dtype=torch.int64, device=self.device)
                done_reqs = [reqs[i] for i in done]
                first_ids = self._to_dev([first_tokens[i] for i in done], torch.int64)
                req_idx = self._to_dev([r.req_idx for r in done_reqs], torch.int64)
                anchors = MixedAnchors(verified=none, accept_len=none, row0_seq_len=none, req_idx=none,
                                       **self._first_anchors([r.kv_len for r in done_reqs], req_idx, first_ids))
                proposed = self.draft.propose_mixed(anchors, rows.model_input.max_len_in_batch)
                self._write_prefill_drafts(anchors.first_req_idx, proposed.guesses, proposed.confidence)
        else:
            proposed = self.draft.propose_after_prefill(reqs, model_input, out, b_ready, first_tokens)
            if proposed is not None:
                self._write_prefill_drafts(proposed.req_idx, proposed.drafts, proposed.confidence)
        return updates

    def _first_anchors(self, first_pos: List[int], req_idx: torch.Tensor, first_ids: torch.Tensor) -> dict:
        """MixedAnchors' fields of prompts just finished: their rows (``req_idx``, on the device), lengths
        (``first_pos``: each prompt's length, its first token's position) and first tokens."""
        return dict(first_req_idx=req_idx, first_pos=self._to_dev(first_pos, torch.int64), first_ids=first_ids)

    def _write_prefill_drafts(self, req_idx: torch.Tensor, drafts: torch.Tensor, conf: Optional[torch.Tensor]) -> None:
        """The K proposals [done, K] (and their confidences) after each finished prompt's first token."""
        self.req_to_next_token_ids[req_idx, 1:self.mtp_step + 1] = drafts
        self.decode_step.set_draft_confidence(req_idx, conf)

    def _first_tokens(self, reqs: List[InferReq], out: ModelOutput, item_ids: List[int]):
        """Sample each finished prompt's first token; returns (updates, {item: token})."""
        sel = to_device(item_ids, self.device)
        b_req_idx = self._to_dev([r.req_idx for r in reqs], torch.int32)
        mask = rows_bitmask([r.grammar for r in reqs], [()] * len(reqs), out.logits.shape[-1])  # None: no grammar
        s = self.sample_rows(out.logits[sel], b_req_idx, reqs, [self._seed(r, 0) for r in reqs], mask)
        logprobs = token_logprobs(s.processed_logits, s.next_token_ids)
        self.req_to_next_token_ids[b_req_idx.long(), 0] = s.next_token_ids
        ids_cpu, lp_cpu = s.next_token_ids.tolist(), logprobs.tolist()
        top_width = min(max_top_logprobs(reqs), s.processed_logits.shape[-1])
        tops = [None] * len(reqs)
        if top_width:  # only when one of them asks
            top_ids, top_lps = (t.tolist() for t in top_logprobs(s.processed_logits, top_width))
            tops = [list(zip(i[:r.params.top_logprobs], v[:r.params.top_logprobs])) if r.params.top_logprobs else None
                    for r, i, v in zip(reqs, top_ids, top_lps)]
        updates = []
        for req, tok, lp, top in zip(reqs, ids_cpu, lp_cpu, tops):
            req.append_token(tok, lp)
            updates.append(self._update(req, [tok], [lp], accept_len=0, top_logprobs=None if top is None else [top]))
        self._update_penalties(reqs, [[t] for t in ids_cpu])
        return updates, dict(zip(item_ids, ids_cpu))

    @staticmethod
    def _seed(req: InferReq, mtp_index: int) -> Optional[int]:
        if req.params.seed is None:
            return None
        return (req.params.seed + len(req.output_ids) + mtp_index) % SEED_MODULUS

    def _update(self, req: InferReq, toks, lps, accept_len: int, draft_confidence=None,
                top_logprobs=None) -> ReqStepUpdate:
        """``top_logprobs``: per token of ``toks``, its (id, log-prob) alternatives; a request that
        asks for them gets a list (empty without tokens), one that asks 0 None."""
        if req.params.top_logprobs and top_logprobs is None:
            top_logprobs = [[] for _ in toks]
        return ReqStepUpdate(
            req_id=req.req_id,
            token_ids=toks,
            logprobs=lps,
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            mtp_accepted_token_num=req.mtp_accepted_token_num,
            asd_relaxed_token_num=req.asd_relaxed_token_num,
            asd_regret_spent=req.asd_regret_spent,
            accept_len=accept_len,
            draft_confidence=draft_confidence,
            top_logprobs=top_logprobs if req.params.top_logprobs else None,
            error=req.error,
            queue_time_s=req.queue_time_s,
            prompt_cached_tokens=req.prompt_cached_len,
        )

    def _update_penalties(self, reqs: List[InferReq], committed: List[List[int]]) -> None:
        idx, toks = [], []
        for req, ts in zip(reqs, committed):
            if req.has_penalty and ts:
                idx.extend([req.req_idx] * len(ts))
                toks.extend(ts)
        if idx:
            self.params_manager.update_penalty_state(
                self._to_dev(idx, torch.int32), self._to_dev(toks, torch.int64)
            )

    # ---- mixed: every decode row and prefill chunks in one forward (step_rows.py) ----
    def mixed(self, rows_owner: StepRows, decoding: List[InferReq], reqs: List[InferReq],
              chunk_lens: List[int]) -> List[ReqStepUpdate]:
        """One forward over the K + 1 decode rows of every request in ``decoding`` and the next
        ``chunk_lens[i]`` prompt tokens of each of ``reqs``; then the one decode flow, with the
        first token (and drafts) of every prompt this step finishes sampled beside the rows."""
        step = self.stage_mixed(rows_owner, decoding, reqs, chunk_lens)
        self.launch_mixed(step)
        return self.commit_mixed(step)

    def stage_mixed(self, rows_owner: StepRows, decoding: List[InferReq], reqs: List[InferReq],
                    chunk_lens: List[int], kv_ahead: Optional[Dict[int, int]] = None) -> "MixedStep":
        """A mixed step's slots and rows, staged (host work and one copy; nothing runs yet). ``kv_ahead``: by
        req_idx, the KV positions a request gains before the step runs (staged under the step in flight: 1
        for a request it decodes, its chunk for a prompt)."""
        k1 = self.mtp_step + 1
        ahead = kv_ahead or {}
        start = [r.kv_len + ahead.get(r.req_idx, 0) for r in reqs]
        slots = self.mem_manager.alloc(len(decoding) * k1 + sum(chunk_lens))  # [rows] host
        items = [RowItem(r.req_idx, r.kv_len + ahead.get(r.req_idx, 0), k1) for r in decoding]
        items += [RowItem(r.req_idx, s, n, r.prompt_ids) for r, s, n in zip(reqs, start, chunk_lens)]
        done_items = [len(decoding) + i for i, (r, s, n) in enumerate(zip(reqs, start, chunk_lens)) if s + n >= r.prompt_len]
        batch = rows_owner.stage(items, slots)
        return MixedStep(rows_owner, decoding, reqs, chunk_lens, slots, batch, done_items)

    def drop_mixed(self, step: "MixedStep") -> None:
        """A staged mixed step that will not run: its slots back."""
        self.mem_manager.free(step.slots.tolist())

    def launch_mixed(self, step: "MixedStep") -> None:
        """The staged step's forward and the one decode flow, queued (no host wait)."""
        rows_owner, decoding, batch, done_items = step.rows_owner, step.decoding, step.batch, step.done_items
        k1 = self.mtp_step + 1
        real = len(decoding) * k1
        mi, out = rows_owner.forward_rows(batch, done_items)
        done = [step.reqs[i - len(decoding)] for i in done_items]
        rows = DecodeRows(
            reqs=decoding, mtp_step=self.mtp_step, b_req_idx=rows_owner.b_req_idx[:real],
            b_mtp_index=rows_owner.b_mtp_index[:real], b_seq_len=rows_owner.b_seq_len[:real],
            b_seq_len_cpu=rows_owner.staged_seq_len_cpu[:real], mem_indexes=rows_owner.mem_indexes[:real],
            mem_indexes_cpu=step.slots[:real], b_req_mtp_start_loc=self.decode_step.b_req_mtp_start_loc[:len(decoding)],
            model_input=mi,
        )
        first_req_idx = self._to_dev([r.req_idx for r in done], torch.int32)
        first_pos = [step.reqs[i - len(decoding)].prompt_len for i in done_items]  # their prompts are done

        def propose_rows(decode_ids, first_ids, accept_len) -> MixedProposal:
            return MixedProposal(rows_owner.propose_after(batch, mi, out, decode_ids, done_items, first_ids))

        def propose_blocks(decode_ids, first_ids, accept_len) -> MixedProposal:
            rows_owner.write_context(batch, mi, out)
            anchors = MixedAnchors(verified=decode_ids, accept_len=accept_len, row0_seq_len=rows.b_seq_len[::k1],
                                   req_idx=rows.b_req_idx[::k1],
                                   **self._first_anchors(first_pos, first_req_idx, first_ids))
            return self.draft.propose_mixed(anchors, mi.max_len_in_batch)

        propose = None
        if rows_owner.draft is not None:
            propose = propose_rows
        elif self.draft is not None:  # a draft that drafts the step itself (dspark)
            propose = propose_blocks
        firsts = FirstTokens(done, first_req_idx, rows_owner.logit_rows(batch, done_items), propose)
        step.rows, step.done = rows, done
        step.pending = self.decode_step.launch_finish(rows, out, self.sample_rows, self._seed, firsts)

    def commit_mixed(self, step: "MixedStep", host: Optional[HostStepResult] = None) -> List[ReqStepUpdate]:
        """Wait for a launched mixed step and commit it: the chunks' progress, the decode rows' tokens, each
        finished prompt's first token. ``host``: its result, when the caller has waited for it already."""
        if host is None:
            host = self.decode_step.wait(step.pending)
        real = step.rows.num_real_rows
        chunk_slots = step.slots[real:].tolist()
        for req, start, n in zip(step.reqs, itertools.accumulate([0] + step.chunk_lens), step.chunk_lens):
            req.slots.extend(chunk_slots[start:start + n])
            req.kv_len += n
        updates = self.commit_decode(step.rows, host)
        first = [(host.ids[real + j], host.logprobs[real + j]) for j in range(len(step.done))]
        for j, (req, (tok, lp)) in enumerate(zip(step.done, first)):
            req.append_token(tok, lp)
            k = req.params.top_logprobs
            top = [host.row_top_logprobs(real + j, k)] if k else None
            updates.append(self._update(req, [tok], [lp], accept_len=0, top_logprobs=top))
        self._update_penalties(step.done, [[tok] for tok, _ in first])
        return updates

    # ---- decode: one owner (DecodeStep), three call sites (here and the DP backend) ----
    def prepare_decode_rows(self, reqs: List[InferReq], num_rows: Optional[int] = None,
                            graph_size: Optional[int] = None) -> DecodeRows:
        """K+1 KV slots and rows per request, padded with HOLD rows to ``num_rows`` (DP: ``graph_size``
        requests' rows when that is a ladder size) or to the CUDA graph ladder's size."""
        return self.decode_step.prepare(reqs, num_rows, graph_size=graph_size)

    def decode_model_input(self, rows: DecodeRows) -> ModelInput:
        """The eager forward's input for ``rows``; also kept in ``rows.model_input`` for the draft."""
        rows.model_input = self.decode_step.model_input(rows)
        return rows.model_input

    def decode_forward(self, rows: DecodeRows) -> ModelOutput:
        return self.decode_step.forward(rows)

    def decode(self, reqs: List[InferReq]) -> List[ReqStepUpdate]:
        rows = self.prepare_decode_rows(reqs)
        out = self.decode_forward(rows)
        return self.verify_draft_commit(rows, out)

    def verify_draft_commit(self, rows: DecodeRows, out: ModelOutput) -> List[ReqStepUpdate]:
        """The one decode flow: sample -> verify -> draft -> scatter (device), then the host commit."""
        return self.commit_decode(rows, self.decode_step.finish(rows, out, self.sample_rows, self._seed))

    def launch_verify_draft(self, rows: DecodeRows, out: ModelOutput) -> PendingResult:
        """The device half of ``verify_draft_commit``, queued without a host wait."""
        return self.decode_step.launch_finish(rows, out, self.sample_rows, self._seed)

    def commit_decode(self, rows: DecodeRows, host: HostStepResult) -> List[ReqStepUpdate]:
        """The host half: commit each request's tokens, free the slots nobody kept, build the
        updates (none for a request that had finished before an overlapped step ran)."""
        commits, free_slots = commit_step(rows.reqs, host, rows.mem_indexes_cpu.tolist(), rows.rows_per_req)
        if free_slots:
            self.mem_manager.free(free_slots)
        kept = [(req, c) for req, c in zip(rows.reqs, commits) if c is not None]
        self._update_penalties([req for req, _ in kept], [c.tokens for _, c in kept])
        return [self._update(req, c.tokens, c.logprobs, len(c.tokens), c.draft_confidence, c.top_logprobs)
                for req, c in kept]

    def flush_decode(self) -> List[ReqStepUpdate]:
        """Commit a decode step still in flight (overlap); the base backend never leaves one."""
        return []

    def drop_inflight(self) -> None:
        """Forget a step still in flight without committing it (the pools are reset after a failure)."""


def draft_cache_needs(args: StartArgs) -> DraftKvNeeds:
    """What the draft adds to the KV pool and the request table, as its proposer reports it."""
    if not args.mtp_mode:
        return DraftKvNeeds(kv_layers=None, extra_positions=0)
    from lightllm.server.router.model_infer.mtp_speculative.draft import proposer_class

    return proposer_class(args.mtp_mode).kv_needs(args.mtp_draft_model_dir, args.mtp_step)


def graph_capable(args: StartArgs, parallel: ParallelContext) -> bool:
    """Where graphs can be captured (with --disable_cudagraph: where the eager path pads as they would): one rank,
    or with --enable_tp_cudagraph several, which run the same steps in lock-step, so each captures the same graphs
    in the same order with its collectives inside (DP groups: the decode ladder only, every group padded to the
    size of the fullest); never with micro-batch overlap (two micro-batches' collectives interleave on two
    streams)."""
    if args.enable_decode_microbatch_overlap:
        return False
    return parallel.world_size == 1 or args.enable_tp_cudagraph


def decode_graph_plan(args: StartArgs, device: torch.device, parallel: ParallelContext):
    """(padding ladder, capture graphs?) for this backend. CUDA pads decode batches to the
    ladder with or without graphs."""
    if device.type != "cuda":
        return None, False
    max_bs = min(args.graph_max_batch_size, args.running_max_req_size)
    ladder = GraphLadder.from_flags(max_bs, min(args.graph_split_batch_size, max_bs), args.graph_grow_step_size)
    capable = graph_capable(args, parallel)
    if not args.disable_cudagraph and not capable:
        logger.info("CUDA graphs need --tp 1 (or --enable_tp_cudagraph) without micro-batch overlap: decoding eagerly")
    return ladder, capable and not args.disable_cudagraph
