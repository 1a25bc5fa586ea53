"""DP backend: ``--dp M`` data-parallel groups, and decode micro-batch overlap.

Every rank keeps the whole router state (all requests, see router/manager.py). A
request runs on one DP group (``req.dp_rank``, chosen at admission), which alone owns
its req_idx row, KV slots and tables; the other groups keep a shadow ``InferReq`` that
advances from the step results the groups exchange after every step (``_exchange``).

All ranks run the same kind of step with the same number of rows, because the MLP of
every layer is tensor parallel over all ranks (docs/parallel.md):

- prefill: each group prefills its own chunk plan (its own --batch_max_tokens), padded
  with HOLD tokens up to the largest group's token count;
- decode: each group's requests (K+1 rows each) padded with HOLD rows up to the largest
  group's rows. A group without any request runs padding only.

``decode_mtp`` runs the rows in one forward. ``decode_overlap_mtp`` splits them in two
micro-batches whose forwards interleave layer by layer (one's collectives overlap the
other's compute), joins their logits and hidden states back into the same row layout,
and from there both run the one shared flow, ``verify_draft_commit`` (sample -> verify ->
host copy -> draft -> scatter -> commit), exactly like chunked-prefill decode.
"""
from typing import List, Sequence, Tuple

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate, graph_capable
from lightllm.server.router.model_infer.mode_backend.chunked_prefill.impl import ChunkedPrefillBackend


class DPBackend(ChunkedPrefillBackend):
    def __init__(self, args, device, dtype, parallel=None):
        super().__init__(args, device, dtype, parallel)
        self.dp_rank = self.parallel.dp_rank
        self.dp_size = self.parallel.dp_size
        self.overlap = args.enable_decode_microbatch_overlap
        self.overlap_schedule = False  # its decode lays rows out per DP group / micro-batch, step by step
        # --enable_tp_cudagraph: every group pads its decode rows to the ladder's size of the fullest group's
        # requests (the same size on every rank), so each rank replays its own graph of that size
        self.ladder_rows = graph_capable(args, self.parallel) and self.decode_step.ladder is not None

    def mixed_steps_enabled(self) -> bool:
        return False  # every rank runs the same kind of step: prefill and decode alternate

    def _by_group(self, reqs: Sequence[InferReq]) -> List[List[InferReq]]:
        groups: List[List[InferReq]] = [[] for _ in range(self.dp_size)]
        for req in reqs:
            groups[req.dp_rank].append(req)
        return groups

    # ---- request lifecycle: only the owning group holds table rows and slots ----
    # free_reqs: a shadow copy has req_idx -1 and no slots, so the base method does nothing for it
    def add_reqs(self, reqs: List[InferReq]) -> List[Tuple[InferReq, Exception]]:
        return super().add_reqs([r for r in reqs if r.dp_rank == self.dp_rank])

    # ---- prefill ----
    def prefill_chunks(self, reqs: List[InferReq]) -> List[ReqStepUpdate]:
        plans = [self.chunk_plan(group) for group in self._by_group(reqs)]
        tokens = [sum(lens) for _, lens in plans]
        picked, lens = plans[self.dp_rank]
        updates = self.prefill(picked, lens, pad_tokens=max(tokens) - tokens[self.dp_rank])
        for g, (group_picked, group_lens) in enumerate(plans):
            if g != self.dp_rank:  # shadow copies advance by the same plan
                for req, n in zip(group_picked, group_lens):
                    req.kv_len += n
        return self._exchange(updates, reqs)

    # ---- decode: the two DP call sites of the shared flow ----
    def decode(self, reqs: List[InferReq]) -> List[ReqStepUpdate]:
        groups = self._by_group(reqs)
        most = max(len(g) for g in groups)  # requests of the fullest group (>= 1)
        mine = groups[self.dp_rank]
        if self.overlap:
            updates = self.decode_overlap_mtp(mine, most)
        else:
            updates = self.decode_mtp(mine, most)
        return self._exchange(updates, reqs)

    def decode_mtp(self, reqs: List[InferReq], most: int) -> List[ReqStepUpdate]:
        """One forward over this group's rows, padded to ``most`` requests' rows (to the ladder's size of ``most``
        with graphs; past the ladder's largest size, eagerly)."""
        size = self.decode_step.ladder.bucket_size(most) if self.ladder_rows else None
        rows = self.prepare_decode_rows(reqs, num_rows=(size or most) * (self.mtp_step + 1), graph_size=size)
        return self.verify_draft_commit(rows, self.decode_forward(rows))

    def decode_overlap_mtp(self, reqs: List[InferReq], most: int) -> List[ReqStepUpdate]:
        """Two micro-batches of whole requests, interleaved forwards, one shared flow after."""
        k1 = self.mtp_step + 1
        blocks = microbatch_blocks(most)
        rows = self.prepare_decode_rows(reqs, num_rows=sum(blocks) * k1)
        model_input = self.decode_model_input(rows)
        index = microbatch_row_index(len(reqs), k1, blocks)
        outs = self.model.forward_microbatches([select_decode_rows(model_input, idx) for idx in index])
        return self.verify_draft_commit(rows, join_microbatch_outputs(outs, index))

    # ---- results of the other DP groups ----
    def _exchange(self, updates: List[ReqStepUpdate], reqs: List[InferReq]) -> List[ReqStepUpdate]:
        """Every rank learns every group's updates (in group order); shadow copies advance."""
        if self.dp_size == 1:
            return updates
        by_id = {r.req_id: r for r in reqs}
        merged = []
        for g, group_updates in enumerate(self.parallel.all_gather_across_dp(updates)):
            if g != self.dp_rank:
                for u in group_updates:
                    advance_shadow(by_id[u.req_id], u)
            merged.extend(group_updates)
        return merged


