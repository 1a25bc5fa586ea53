"""The DSpark proposer: one block pass per request drafts all K tokens (``--mtp_mode dspark``).

Same calls as ``DraftProposer`` (see draft.py), and ``propose_mixed`` for a mixed step (decode rows
and prompt chunks in one forward). After every target forward (prefill chunk, decode rows or
both) the context K/V of all its tokens is written; a rejected row's context is overwritten
when its slot is reused, and no block ever reads past its anchor."""
from typing import Dict, List, Optional, Sequence

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.models.dspark.model import DSparkDraftModel
from lightllm.server.router.model_infer.mtp_speculative.proposer import (
    DraftKvNeeds, MixedAnchors, MixedProposal, PrefillProposal, PrefixCacheRule, Proposal,
)


class DSparkProposer:
    has_confidence = True
    uses_accept_len = True  # the block is anchored at each request's last accepted row
    drafts_prefill_rows = False  # prefills draft through propose_after_prefill, mixed steps propose_mixed

    def __init__(self, draft_model: DSparkDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step
        k1 = self.mtp_step + 1
        dev = draft_model.target.device
        # first decode row of every request (the layout of DecodeStep: K+1 rows per request)
        self._req_start = torch.arange(0, draft_model.max_block_reqs * k1, k1, dtype=torch.int64, device=dev)

    @staticmethod
    def kv_needs(draft_dirs: Sequence[str], mtp_step: int) -> DraftKvNeeds:
        """One KV buffer per draft layer; its block is written past the anchor."""
        from lightllm.models.dspark.config import DSparkConfig

        cfg = DSparkConfig.load(draft_dirs[0])
        return DraftKvNeeds(kv_layers=cfg.num_hidden_layers, extra_positions=cfg.block_size)

    def prefix_cache_rule(self) -> PrefixCacheRule:
        """The context K/V of a position comes from the target's features there alone (prefill or
        a kept decode row): every cached position is exact."""
        return PrefixCacheRule()

    @torch.no_grad()
    def propose(
        self, model_input: ModelInput, out: ModelOutput, first_tokens: torch.Tensor, accept_len: torch.Tensor
    ) -> Proposal:
        """Decode: rows are K+1 per request (padding requests included, their accept_len 1).
        The anchor of request r is the token its last accepted row verified, at position
        kv_len + accept_len. Returns all_next [rows, K+1] (every row of a request holds its
        proposals) and the confidences [requests, K]."""
        k1 = self.mtp_step + 1
        rows = first_tokens.shape[0]
        m = rows // k1
        self.model.fill_context(model_input, out.aux_hidden_states)
        start = self._req_start[:m]
        toks, conf = self._decode_blocks(first_tokens, accept_len[:m], model_input.b_seq_len[start],
                                         model_input.b_req_idx[start], model_input.max_len_in_batch)
        all_next = torch.empty((rows, k1), dtype=torch.int64, device=first_tokens.device)
        all_next[:, 0] = first_tokens
        all_next[:, 1:] = toks.repeat_interleave(k1, dim=0)
        return Proposal(all_next, conf)

    def _decode_blocks(self, verified: torch.Tensor, accept_len: torch.Tensor, row0_seq_len: torch.Tensor,
                       req_idx: torch.Tensor, max_len: int, first_req_idx: Optional[torch.Tensor] = None,
                       first_pos: Optional[torch.Tensor] = None, first_ids: Optional[torch.Tensor] = None):
        """One block per decode request, anchored at the token its last accepted row verified (at
        position kv_len + accept_len: row 0 sees kv_len + 1 keys), then one per finished prompt
        (``first_*``: anchored at its first token). Returns ([blocks, K], [blocks, K])."""
        n = accept_len.shape[0]
        a = accept_len.long()
        anchors = verified[self._req_start[:n] + a - 1]
        anchor_pos = row0_seq_len.long() - 1 + a
        if first_ids is not None:
            anchors = torch.cat([anchors, first_ids.long()])
            anchor_pos = torch.cat([anchor_pos, first_pos.long()])
            req_idx = torch.cat([req_idx.long(), first_req_idx.long()])
        return self.model.propose_block(req_idx, anchor_pos, anchors, max_len + self.model.block_size)

    @torch.no_grad()
    def propose_mixed(self, model_input: ModelInput, out: ModelOutput, anchors: MixedAnchors) -> MixedProposal:
        """A mixed step: the context of every row (decode rows and prompt chunks alike), then one
        block per decode request and per finished prompt in one pass. Not captured in a graph."""
        self.model.fill_context(model_input, out.aux_hidden_states)
        n = anchors.accept_len.shape[0]
        toks, conf = self._decode_blocks(anchors.verified, anchors.accept_len, anchors.row0_seq_len,
                                         anchors.req_idx, model_input.max_len_in_batch, anchors.first_req_idx,
                                         anchors.first_pos, anchors.first_ids)
        guesses = torch.cat([toks[:n].repeat_interleave(self.mtp_step + 1, dim=0), toks[n:]])
        return MixedProposal(guesses, conf)

    @torch.no_grad()
    def propose_after_prefill(
        self, reqs, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int], first_tokens: Dict[int, int],
    ) -> Optional[PrefillProposal]:
        """Write the context of every prefilled position; for requests whose prompt is done
        (``first_tokens``: item -> token) draft a block anchored at the first generated token."""
        self.model.fill_context(model_input, out.aux_hidden_states)
        done = sorted(first_tokens)
        if not done:
            return None
        dev = out.hidden_states.device
        req_idx = torch.tensor([reqs[i].req_idx for i in done], dtype=torch.int64, device=dev)
        anchor_pos = [reqs[i].kv_len for i in done]  # the prompt's length: the first generated token's position
        toks, conf = self.model.propose_block(
            req_idx, torch.tensor(anchor_pos, dtype=torch.int64, device=dev),
            torch.tensor([first_tokens[i] for i in done], dtype=torch.int64, device=dev),
            max(anchor_pos) + self.model.block_size,
        )
        return PrefillProposal(req_idx, toks, conf)
