"""The DSpark proposer: one block pass per request drafts all K tokens (``--mtp_mode dspark``).

Same calls as ``DraftProposer`` (see draft.py). After every target forward (prefill chunk or
decode rows) the context K/V of all its tokens is written; a rejected row's context is
overwritten when its slot is reused, and no block ever reads past its anchor."""
from typing import Dict, List, Optional, Sequence

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.models.dspark.model import DSparkDraftModel
from lightllm.server.router.model_infer.mtp_speculative.proposer import (
    DraftKvNeeds, PrefillProposal, PrefixCacheRule, Proposal,
)


class DSparkProposer:
    has_confidence = True
    uses_accept_len = True  # the block is anchored at each request's last accepted row
    drafts_prefill_rows = False  # every prefill drafts through propose_after_prefill

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
        a = accept_len[:m].long()
        anchors = first_tokens[start + a - 1]
        anchor_pos = model_input.b_seq_len[start].long() - 1 + a  # row 0 caches kv_len + 1 tokens
        toks, conf = self.model.propose_block(
            model_input.b_req_idx[start], anchor_pos, anchors, model_input.max_len_in_batch + self.model.block_size
        )
        all_next = torch.empty((rows, k1), dtype=torch.int64, device=first_tokens.device)
        all_next[:, 0] = first_tokens
        all_next[:, 1:] = toks.repeat_interleave(k1, dim=0)
        return Proposal(all_next, conf)

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