def advance_shadow(req: InferReq, u: ReqStepUpdate) -> None:
    """Apply another group's update to this rank's copy of its request (what the router reads)."""
    req.output_ids.extend(u.token_ids)
    req.output_logprobs.extend(u.logprobs)
    u.copy_totals_to(req)
    if u.accept_len:  # a decode step: the committed tokens' positions are now cached
        req.kv_len += u.accept_len
        req.decode_steps += 1


def microbatch_blocks(most: int) -> Tuple[int, int]:
    """Requests per micro-batch for a group of at most ``most`` requests; both >= 1, so
    every rank runs two non-empty forwards (the second may be padding only)."""
    first = (most + 1) // 2
    return first, max(1, most - first)


def microbatch_row_index(num_reqs: int, k1: int, blocks: Tuple[int, int]) -> List[torch.Tensor]:
    """Row indices (host int64) of the two micro-batches in the decode row layout
    (``num_reqs`` requests' K+1 rows, then padding): the first ``blocks[0]`` requests go to
    micro-batch 0, the rest to 1, and the padding fills each to ``blocks[i] * k1`` rows."""
    first = min(num_reqs, blocks[0])
    pad = torch.arange(num_reqs * k1, sum(blocks) * k1)
    pad_first = (blocks[0] - first) * k1
    return [
        torch.cat([torch.arange(0, first * k1), pad[:pad_first]]),
        torch.cat([torch.arange(first * k1, num_reqs * k1), pad[pad_first:]]),
    ]


def select_decode_rows(model_input: ModelInput, idx: torch.Tensor) -> ModelInput:
    """The decode ModelInput of rows ``idx`` (host int64 [n])."""
    dev = model_input.input_ids.device
    idx_dev = idx.to(dev)
    seq_cpu = model_input.b_seq_len_cpu[idx]
    return ModelInput(
        batch_size=int(idx.shape[0]),
        total_token_num=int(seq_cpu.sum()),
        max_len_in_batch=int(seq_cpu.max()),
        input_ids=model_input.input_ids[idx_dev],
        mem_indexes=model_input.mem_indexes[idx_dev],
        b_req_idx=model_input.b_req_idx[idx_dev],
        b_seq_len=model_input.b_seq_len[idx_dev],
        is_prefill=False,
        b_mtp_index=model_input.b_mtp_index[idx_dev],
        b_seq_len_cpu=seq_cpu,
        max_q_len=model_input.max_q_len,
    )


def join_microbatch_outputs(outs: Sequence[ModelOutput], index: Sequence[torch.Tensor]) -> ModelOutput:
    """Micro-batch outputs back into the one row layout: row ``index[i][j]`` <- ``outs[i]`` row j."""
    total = sum(int(idx.shape[0]) for idx in index)

    def join(part):  # one field of every output, e.g. logits [rows_i, vocab] -> [rows, vocab]
        first = part(outs[0])
        if first is None:
            return None
        joined = first.new_empty((total, first.shape[1]))
        for out, idx in zip(outs, index):
            joined[idx.to(first.device)] = part(out)
        return joined

    return ModelOutput(logits=join(lambda o: o.logits), hidden_states=join(lambda o: o.hidden_states),
                       aux_hidden_states=join(lambda o: o.aux_hidden_states))
