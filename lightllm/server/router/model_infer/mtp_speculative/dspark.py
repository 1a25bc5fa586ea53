"""The DSpark proposer: one block pass per request drafts all K tokens (``--mtp_mode dspark``).

Same calls as ``DraftProposer`` (see draft.py), and ``write_context`` then ``propose_mixed`` for a step
laid out as rows (a mixed step of decode rows and prompt chunks, or a prefill step). After every target
forward the context K/V of all its tokens is written; a rejected row's context is overwritten when its
slot is reused, and no block ever reads past its anchor."""
from typing import Dict, List, Optional, Sequence

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.cuda_graph import CudaGraphSet, GraphLadder, capture_ladder
from lightllm.models.dspark.model import DSparkDraftModel
from lightllm.server.router.model_infer.mtp_speculative.proposer import (
    DraftKvNeeds, MixedAnchors, MixedProposal, PrefillProposal, PrefixCacheRule, Proposal,
)

# A padding block: the HOLD request's, anchored at position 1 with any valid token, as a padding request's
# block in a decode step (position 0 of the HOLD row keeps the HOLD slot that padding rows read).
HOLD_BLOCK_TOKEN = 0
HOLD_BLOCK_POS = 1


class DSparkProposer:
    has_confidence = True
    uses_accept_len = True  # the block is anchored at each request's last accepted row
    drafts_prefill_rows = False  # prefills draft through propose_after_prefill, mixed steps as blocks

    def __init__(self, draft_model: DSparkDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step
        k1 = self.mtp_step + 1
        dev = draft_model.target.device
        # first decode row of every request (the layout of DecodeStep: K+1 rows per request)
        self._req_start = torch.arange(0, draft_model.max_block_reqs * k1, k1, dtype=torch.int64, device=dev)
        # a mixed step's blocks: padded to a ladder, replayed from graphs (use_block_ladder; None: eagerly as they come)
        self._block_ladder: Optional[GraphLadder] = None
        self._block_graphs: Optional[CudaGraphSet] = None

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
        anchors, anchor_pos = self._decode_anchors(first_tokens, accept_len[:m], model_input.b_seq_len[start])
        toks, conf = self.model.propose_block(model_input.b_req_idx[start], anchor_pos, anchors,
                                              model_input.max_len_in_batch + self.model.block_size)
        all_next = torch.empty((rows, k1), dtype=torch.int64, device=first_tokens.device)
        all_next[:, 0] = first_tokens
        all_next[:, 1:] = toks.repeat_interleave(k1, dim=0)
        return Proposal(all_next, conf)

    def _decode_anchors(self, verified: torch.Tensor, accept_len: torch.Tensor, row0_seq_len: torch.Tensor):
        """Each decode request's block anchor: the token its last accepted row verified, at position
        kv_len + accept_len (row 0 sees kv_len + 1 keys). Returns (tokens, positions) [n] int64."""
        a = accept_len.long()
        return verified[self._req_start[:a.shape[0]] + a - 1], row0_seq_len.long() - 1 + a

    @torch.no_grad()
    def write_context(self, model_input: ModelInput, out: ModelOutput) -> None:
        """A mixed step's first half: the context K/V of every row (decode rows and prompt chunks
        alike) from the target's output. Graph-safe (StepRows captures it per rows size)."""
        self.model.fill_context(model_input, out.aux_hidden_states)

    def use_block_ladder(self, ladder: GraphLadder, use_graphs: bool) -> None:
        """Pad a mixed step's blocks to ``ladder``'s sizes with blocks of the HOLD request, and with
        ``use_graphs`` replay a graph per size (captured here, over static buffers)."""
        self._block_ladder = ladder
        dev = self.model.target.device
        size = ladder.max_size
        self._block_req = torch.full((size,), self.model.target.req_manager.HOLD_REQUEST_ID, dtype=torch.int64,
                                     device=dev)
        self._block_pos = torch.full((size,), HOLD_BLOCK_POS, dtype=torch.int64, device=dev)
        self._block_anchor = torch.full((size,), HOLD_BLOCK_TOKEN, dtype=torch.int64, device=dev)
        if use_graphs:
            self._block_graphs = CudaGraphSet(dev)
            capture_ladder(self._block_graphs, ladder.sizes,
                           lambda n: self._block_graphs.capture(n, lambda: self._padded_blocks(n)),
                           what="dspark block counts")

    def _padded_blocks(self, size: int):
        # a block's keys end within the request table
        table_width = self.model.target.req_manager.req_to_token_indexs.shape[1]
        return self.model.propose_block(self._block_req[:size], self._block_pos[:size], self._block_anchor[:size],
                                        table_width)

    @torch.no_grad()
    def propose_mixed(self, anchors: MixedAnchors, max_len: int) -> MixedProposal:
        """A mixed step's second half, after ``write_context``: one block per decode request and per
        finished prompt in one pass (padded to the block ladder's size when there is one).
        ``max_len``: a host bound on the step's KV lengths (the torch attention path's key grid)."""
        n = anchors.accept_len.shape[0]
        tok, pos = self._decode_anchors(anchors.verified, anchors.accept_len, anchors.row0_seq_len)
        tok, pos = torch.cat([tok, anchors.first_ids.long()]), torch.cat([pos, anchors.first_pos.long()])
        req = torch.cat([anchors.req_idx.long(), anchors.first_req_idx.long()])
        blocks = tok.shape[0]
        size = self._block_ladder.bucket_size(blocks) if self._block_ladder is not None else None
        if size is None:
            toks, conf = self.model.propose_block(req, pos, tok, max_len + self.model.block_size)
        else:
            self._block_req[:blocks], self._block_pos[:blocks], self._block_anchor[:blocks] = req, pos, tok
            self._block_req[blocks:size] = self.model.target.req_manager.HOLD_REQUEST_ID
            self._block_pos[blocks:size] = HOLD_BLOCK_POS
            self._block_anchor[blocks:size] = HOLD_BLOCK_TOKEN
            if self._block_graphs is not None:
                toks, conf = self._block_graphs.replay(size)
            else:
                toks, conf = self._padded_blocks(size)
            toks, conf = toks[:blocks], conf[:blocks]
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
